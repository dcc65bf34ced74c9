"""The KV cache of the running batch: left-padded per-layer keys/values, an attention mask and positions.

Row i of every tensor is one sequence. Its cache holds the prompt and all generated tokens but the last one
(the "pending" token, fed by the next decode step). Sequences of different lengths are left-padded: the mask
is 0 on padding, and each row carries its own next position id, so padding never shifts RoPE positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel


@dataclass
class KVBatch:
    """Cache, mask [B, L] (1 = real token) and next_positions [B] of the sequences in the running batch."""

    cache: DynamicCache
    mask: torch.Tensor
    next_positions: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])


def prefill(model: PreTrainedModel, prompts: list[list[int]], device: torch.device) -> tuple[KVBatch, torch.Tensor]:
    """Run the prompts (left-padded together) through the model; returns their KV batch and last logits [n, V]."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    batch = KVBatch(cache=out.past_key_values, mask=mask, next_positions=mask.sum(-1))
    return batch, out.logits[:, -1, :]


def decode(model: PreTrainedModel, batch: KVBatch, tokens: list[int]) -> torch.Tensor:
    """Feed one pending token per row; the batch's cache, mask and positions grow by one. Returns logits [B, V]."""
    device = batch.mask.device
    batch.mask = torch.cat([batch.mask, torch.ones((batch.size, 1), dtype=batch.mask.dtype, device=device)], 1)
    ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
    out = model(input_ids=ids, attention_mask=batch.mask, position_ids=batch.next_positions[:, None],
                past_key_values=batch.cache, use_cache=True)
    batch.cache = out.past_key_values
    batch.next_positions = batch.next_positions + 1
    return out.logits[:, -1, :]


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(tensor: torch.Tensor, pad: int, dim_from_end: int) -> torch.Tensor:
    if pad == 0:
        return tensor
    widths = [0, 0] * (dim_from_end - 1) + [pad, 0]
    return F.pad(tensor, widths)


def merge(running: KVBatch | None, newcomers: KVBatch) -> KVBatch:
    """The rows of `running` followed by those of `newcomers`, left-padded to a common length."""
    if running is None:
        return newcomers
    length = max(running.length, newcomers.length)
    pads = (length - running.length, length - newcomers.length)
    layers = []
    for (k_run, v_run), (k_new, v_new) in zip(_layers(running.cache), _layers(newcomers.cache), strict=True):
        # Cache tensors are [B, kv_heads, L, head_dim]: the sequence axis is the second from the end.
        keys = torch.cat([_pad_left(k_run, pads[0], 2), _pad_left(k_new, pads[1], 2)])
        values = torch.cat([_pad_left(v_run, pads[0], 2), _pad_left(v_new, pads[1], 2)])
        layers.append((keys, values))
    mask = torch.cat([_pad_left(running.mask, pads[0], 1), _pad_left(newcomers.mask, pads[1], 1)])
    return KVBatch(cache=DynamicCache(ddp_cache_data=layers), mask=mask,
                   next_positions=torch.cat([running.next_positions, newcomers.next_positions]))


def select(batch: KVBatch, rows: list[int]) -> KVBatch | None:
    """Keep only `rows` (in that order), dropping the left padding no remaining row needs; None when empty."""
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=batch.mask.device)
    mask = batch.mask.index_select(0, index)
    # Columns before the first real token of any kept row are padding for all of them: cut them, so a long
    # sequence that left does not make every later step attend over its length.
    start = int(mask.any(0).nonzero()[0]) if mask.any() else 0
    layers = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
              for k, v in _layers(batch.cache)]
    return KVBatch(cache=DynamicCache(ddp_cache_data=layers), mask=mask[:, start:],
                   next_positions=batch.next_positions.index_select(0, index))
