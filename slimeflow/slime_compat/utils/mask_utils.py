"""slime.utils.mask_utils: `MultiTurnLossMaskGenerator`, slime's SFT loss masks by --loss-mask-type, over slimeflow's
(slimeflow.rollout.loss_masks, whose docstring describes each style)."""

from __future__ import annotations

from typing import Any

from slimeflow.rollout import loss_masks

__all__ = ["MultiTurnLossMaskGenerator", "get_response_lengths"]

DISTILL_MARKER = "<｜Assistant｜>"
"""A token DeepSeek-R1-distilled Qwen tokenizers add: their "qwen" masks are the "distill_qwen" style."""


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """Per mask, the tokens from its first trained one to its end (0 when none is trained)."""
    return [len(mask) - mask.index(1) if 1 in mask else 0 for mask in loss_masks]


class MultiTurnLossMaskGenerator:
    """`get_loss_mask(messages, tools) -> (token_ids, loss_mask)` for tokenizer_type qwen, qwen3, qwen3_5 or
    distill_qwen."""

    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen") -> None:
        if tokenizer_type not in loss_masks.STYLES:
            raise ValueError(f"Unsupported tokenizer type: {tokenizer_type!r} (--loss-mask-type takes "
                             f"{', '.join(loss_masks.STYLES)})")
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        layout = (loss_masks.measure_layout(tokenizer) if tokenizer_type in ("qwen", "qwen3")
                  else loss_masks.TemplateLayout(0, 0))
        self.layout = layout
        self.system_message_length = layout.auto_system
        self.gen_token_length = layout.generation_prompt

    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

    def get_loss_mask(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                      ) -> tuple[list[int], list[int]]:
        style = self.tokenizer_type
        if style == "qwen" and DISTILL_MARKER in self.tokenizer.get_added_vocab():
            style = "distill_qwen"
        return getattr(self, f"gen_multi_turn_loss_mask_{style}")(messages, tools)

    # slime's per-style methods, which plug-ins call directly
    def gen_multi_turn_loss_mask_qwen(self, messages: list[dict[str, Any]], tools: Any = None
                                      ) -> tuple[list[int], list[int]]:
        return loss_masks.turn_by_turn(self.tokenizer, messages, tools, self.layout, sentinel=False)

    def gen_multi_turn_loss_mask_qwen3(self, messages: list[dict[str, Any]], tools: Any = None
                                       ) -> tuple[list[int], list[int]]:
        return loss_masks.turn_by_turn(self.tokenizer, messages, tools, self.layout, sentinel=True)

    def gen_multi_turn_loss_mask_qwen3_5(self, messages: list[dict[str, Any]], tools: Any = None
                                         ) -> tuple[list[int], list[int]]:
        return loss_masks.by_character_spans(self.tokenizer, messages, tools)

    def gen_multi_turn_loss_mask_distill_qwen(self, messages: list[dict[str, Any]], tools: Any = None
                                              ) -> tuple[list[int], list[int]]:
        return loss_masks.prompt_and_response(self.tokenizer, messages, tools)

    def get_loss_mask_with_multimodal_alignment(self, messages: list[dict[str, Any]], input_ids: list[int],
                                                tools: list[dict[str, Any]] | None = None
                                                ) -> tuple[list[int], list[int]]:
        """The text-only mask of `messages` right-aligned to a processor's `input_ids` (which add image tokens
        before the text's end): the extra leading positions are not trained."""
        text_only = [{**m, "content": _text_of(m["content"])} if isinstance(m.get("content"), list) else m
                     for m in messages]
        _, mask = self.get_loss_mask(text_only, tools=tools)
        extra = len(input_ids) - len(mask)
        if extra < 0:
            raise ValueError(f"input_ids ({len(input_ids)} tokens) are shorter than the text's loss mask "
                             f"({len(mask)}): the processor and the tokenizer tokenize the text differently")
        return input_ids, [0] * extra + mask

    def get_text_from_loss_mask(self, token_ids: list[int], loss_masks_: list[int]) -> list[str]:
        return loss_masks.trained_spans(self.tokenizer, token_ids, loss_masks_)


def _text_of(content: list[Any]) -> str:
    parts = [item.get("text", "") if isinstance(item, dict) and item.get("type") == "text" else item
             for item in content if isinstance(item, str) or (isinstance(item, dict) and item.get("type") == "text")]
    return " ".join(parts)
