"""SFT loss masks by chat-template style (slimeflow.rollout.loss_masks; slime.utils.mask_utils over it), on a toy
one-character-per-token tokenizer with a Qwen-style template, with a default system turn (as Qwen2.5's) or without
(as Qwen3's)."""

import pytest

from slimeflow.rollout import loss_masks
from slimeflow.slime_compat import install

install()

from slime.utils.mask_utils import MultiTurnLossMaskGenerator, get_response_lengths  # noqa: E402

DEFAULT_SYSTEM = "<|im_start|>system\nHELPFUL<|im_end|>\n"


class ToyTokenizer:
    """One token per character; a ChatML template wrapping consecutive tool turns in one user turn."""

    def __init__(self, default_system=False):
        self.default_system = default_system

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        out = {"input_ids": [ord(c) for c in text]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out

    def decode(self, ids):
        return "".join(map(chr, ids))

    def get_added_vocab(self):
        return {}

    def render(self, messages, add_generation_prompt=False):
        text = DEFAULT_SYSTEM if self.default_system and messages[0]["role"] != "system" else ""
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                opens = i == 0 or messages[i - 1]["role"] != "tool"
                closes = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
                text += ("<|im_start|>user" if opens else "") + f"\n<r>{m['content']}</r>"
                text += "<|im_end|>\n" if closes else ""
            else:
                text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kwargs):
        text = self.render(messages, add_generation_prompt)
        return [ord(c) for c in text] if tokenize else text


CONVERSATION = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                {"role": "tool", "content": "T1"}, {"role": "tool", "content": "T2"},
                {"role": "assistant", "content": "A2", "step_loss_mask": 0},
                {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A3"}]


@pytest.mark.parametrize("default_system", [False, True])
def test_the_template_layout_is_measured(default_system):
    layout = loss_masks.measure_layout(ToyTokenizer(default_system))
    assert layout == loss_masks.TemplateLayout(auto_system=len(DEFAULT_SYSTEM) if default_system else 0,
                                               generation_prompt=len("<|im_start|>assistant\n"))


def test_the_qwen_style_keeps_a_default_system_turn_once():
    tokenizer = ToyTokenizer(default_system=True)
    conversation = [m for m in CONVERSATION if m["role"] != "tool"]
    generator = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type="qwen")
    ids, mask = generator.get_loss_mask(conversation)
    assert tokenizer.decode(ids) == tokenizer.render(conversation)
    assert generator.get_text_from_loss_mask(ids, mask) == ["A1<|im_end|>\n", "A3<|im_end|>\n"]


@pytest.mark.parametrize("style", ["qwen3", "qwen3_5"])
def test_both_styles_give_the_full_rendering_and_train_only_assistant_turns(style):
    tokenizer = ToyTokenizer()
    generator = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=style)
    ids, mask = generator.get_loss_mask(CONVERSATION)
    assert tokenizer.decode(ids) == tokenizer.render(CONVERSATION)  # the two tool results wrapped in one user turn
    assert generator.get_text_from_loss_mask(ids, mask) == ["A1<|im_end|>\n", "A3<|im_end|>\n"]  # A2: step_loss_mask 0


def test_distill_style_trains_the_last_messages_text_after_the_prompt():
    tokenizer = ToyTokenizer()
    ids, mask = MultiTurnLossMaskGenerator(tokenizer, "distill_qwen").get_loss_mask(CONVERSATION[:2])
    prompt = tokenizer.render(CONVERSATION[:1], add_generation_prompt=True)
    assert tokenizer.decode(ids) == prompt + "A1" and mask == [0] * len(prompt) + [1, 1]


def test_unknown_styles_and_unrecognised_templates_are_refused():
    with pytest.raises(ValueError, match="loss-mask-type"):
        MultiTurnLossMaskGenerator(ToyTokenizer(), "llama")

    class Plain(ToyTokenizer):
        def render(self, messages, add_generation_prompt=False):
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    with pytest.raises(ValueError, match="assistant turn 0 not found"):
        MultiTurnLossMaskGenerator(Plain(), "qwen3_5").get_loss_mask(CONVERSATION[:2])


def test_response_lengths_run_from_the_first_trained_token():
    assert get_response_lengths([[0, 0, 1, 0, 1], [0, 0], [1]]) == [3, 0, 1]
