"""The KV cache of the running batch: left-padded per-layer keys/values, an attention mask and positions.

Row i of every tensor is one sequence. Its cache holds the prompt and all generated tokens but the last one
(the "pending" token, fed by the next decode step). Sequences of different lengths are left-padded: the mask
is 0 on padding, and each row carries its own next position id, so padding never shifts RoPE positions.

The keys, values and mask live in buffers with free columns after the `length` in use: a decode step writes
its column in place instead of concatenating (which copied the whole cache every step, most of a step's
time on CPU). Joining sequences copies the cache once, into fresh buffers; leaving ones only move the rows
that fill their holes, and narrow the buffers (views).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from slimeflow.engine.native import ModelForward

MAX_HEADROOM = 256
"""Free columns reserved at most up front: a request allowed thousands of tokens that stops early should not
reserve them for every row; past this the buffers grow by doubling."""


class _HeadroomLayer(CacheLayerMixin):
    """One layer's keys/values in buffers [B, kv_heads, capacity, head_dim], of which columns [0, length) are in use.

    It implements transformers' cache-layer interface, the extension point its `Cache` takes. Its own layers either concatenate every step (DynamicLayer) or make attention read every column of
    a fixed capacity (StaticLayer); this one writes in place and returns views of the columns in use only.
    """

    is_sliding = False

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity_hint = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = max(self.capacity_hint, key_states.shape[-2])
        self.keys = key_states.new_zeros((*key_states.shape[:2], capacity, key_states.shape[-1]))
        self.values = value_states.new_zeros((*value_states.shape[:2], capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            self.resize(end)
        self.keys[:, :, self.length:end].copy_(key_states)
        self.values[:, :, self.length:end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def resize(self, capacity: int) -> None:
        """Move the columns in use into buffers of `capacity` columns (zeros past them)."""
        keys, values = self.keys, self.values
        self.keys = keys.new_zeros((*keys.shape[:2], capacity, keys.shape[-1]))
        self.values = values.new_zeros((*values.shape[:2], capacity, values.shape[-1]))
        self.keys[:, :, :self.length].copy_(keys[:, :, :self.length])
        self.values[:, :, :self.length].copy_(values[:, :, :self.length])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows on demand


def _filled_layer(keys: torch.Tensor, values: torch.Tensor, length: int) -> _HeadroomLayer:
    layer = _HeadroomLayer()
    layer.keys, layer.values, layer.length, layer.is_initialized = keys, values, length, True
    return layer


@dataclass
class KVBatch:
    """Cache, mask buffer [B, capacity] (1 = real token) and next_positions [B]; columns [0, length) are in use."""

    cache: Cache
    mask_buffer: torch.Tensor
    next_positions: torch.Tensor
    length: int

    @property
    def size(self) -> int:
        return int(self.mask_buffer.shape[0])

    @property
    def free(self) -> int:
        """Columns that decode steps can fill before the buffers must grow."""
        return int(self.mask_buffer.shape[1]) - self.length

    @property
    def mask(self) -> torch.Tensor:
        return self.mask_buffer[:, :self.length]


MIN_SHARED_PREFIX = 8
"""Leading tokens that every prompt of a prefill group must share for them to be prefilled once (a chat template's
system prompt: 30 of the demo's 38-39 prompt tokens); shorter common prefixes save less than a second pass costs."""


def prefill(forward: ModelForward, prompts: list[list[int]], device: torch.device, headroom: int = 0,
            share_prefix: bool = True) -> tuple[KVBatch, torch.Tensor]:
    """Run the prompts (left-padded together) through `forward`; returns their KV batch and last logits [n, V].

    `headroom` is how many decode steps to reserve columns for (capped at MAX_HEADROOM; more grow on demand).
    With `share_prefix`, the first tokens that all prompts share (at least MIN_SHARED_PREFIX of them, leaving each
    prompt one of its own) run once, and each row continues from a copy of their cache: SGLang's prefix cache
    within one prefill. A row is then [prefix, its padding, the rest of its prompt]: the mask hides the padding and
    positions count real tokens only, so the logits equal a full prefill's to float rounding.
    """
    room = min(headroom, MAX_HEADROOM)
    shared = shared_prefix(prompts) if share_prefix and len(prompts) > 1 else 0
    if shared < MIN_SHARED_PREFIX:
        return _prefill(forward, prompts, device, max(len(p) for p in prompts) + room)
    rests = [p[shared:] for p in prompts]
    base, _ = _prefill(forward, [prompts[0][:shared]], device, shared + max(len(r) for r in rests) + room)
    batch = gather_rows(base, [0] * len(prompts))
    return batch, extend(forward, batch, rests)


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens all prompts share, at most all but the last token of the shortest."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for i in range(limit):
        token = first[i]
        if any(p[i] != token for p in prompts):
            return i
    return max(limit, 0)


def _prefill(forward: ModelForward, prompts: list[list[int]], device: torch.device,
             capacity: int) -> tuple[KVBatch, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros((len(prompts), capacity), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):longest] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask[:, :longest].cumsum(-1) - 1).clamp(min=0)
    cache = Cache(layers=[_HeadroomLayer(capacity) for _ in range(forward.model.config.num_hidden_layers)])
    logits = forward(ids, mask[:, :longest], positions, cache)
    return KVBatch(cache=cache, mask_buffer=mask, next_positions=mask.sum(-1), length=longest), logits


