"""Dynamic batch sizing: pack samples into micro-batches under a token budget, and balance data-parallel ranks.

Packing changes only how samples are grouped for forward/backward; with the global-batch normaliser of
slimeflow.train.loss the loss and gradients are the same for any packing.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def pack_micro_batches(lengths: Sequence[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Indices of samples per micro-batch, each micro-batch's token total <= max_tokens.

    First-fit decreasing: near-minimal (at most 11/9 OPT + 1 bins; in practice the lower bound
    ceil(total / max_tokens) or one more). A sample longer than max_tokens gets a micro-batch of its own.
    With min_micro_batches (e.g. the largest count of any data-parallel rank, so every rank runs the same
    number), the fullest micro-batches are split until there are that many; raises when there are fewer samples.
    Indices inside a micro-batch are ascending; micro-batches are ordered by their first index.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_gpu must be positive, got {max_tokens}")
    if min_micro_batches > len(lengths):
        raise ValueError(f"cannot make {min_micro_batches} micro-batches out of {len(lengths)} samples")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[i]
        target = next((b for b, load in enumerate(loads) if load + size <= max_tokens), None)
        if target is None:
            bins.append([i])
            loads.append(size)
        else:
            bins[target].append(i)
            loads[target] += size
    while len(bins) < min_micro_batches:
        fullest = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: loads[b])
        halves = balanced_partition([lengths[i] for i in bins[fullest]], 2)
        members = bins.pop(fullest)
        loads.pop(fullest)
        for half in halves:
            bins.append([members[j] for j in half])
            loads.append(sum(lengths[i] for i in bins[-1]))
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def balanced_partition(lengths: Sequence[int], parts: int, equal_size: bool = False) -> list[list[int]]:
    """Split indices into `parts` groups with token totals as even as practical (longest-processing-time greedy).

    equal_size: every group gets len(lengths) / parts samples (which must divide), as data-parallel ranks need
    the same number of samples per step. Indices inside a group are ascending.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if equal_size and len(lengths) % parts:
        raise ValueError(f"{len(lengths)} samples do not split evenly over {parts} data-parallel ranks")
    capacity = len(lengths) // parts if equal_size else len(lengths)
    heap = [(0, p) for p in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, p = heapq.heappop(heap)
        groups[p].append(i)
        if len(groups[p]) < capacity:
            heapq.heappush(heap, (load + lengths[i], p))
    return [sorted(g) for g in groups]


def split_for_data_parallel(lengths: Sequence[int], dp_size: int, balance_data: bool) -> list[list[int]]:
    """Each rank's sample indices: contiguous equal slices, or token-balanced equal-count groups (--balance-data)."""
    if len(lengths) % dp_size:
        raise ValueError(f"{len(lengths)} samples do not split evenly over {dp_size} data-parallel ranks")
    if balance_data:
        return balanced_partition(lengths, dp_size, equal_size=True)
    per_rank = len(lengths) // dp_size
    return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(dp_size)]


def padded_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """The baseline without packing: fixed-size micro-batches where each sample is padded to the batch's longest.

    The micro-batch size is the largest count whose padded size (count x longest sample) fits max_tokens.
    """
    longest = max(lengths)
    size = max(1, max_tokens // longest)
    order = list(range(len(lengths)))
    return [order[i:i + size] for i in range(0, len(order), size)]
