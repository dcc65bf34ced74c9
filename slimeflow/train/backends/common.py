"""What both training backends compute with: per-sample log-probs from one micro-batch of right-padded rows, the
micro-batches of a rank's share, and the data-parallel helpers (device, process group, metric sums).

The torch backend runs these on its transformers model's output, the Megatron backend on the last pipeline stage's
(logits gathered over the TP ranks), so both compute log-probs and entropies with the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from slimeflow.config.train import BatchConfig
from slimeflow.errors import CheckpointError
from slimeflow.rollout.types import TrainBatch
from slimeflow.train.logprob_entropy import log_probs_and_entropy
from slimeflow.train.packing import pack_micro_batches

if TYPE_CHECKING:
    from slimeflow.train.backends.checkpoint import BackgroundCommit
    from slimeflow.train.backends.protocol import Backend


@dataclass
class LogProbs:
    """Per-sample log-probs of the response tokens (and their entropies when asked), one 1-D tensor per sample."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None = None


def default_device() -> torch.device:
    """The current GPU when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def scoring_model(backend: Backend, reference: bool, teacher: bool) -> Any:
    """The model a log-prob pass of `backend` runs: the OPD teacher, the reference model or the policy (either
    backend's: a module, or Megatron's list of model chunks). ValueError when the one asked for is not loaded."""
    model = backend.teacher_model if teacher else backend.ref_model if reference else backend.model
    if model is None:
        raise ValueError("no teacher model: it is loaded only with --use-opd --opd-type megatron" if teacher else
                         "no reference model: it is loaded only with --use-kl-loss or --kl-coef > 0")
    return model


@dataclass
class RowLayout:
    """One micro-batch as model input: its distinct rows (`distinct_rows`) right-padded to the longest.

    ids/mask: [rows, longest]; keep: the positions whose output predicts a response token; kept: each row's count
    of them; row_of: each sample's row (None: one row per sample); totals/lengths: each sample's token counts.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    keep: torch.Tensor
    kept: torch.Tensor
    row_of: torch.Tensor | None
    totals: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, rows: TrainBatch) -> RowLayout:
        """ValueError for a sample whose response leaves no prompt token to predict its first token from."""
        totals = torch.tensor(rows.total_lengths, dtype=torch.long)
        lengths = torch.tensor(rows.response_lengths, dtype=torch.long)
        bad = (lengths >= totals).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise ValueError(f"sample {i}: response_length {int(lengths[i])} leaves no prompt token "
                             f"({int(totals[i])} tokens); the first response token needs a token before it to be "
                             "predicted from")
        firsts, row_of = distinct_rows(rows.tokens, rows.response_lengths)
        kept = lengths[firsts]  # each row's kept positions (its response length)
        ids, mask, keep = right_padded([rows.tokens[i] for i in firsts], totals[firsts], kept)
        return cls(ids, mask, keep, kept, row_of, totals, lengths)


def response_log_probs(selected: torch.Tensor, rows: TrainBatch, layout: RowLayout, temperature: float,
                       with_entropy: bool) -> LogProbs:
    """Per-sample log-probs (and entropies) from `selected`, the logits [kept positions, vocab] of `layout`'s
    rows, flattened row by row; the logits are divided by the sampling temperature first."""
    device = selected.device
    logits = selected.float() / temperature  # the sampling policy's logits; x / 1.0 is exact
    kept, lengths, totals = layout.kept, layout.lengths, layout.totals
    if layout.row_of is not None:  # each sample's positions within its row's block of kept positions
        logits = logits[ranges((torch.cumsum(kept, 0) - kept)[layout.row_of], lengths).to(device)]
    targets = torch.cat(list(rows.tokens))[ranges(torch.cumsum(totals, 0) - lengths, lengths)]
    log_probs, entropy = log_probs_and_entropy(logits, targets.to(device), with_entropy=with_entropy)
    split = rows.response_lengths
    return LogProbs(list(torch.split(log_probs, split)), None if entropy is None else list(torch.split(entropy, split)))


def init_process_group(rank: int, world_size: int, init_method: str | None, device: torch.device,
                       single_rank_too: bool = False) -> bool:
    """Join the default process group (gloo on CPU, NCCL on GPU) unless there is one, or there is a single rank
    and not `single_rank_too`; returns whether this call created it (its owner destroys it)."""
    if torch.distributed.is_initialized() or (world_size == 1 and not single_rank_too):
        return False
    if init_method is None:
        raise ValueError(f"world_size {world_size} needs an init_method (e.g. file:///shared/rendezvous "
                         "or tcp://host:port) for torch.distributed")
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return True


