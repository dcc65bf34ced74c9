"""The two records of the loop: a row-wise `Sample` for rollouts and a columnar `TrainBatch` for training."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class Status(enum.Enum):
    """Where a sample is in its life: waiting to be generated, done, cut at the length limit, aborted, failed."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One response to one prompt, from the data source through rollout and reward to training (as slime's Sample).

    `tokens` is prompt + response token ids; `response_length` counts the response part, and `loss_mask` (when set)
    has exactly `response_length` entries: 1 for tokens the model generated, 0 for tool or environment tokens.
    `rollout_log_probs` are the rollout engine's log-probs of the response tokens, `teacher_log_probs` a teacher's
    (on-policy distillation: set by a reward post-process, as slime's). A reward that raised leaves `status` FAILED
    and the reason in `failure_reason`.
    """

    group_index: int
    index: int
    prompt: str | list[dict[str, Any]]
    label: str | dict[str, Any] | list[Any] | float | None = None
    """The prompt's label: text, or a JSON value (a dict such as Search-R1's reward_model) for reward functions."""
    metadata: dict[str, Any] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    reward: float | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    failure_reason: str | None = None

    def mark_failed(self, reason: str) -> None:
        """Record that this sample cannot be used, and why (it is then dropped with that reason, never scored 0)."""
        self.status = Status.FAILED
        self.failure_reason = reason

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (for checkpointing the buffer)."""
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """The inverse of to_dict."""
        return cls(**{**data, "status": Status(data["status"])})


@dataclass
class TrainBatch:
    """Columnar training data: one entry per sample in every field; per-token fields cover the response only.

    tokens[i] is prompt + response (1-D long); loss_masks[i], rollout_log_probs[i] have response_lengths[i]
    entries; rewards is 1-D float (already group-normalised or raw, as the caller documents).
    """

    tokens: list[torch.Tensor]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    rewards: torch.Tensor
    rollout_log_probs: list[torch.Tensor] | None = None
    group_indices: list[int] = field(default_factory=list)
    teacher_log_probs: list[torch.Tensor] | None = None
    """A teacher's log-probs of the response tokens (on-policy distillation with --opd-type sglang)."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        sizes = {"response_lengths": len(self.response_lengths), "loss_masks": len(self.loss_masks),
                 "rewards": int(self.rewards.numel())}
        if self.rollout_log_probs is not None:
            sizes["rollout_log_probs"] = len(self.rollout_log_probs)
        if self.group_indices:
            sizes["group_indices"] = len(self.group_indices)
        if self.teacher_log_probs is not None:
            sizes["teacher_log_probs"] = len(self.teacher_log_probs)
        wrong = {name: size for name, size in sizes.items() if size != n}
        if wrong:
            raise ValueError(f"TrainBatch has {n} token sequences but field sizes {wrong}; every field needs {n}")
        logps = self.rollout_log_probs or [None] * n
        for i, (mask, length, toks, logp) in enumerate(zip(self.loss_masks, self.response_lengths, self.tokens, logps,
                                                           strict=True)):
            if mask.numel() != length or length > toks.numel():
                raise ValueError(
                    f"TrainBatch sample {i}: loss_mask has {mask.numel()} entries, response_length is {length}, "
                    f"tokens has {toks.numel()}; the mask must cover exactly the response"
                )
            if self.teacher_log_probs is not None and self.teacher_log_probs[i].numel() != length:
                raise ValueError(f"TrainBatch sample {i}: teacher_log_probs has {self.teacher_log_probs[i].numel()} "
                                 f"entries, response_length is {length}; a teacher's log-probs must cover exactly "
                                 "the response (a reward post-process keeps the last response_length of them)")
            if logp is not None and logp.numel() != length:
                raise ValueError(
                    f"TrainBatch sample {i}: rollout_log_probs has {logp.numel()} entries, response_length is "
                    f"{length}; the engine's log-probs must cover exactly the response (a custom generate function "
                    f"gives one per response token, 0.0 for tool or environment tokens)"
                )

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def total_lengths(self) -> list[int]:
        """Prompt + response tokens of each sample (what a packed micro-batch's budget counts)."""
        return [int(t.numel()) for t in self.tokens]

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """The sub-batch of `indices`, in that order."""
        pick = list(indices)
        return TrainBatch(
            tokens=[self.tokens[i] for i in pick],
            response_lengths=[self.response_lengths[i] for i in pick],
            loss_masks=[self.loss_masks[i] for i in pick],
            rewards=self.rewards[pick] if pick else self.rewards[:0],
            rollout_log_probs=None if self.rollout_log_probs is None else [self.rollout_log_probs[i] for i in pick],
            group_indices=[self.group_indices[i] for i in pick] if self.group_indices else [],
            teacher_log_probs=None if self.teacher_log_probs is None else [self.teacher_log_probs[i] for i in pick],
        )

    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> TrainBatch:
        """Columns from scored samples; a sample without a loss mask trains on its whole response."""
        bad = [s.index for s in samples if s.reward is None or s.status in (Status.FAILED, Status.PENDING)]
        if bad:
            raise ValueError(f"samples {bad[:10]} have no reward or failed; drop them before building a TrainBatch")
        has_logp = all(s.rollout_log_probs is not None for s in samples)
        has_teacher = bool(samples) and all(s.teacher_log_probs is not None for s in samples)
        return cls(
            tokens=_split_rows([s.tokens for s in samples], torch.long),
            response_lengths=[s.response_length for s in samples],
            loss_masks=_split_rows([s.loss_mask if s.loss_mask is not None else [1] * s.response_length
                                    for s in samples], torch.float32),
            rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
            rollout_log_probs=_split_rows([s.rollout_log_probs for s in samples], torch.float32)
            if has_logp and samples else None,
            group_indices=[s.group_index for s in samples],
            teacher_log_probs=_split_rows([s.teacher_log_probs for s in samples], torch.float32)
            if has_teacher else None,
        )


def _split_rows(rows: Sequence[Sequence[float]], dtype: torch.dtype) -> list[torch.Tensor]:
    """One tensor per row, as views of one flat tensor: one conversion for the batch instead of one per sample
    (768 small torch.tensor calls took ~4 ms for a 256-sample rollout). Each row keeps its own length, so
    TrainBatch's checks still see a mask or log-prob list that does not fit its response."""
    if not rows:
        return []
    flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype)
    return list(torch.split(flat, [len(row) for row in rows]))


