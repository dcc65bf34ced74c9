"""Token ids and a loss mask (1 = trained) for a whole conversation, rendered with a model's chat template: what
SFT trains on, the assistant turns supervised and everything else (system, user, tool turns, the templates'
headers) not. `step_loss_mask: 0` on an assistant message leaves that turn untrained too.

The styles, by the chat template they suit (slime's --loss-mask-type):
- "qwen3_5": render the conversation once and mask by character spans (needs offset mappings, a fast tokenizer).
  Right for templates whose rendering of a turn depends on later turns (Qwen3.5 keeps <think> only after the last
  user query); each assistant span starts after its "<|im_start|>assistant\\n" header (and a leading "<think>\\n").
- "qwen3": render turn by turn (consecutive tool results together, as Qwen's templates wrap them in one user turn),
  each beside a sentinel user turn so the template renders it as mid-conversation; an assistant turn's first
  `generation_prompt` tokens (the header the template adds for generation) are not trained. For templates that add
  no default system turn (Qwen3's): the sentinel's own rendering would carry one.
- "qwen": the same turn by turn, each turn rendered alone, the default system turn a template adds (Qwen2.5's)
  kept only before the first; consecutive tool turns are not grouped.
- "distill_qwen": the first message as the prompt (with the generation prompt) and the last one's text as the
  response.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

STYLES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")
_PROBE = "FOR TESTING ONLY"
_SENTINEL = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}
ASSISTANT_HEADER = "<|im_start|>assistant\n"
THINK_OPEN = "<think>\n"
TURN_END = "<|im_end|>"


@dataclass(frozen=True)
class TemplateLayout:
    """Token counts a turn-by-turn rendering must correct for, measured on the tokenizer's own template."""

    auto_system: int
    """Tokens of the system block the template adds to a conversation that has none (0 if it adds none)."""
    generation_prompt: int
    """Tokens the template appends with add_generation_prompt=True (an assistant turn's header)."""


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def _find_all(haystack: list[int], needle: list[int]) -> list[int]:
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i:i + len(needle)] == needle]


def measure_layout(tokenizer: Any) -> TemplateLayout:
    """Render two identical user turns: the gap between the two copies of the text is one turn's overhead, and
    whatever precedes the first copy beyond that overhead is the template's automatic system block."""
    text_ids = _ids(tokenizer, _PROBE)
    probe = [{"role": "user", "content": _PROBE}] * 2
    rendered = _ids(tokenizer, tokenizer.apply_chat_template(probe, tokenize=False, add_special_tokens=False))
    first, second = _find_all(rendered, text_ids)[:2]
    after_text = len(rendered) - len(text_ids) - second  # the turn's closing tokens
    before_text = (second - first) - after_text - len(text_ids)  # the turn's opening tokens
    generation = len(_render_ids(tokenizer, probe, add_special_tokens=False, add_generation_prompt=True))
    return TemplateLayout(auto_system=first - before_text, generation_prompt=generation - len(rendered))


def _turns(messages: list[dict[str, Any]]) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(index of the first message, the messages) per turn: a run of tool messages is one turn."""
    i = 0
    while i < len(messages):
        end = i + 1
        if messages[i]["role"] == "tool":
            while end < len(messages) and messages[end]["role"] == "tool":
                end += 1
        yield i, messages[i:end]
        i = end


def _turn_ids(tokenizer: Any, index: int, turn: list[dict[str, Any]], tools: Any, sentinel: bool) -> list[int]:
    if not sentinel:
        return _render_ids(tokenizer, turn, **({"tools": tools} if index == 0 else {}))
    if index == 0:  # the sentinel after the turn, cut off again
        tail = len(_render_ids(tokenizer, [_SENTINEL]))
        return _render_ids(tokenizer, turn + [_SENTINEL], tools=tools)[:-tail]
    head = len(_render_ids(tokenizer, [_SENTINEL]))
    return _render_ids(tokenizer, [_SENTINEL] + turn)[head:]


def turn_by_turn(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, layout: TemplateLayout,
                 sentinel: bool) -> tuple[list[int], list[int]]:
    """The "qwen3" (sentinel=True) and "qwen" (False) styles."""
    ids: list[int] = []
    mask: list[int] = []
    turns = _turns(messages) if sentinel else ((i, [m]) for i, m in enumerate(messages))
    for index, turn in turns:
        first = turn[0]
        turn_ids = _turn_ids(tokenizer, index, turn, tools, sentinel)
        if index > 0 and first["role"] != "system":  # the system block the template added to a lone turn
            turn_ids = turn_ids[layout.auto_system:]
        trained = first["role"] == "assistant" and first.get("step_loss_mask", 1) == 1
        header = min(layout.generation_prompt, len(turn_ids)) if trained else len(turn_ids)
        ids += turn_ids
        mask += [0] * header + [1] * (len(turn_ids) - header)
    return ids, mask


def _assistant_char_mask(text: str, messages: list[dict[str, Any]]) -> list[int]:
    chars = [0] * len(text)
    cursor = 0
    for number, message in enumerate(m for m in messages if m["role"] == "assistant"):
        header = text.find(ASSISTANT_HEADER, cursor)
        end = text.find(TURN_END, header + len(ASSISTANT_HEADER)) if header >= 0 else -1
        if end < 0:
            raise ValueError(f"loss mask (qwen3_5): assistant turn {number} not found in the rendered conversation "
                             f"(no {ASSISTANT_HEADER!r} ... {TURN_END!r} after character {cursor}); is this a "
                             "Qwen-style chat template?")
        start = header + len(ASSISTANT_HEADER)
        stop = end + len(TURN_END) + (text[end + len(TURN_END):end + len(TURN_END) + 1] == "\n")
        cursor = stop
        if message.get("step_loss_mask", 1) == 1:
            start += len(THINK_OPEN) if text.startswith(THINK_OPEN, start) else 0
            chars[start:stop] = [1] * (stop - start)
    return chars


def by_character_spans(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> tuple[list[int], list[int]]:
    """The "qwen3_5" style: a token is trained when any of its characters lies in an assistant span."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, tools=tools, return_dict=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded.get("offset_mapping")
    if offsets is None:
        raise ValueError("loss mask (qwen3_5) needs a fast tokenizer (return_offsets_mapping); load the tokenizer "
                         "with use_fast=True or pick another --loss-mask-type")
    ids = list(encoded["input_ids"])
    if ids != _render_ids(tokenizer, messages, tools=tools):
        raise ValueError("loss mask (qwen3_5): tokenizing the rendered conversation gives other tokens than "
                         "apply_chat_template(tokenize=True); the character spans would not line up with the tokens")
    prefix = [0]
    for value in _assistant_char_mask(text, messages):
        prefix.append(prefix[-1] + value)
    return ids, [int(end > start and prefix[end] > prefix[start]) for start, end in offsets]


def prompt_and_response(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> tuple[list[int], list[int]]:
    """The "distill_qwen" style: the first message as the prompt, the last one's text as the trained response."""
    prompt = _ids(tokenizer, tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True,
                                                           tools=tools))
    response = _ids(tokenizer, messages[-1]["content"])
    trained = int(messages[-1].get("step_loss_mask", 1) == 1)
    return prompt + response, [0] * len(prompt) + [trained] * len(response)


def trained_spans(tokenizer: Any, token_ids: list[int], loss_mask: list[int]) -> list[str]:
    """The decoded text of each run of trained tokens, in order (to eyeball a mask)."""
    spans: list[str] = []
    run: list[int] = []
    for token, trained in zip(token_ids, loss_mask, strict=False):
        if trained == 1:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans
