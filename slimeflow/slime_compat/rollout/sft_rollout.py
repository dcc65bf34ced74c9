"""slime.rollout.sft_rollout: slime's SFT "rollout", which generates nothing. Each prompt is a conversation (a
messages list, --input-key messages), rendered with --hf-checkpoint's chat template into token ids with a loss mask
over the assistant turns (slime.utils.mask_utils, by --loss-mask-type). It needs no engine, so it runs under
--debug-train-only, as slime's SFT scripts run it."""

from __future__ import annotations

import functools
import logging
from typing import Any

from transformers import AutoTokenizer

from slimeflow.rollout.types import Sample
from slimeflow.slime_compat.utils.mask_utils import MultiTurnLossMaskGenerator

__all__ = ["generate_rollout"]

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _mask_generator(hf_checkpoint: str, loss_mask_type: str) -> MultiTurnLossMaskGenerator:
    """One per model and style: loading a tokenizer and measuring its template layout takes a while."""
    return MultiTurnLossMaskGenerator(AutoTokenizer.from_pretrained(hf_checkpoint), tokenizer_type=loss_mask_type)


def generate_rollout(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> list[list[Sample]]:
    """`args.rollout_batch_size` groups from `data_buffer`, each sample's conversation tokenized: `tokens` the whole
    conversation, `response_length` from the first trained token to the end, `loss_mask` over those, reward 0.
    Training only: slime's SFT has no evaluation rollout."""
    if evaluation:
        raise ValueError("slime.rollout.sft_rollout.generate_rollout makes training data only: give "
                         "--eval-function-path another function, or no eval sets")
    masks = _mask_generator(args.hf_checkpoint, getattr(args, "loss_mask_type", "qwen"))
    groups = data_buffer.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            _tokenize(masks, sample)
    if groups and groups[0]:
        log.debug("sft_rollout %d: first sample %d tokens, %d trained", rollout_id, len(groups[0][0].tokens),
                  sum(groups[0][0].loss_mask or []))
    return groups


def _tokenize(masks: MultiTurnLossMaskGenerator, sample: Sample) -> None:
    messages = sample.prompt
    if not isinstance(messages, list):
        raise ValueError(f"sft_rollout: sample {sample.index} has a {type(messages).__name__} prompt; it needs a "
                         "messages list: give --input-key the conversation column and leave --apply-chat-template "
                         "off")
    token_ids, loss_mask = masks.get_loss_mask(messages, tools=(sample.metadata or {}).get("tools"))
    if len(token_ids) != len(loss_mask):
        raise ValueError(f"sft_rollout: sample {sample.index}: {len(token_ids)} token ids but a loss mask of "
                         f"{len(loss_mask)}; the chat template and --loss-mask-type {masks.tokenizer_type} disagree")
    response_length = masks.get_response_lengths([loss_mask])[0]
    if response_length == 0:
        raise ValueError(f"sft_rollout: sample {sample.index} has no trained token (no assistant turn, or every "
                         "one has step_loss_mask 0); drop it from the data")
    sample.tokens = list(token_ids)
    sample.response_length = response_length
    sample.loss_mask = list(loss_mask[-response_length:])
    sample.reward = 0.0
    sample.status = Sample.Status.COMPLETED  # the conversation is the whole response: nothing is left to generate