def extend(forward: ModelForward, batch: KVBatch, tokens: list[list[int]]) -> torch.Tensor:
    """Feed row i the tokens `tokens[i]` (left-padded together after the columns in use, so padding may sit between
    a row's earlier tokens and these); the batch grows by the longest. Returns the last logits [B, V]."""
    longest = max(len(t) for t in tokens)
    if batch.free < longest:
        _grow(batch, batch.length + longest)
    start, end = batch.length, batch.length + longest
    ids = torch.zeros((batch.size, longest), dtype=torch.long)
    for row, row_tokens in enumerate(tokens):
        ids[row, longest - len(row_tokens):] = torch.tensor(row_tokens)
        batch.mask_buffer[row, end - len(row_tokens):end] = 1
    new_mask = batch.mask_buffer[:, start:end]
    positions = batch.next_positions[:, None] + (new_mask.cumsum(-1) - 1).clamp(min=0)
    logits = forward(ids.to(batch.mask_buffer.device), batch.mask_buffer[:, :end], positions, batch.cache)
    batch.length = end
    batch.next_positions = batch.next_positions + new_mask.sum(-1)
    return logits


PREFILL_PADDING = 0.15
"""At most this share of a prefill group's longest prompt is padding in any of its rows. On the benchmark's 64
prompts of 16-64 tokens: 0.15 makes 7 groups and takes 0.168 s of CPU, 0.25 (5 groups) 0.179 s, 0.4 (3) 0.197 s,
one group 0.233 s; smaller shares gain nothing more."""


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """Indexes of prompts to prefill together, longest first: a group's prompts are within PREFILL_PADDING of its
    longest, so prefill spends little on padding (one group of prompts of 16 to 64 tokens is 40% padding)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and lengths[i] >= (1 - PREFILL_PADDING) * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def decode(forward: ModelForward, batch: KVBatch, tokens: list[int]) -> torch.Tensor:
    """Feed one pending token per row; the batch's cache, mask and positions grow by one. Returns logits [B, V]."""
    if batch.free == 0:
        _grow(batch, 2 * batch.length)
    batch.mask_buffer[:, batch.length] = 1
    ids = torch.tensor(tokens, dtype=torch.long, device=batch.mask_buffer.device)[:, None]
    logits = forward(ids, batch.mask_buffer[:, :batch.length + 1], batch.next_positions[:, None], batch.cache)
    batch.length += 1
    batch.next_positions = batch.next_positions + 1
    return logits


def _grow(batch: KVBatch, capacity: int) -> None:
    for layer in batch.cache.layers:
        layer.resize(capacity)
    mask = batch.mask_buffer.new_zeros((batch.size, capacity))
    mask[:, :batch.length] = batch.mask
    batch.mask_buffer = mask


def _right_aligned(parts: list[tuple[torch.Tensor, int]], length: int, capacity: int, seq_dim: int) -> torch.Tensor:
    """Stack the rows of each (buffer, used columns) part, its used columns ending at column `length`."""
    first = parts[0][0]
    # Zeros, not empty: padding columns are read by attention (with weight 0), so they must be finite.
    shape = list(first.shape)
    shape[0], shape[seq_dim] = sum(p.shape[0] for p, _ in parts), capacity
    out = first.new_zeros(shape)
    row = 0
    for part, used in parts:
        rows = part.shape[0]
        out.narrow(0, row, rows).narrow(seq_dim, length - used, used).copy_(part.narrow(seq_dim, 0, used))
        row += rows
    return out