def raise_on_every_rank(error: BaseException | None, rank: int, world_size: int, what: str) -> None:
    """Raise rank 0's `error` on rank 0, and on every other rank a RuntimeError saying `what` and rank 0's error.
    Collective when world_size > 1 (rank 0 broadcasts whether it failed)."""
    if world_size > 1:
        status = [None if error is None else f"{type(error).__name__}: {error}"]
        torch.distributed.broadcast_object_list(status, src=0)
        if rank != 0 and status[0] is not None:
            raise RuntimeError(f"{what}: {status[0]}")
    if error is not None:
        raise error


def wait_for_commit(commit: BackgroundCommit, rank: int, world_size: int, collective: bool) -> None:
    """BackgroundCommit.wait on this rank (rank 0 is the one that commits); `collective`: every rank calls it and
    every rank raises when rank 0's commit failed (raise_on_every_rank)."""
    error = None
    try:
        commit.wait()
    except CheckpointError as err:
        error = err
    if collective:
        raise_on_every_rank(error, rank, world_size, "rank 0's previous checkpoint commit (--async-save) failed")
    elif error is not None:
        raise error


def plan_micro_batches(batch: BatchConfig, lengths: list[int]) -> list[list[int]]:
    """Micro-batches (sample indices) of one rank's share of `lengths` tokens: packed under --max-tokens-per-gpu
    with --use-dynamic-batch-size, else consecutive --micro-batch-size samples."""
    if batch.use_dynamic_batch_size:
        assert batch.max_tokens_per_gpu is not None  # BatchConfig validates this
        return pack_micro_batches(lengths, batch.max_tokens_per_gpu)
    size = batch.micro_batch_size
    return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


def log_prob_steps(steps: list[list[list[int]]] | None, batch: TrainBatch,
                   micro_batches: Callable[[list[int]], list[list[int]]]) -> list[list[list[int]]]:
    """A log-prob pass's micro-batches, step by step: `steps` checked to hold each sample of `batch` once
    (ValueError otherwise), or, without them, `micro_batches` of the whole batch as one step."""
    if steps is None:
        return [micro_batches(batch.total_lengths)]
    seen = sorted(i for step in steps for micro in step for i in micro)
    if seen != list(range(len(batch))):
        raise ValueError(f"a log-prob pass's micro-batches must hold each of the {len(batch)} samples once; they "
                         f"hold {seen[:10]}{' ...' if len(seen) > 10 else ''}")
    return steps


def sum_over_ranks(sums: dict[str, torch.Tensor], world_size: int, group: Any = None) -> dict[str, float]:
    """Each metric's global-batch value: the ranks' sums added over `group` (None: the default group); every rank
    has the same metric names."""
    keys = sorted(sums)
    if not keys:
        return {}
    stacked = torch.stack([sums[k] for k in keys])
    if world_size > 1:
        torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.SUM, group=group)
    return dict(zip(keys, stacked.tolist(), strict=True))


def distinct_rows(tokens: list[torch.Tensor], response_lengths: list[int]) -> tuple[list[int], torch.Tensor | None]:
    """The samples that get a forward row of their own, and each sample's row (None: every sample has its own).

    A sample's response log-probs depend only on its tokens but the last (the last one's output predicts nothing)
    and on its response length. Samples that agree on both (a GRPO group's one-token responses to one prompt)
    share the first one's row, so the forward and backward run once for all of them; the loss still counts each
    sample, and autograd sums their gradients into the shared row.
    """
    if not tokens:
        return [], None
    values = torch.cat(tokens).tolist()  # one conversion for the micro-batch, then slices of a Python list
    keys: dict[tuple[int, tuple[int, ...]], int] = {}
    row_of, start = [], 0
    for t, n in zip(tokens, response_lengths, strict=True):
        end = start + t.numel()
        row_of.append(keys.setdefault((n, tuple(values[start : end - 1])), len(keys)))
        start = end
    if len(keys) == len(row_of):
        return list(range(len(row_of))), None
    firsts: dict[int, int] = {}
    for i, row in enumerate(row_of):
        firsts.setdefault(row, i)
    return list(firsts.values()), torch.tensor(row_of, dtype=torch.long)


def right_padded(tokens: list[torch.Tensor], totals: torch.Tensor,
                 response_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, keep) of rows right-padded to the longest; `keep` marks the positions whose output
    predicts a response token (the one before each response token)."""
    columns = torch.arange(int(totals.max()))
    filled = columns < totals[:, None]
    ids = torch.zeros(filled.shape, dtype=torch.long)
    ids[filled] = torch.cat(tokens)  # row-major: each row's tokens, then padding
    keep = (columns >= (totals - response_lengths - 1)[:, None]) & (columns < (totals - 1)[:, None])
    return ids, filled.long(), keep


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(start, start + length) for each (start, length), without a Python loop."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths) + torch.arange(int(lengths.sum()))