@dataclass
class PackedBatch:
    """A TrainBatch as a few flat tensors, for the Ray hop from the RolloutManager to the TrainActors: pickling a
    batch of 256 samples as 768 small tensors took ~25 ms and unpickling it ~35 ms; flat, both are well under 1 ms.
    The unpacked batch's per-sample tensors are views of the flat ones."""

    tokens: torch.Tensor
    token_lengths: list[int]
    response_lengths: list[int]
    loss_masks: torch.Tensor
    rewards: torch.Tensor
    rollout_log_probs: torch.Tensor | None
    group_indices: list[int]
    teacher_log_probs: torch.Tensor | None = None

    @classmethod
    def pack(cls, batch: TrainBatch) -> PackedBatch:
        def flat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)

        logp = batch.rollout_log_probs
        return cls(flat(batch.tokens, torch.long), batch.total_lengths, list(batch.response_lengths),
                   flat(batch.loss_masks, torch.float32), batch.rewards,
                   None if logp is None else flat(logp, torch.float32), list(batch.group_indices),
                   None if batch.teacher_log_probs is None else flat(batch.teacher_log_probs, torch.float32))

    def unpack(self) -> TrainBatch:
        per_response = self.response_lengths
        return TrainBatch(
            tokens=list(torch.split(self.tokens, self.token_lengths)), response_lengths=list(per_response),
            loss_masks=list(torch.split(self.loss_masks, per_response)), rewards=self.rewards,
            rollout_log_probs=None if self.rollout_log_probs is None
            else list(torch.split(self.rollout_log_probs, per_response)),
            group_indices=list(self.group_indices),
            teacher_log_probs=None if self.teacher_log_probs is None
            else list(torch.split(self.teacher_log_probs, per_response)))