def merge(running: KVBatch | None, *newcomers: KVBatch) -> KVBatch:
    """The rows of `running` followed by those of each of `newcomers`, left-padded to a common length.

    Every row is copied once, however many batches join (the prefill groups of one admission round join
    together). The free columns are the largest of any part, so each keeps the room it reserved for its decode
    steps.
    """
    parts = [b for b in (running, *newcomers) if b is not None]
    if len(parts) == 1:
        return parts[0]
    length = max(b.length for b in parts)
    capacity = length + max(b.free for b in parts)
    layers = []
    lengths = [b.length for b in parts]
    for part_layers in zip(*(b.cache.layers for b in parts), strict=True):
        # Cache tensors are [B, kv_heads, L, head_dim]: the sequence axis is 2.
        keys = _right_aligned([(layer.keys, n) for layer, n in zip(part_layers, lengths, strict=True)],
                              length, capacity, 2)
        values = _right_aligned([(layer.values, n) for layer, n in zip(part_layers, lengths, strict=True)],
                                length, capacity, 2)
        layers.append(_filled_layer(keys, values, length))
    mask = _right_aligned([(b.mask_buffer, n) for b, n in zip(parts, lengths, strict=True)], length, capacity, 1)
    return KVBatch(cache=Cache(layers=layers), mask_buffer=mask, length=length,
                   next_positions=torch.cat([b.next_positions for b in parts]))


def compaction_order(alive: list[bool]) -> list[int]:
    """Rows to keep, in the order `select` keeps them cheapest: live rows at the back fill the holes at the front.

    Only the rows that fill holes are copied, instead of every row after the first finished one.
    """
    kept = sum(alive)
    movers = iter(i for i in range(kept, len(alive)) if alive[i])
    return [i if alive[i] else next(movers) for i in range(kept)]


def select(batch: KVBatch, rows: list[int]) -> KVBatch | None:
    """Keep only `rows` (in that order), dropping the left padding no remaining row needs; None when empty.

    Works in place: rows whose position changes are copied into their new slot and the buffers are narrowed to
    the kept rows and columns (views of the same storage), so `batch` must not be used afterwards.
    """
    if not rows:
        return None
    device = batch.mask_buffer.device
    moved = [(dst, src) for dst, src in enumerate(rows) if dst != src]
    dst = torch.tensor([d for d, _ in moved], dtype=torch.long, device=device)
    src = torch.tensor([s for _, s in moved], dtype=torch.long, device=device)
    mask_buffer = _moved_rows(batch.mask_buffer, dst, src)[:len(rows)]
    mask = mask_buffer[:, :batch.length]
    # Columns before the first real token of any kept row are padding for all of them: cut them, so a long
    # sequence that left does not make every later step attend over its length.
    start = int(mask.any(0).nonzero()[0]) if mask.any() else 0
    layers = [_filled_layer(*(_moved_rows(t, dst, src)[:len(rows), :, start:] for t in (layer.keys, layer.values)),
                            batch.length - start)
              for layer in batch.cache.layers]
    positions = batch.next_positions.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
    return KVBatch(cache=Cache(layers=layers), mask_buffer=mask_buffer[:, start:],
                   next_positions=positions, length=batch.length - start)


def gather_rows(batch: KVBatch, rows: list[int]) -> KVBatch:
    """A new batch whose row i is a copy of `batch`'s row `rows[i]`; rows may repeat (sequences that share a
    prompt start from copies of its one prefill) or be left out (sequences that finished at their first token)."""
    index = torch.tensor(rows, dtype=torch.long, device=batch.mask_buffer.device)
    layers = [_filled_layer(layer.keys.index_select(0, index), layer.values.index_select(0, index), layer.length)
              for layer in batch.cache.layers]
    return KVBatch(cache=Cache(layers=layers), mask_buffer=batch.mask_buffer.index_select(0, index),
                   next_positions=batch.next_positions.index_select(0, index), length=batch.length)


def _moved_rows(buffer: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`buffer` with rows `src` copied to rows `dst` in place (sources gathered first, so any order is safe)."""
    if dst.numel():
        buffer.index_copy_(0, dst, buffer.index_select(0, src))
    return buffer
