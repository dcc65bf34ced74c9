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
    """Where a sample is in its life: waiting to be generated, done, cut at the length limit, aborted, failed.
    Its members and values are slime's `Sample.Status`, so a slime plug-in's comparisons hold."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


def _ints(values: Any) -> list[int]:
    if values is None:
        return []
    if hasattr(values, "tolist"):
        values = values.reshape(-1).tolist()
    return [int(v) for v in values]


def floats(values: Any) -> list[float] | None:
    """A list of floats from a list or a tensor (slime's OPD post-process stores a tensor), None kept."""
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.reshape(-1).tolist()
    return [float(v) for v in values]


@dataclass
class SpecInfo:
    """Speculative-decoding counters, as slime's `Sample.SpecInfo` (slimeflow's engines report none: they stay 0)."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

    @property
    def spec_accept_length(self) -> float:
        return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

    def add(self, meta_info: dict) -> None:
        self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
        self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
        self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
        self.completion_token_num += meta_info.get("completion_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict) -> SpecInfo:
        return SpecInfo(**{k: data.get(k, 0) for k in SpecInfo.__dataclass_fields__})


@dataclass
class PrefixCacheInfo:
    """Prompt tokens served from the engine's prefix cache, as slime's `Sample.PrefixCacheInfo`."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    def add(self, meta_info: dict) -> None:
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict) -> PrefixCacheInfo:
        return PrefixCacheInfo(**{k: data.get(k, 0) for k in PrefixCacheInfo.__dataclass_fields__})


@dataclass
class Sample:
    """One response to one prompt, from the data source through rollout and reward to training. It is slime's
    `Sample` too (`slime.utils.types.Sample` in the compat namespace is this class): slime's field names, defaults,
    `Sample.Status` and methods, so a slime plug-in reads and writes the sample the rollout trains on.

    `tokens` is prompt + response token ids; `response_length` counts the response part, and `loss_mask` (when set)
    has exactly `response_length` entries: 1 for tokens the model generated, 0 for tool or environment tokens.
    `rollout_log_probs` are the rollout engine's log-probs of the response tokens, `teacher_log_probs` a teacher's
    (on-policy distillation: set by a reward post-process, as slime's). A reward that raised leaves `status` FAILED
    and the reason in `failure_reason` (slimeflow's own field). Multimodal inputs, top-p replay and routed-expert
    replay are slime fields slimeflow carries for plug-ins but does not produce: its engines do not return them.
    """

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    rollout_id: int | None = None
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | dict[str, Any] | list[Any] | float | None = None
    """The prompt's label: text, or a JSON value (a dict such as Search-R1's reward_model) for reward functions."""
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    Status = Status
    SpecInfo = SpecInfo
    PrefixCacheInfo = PrefixCacheInfo

    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
    failure_reason: str | None = None

    def mark_failed(self, reason: str) -> None:
        """Record that this sample cannot be used, and why (it is then dropped with that reason, never scored 0)."""
        self.status = Status.FAILED
        self.failure_reason = reason

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (for checkpointing the buffer and debug rollouts): the fields, status as its
        value, the info records as dicts, and any attribute from_dict added (as slime's)."""
        data = dataclasses.asdict(self)
        data.update({k: v for k, v in self.__dict__.items() if k not in data})
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """The inverse of to_dict; a missing field takes its default (files written before a field existed), a key
        that is not a field becomes an attribute (as slime's)."""
        data = dict(data)
        data["status"] = Status(data["status"])
        data["spec_info"] = SpecInfo.from_dict(data.get("spec_info") or {})
        data["prefix_cache_info"] = PrefixCacheInfo.from_dict(data.get("prefix_cache_info") or {})
        names = cls.__dataclass_fields__
        sample = cls(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args: Any) -> float:
        """The reward, or its `args.reward_key` entry when the reward is a dict (slime's)."""
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]

    @property
    def effective_response_length(self) -> int:
        """Response tokens that train: the loss mask's ones, else the whole response."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """Append response tokens keeping loss_mask and rollout_log_probs aligned with them, as slime's.

        Model tokens: trainable=True with the engine's log-probs (and its meta_info, which sets the status from
        finish_reason and records the weight version). Tool or environment tokens: trainable=False, no log-probs;
        they get loss-mask 0 and log-prob 0.0.
        """
        tokens = _ints(tokens)
        log_probs = floats(log_probs)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("Cannot append trainable rollout log probabilities to a sample with existing "
                                     "response tokens but no existing rollout_log_probs.")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs
        if meta_info is not None and update_terminal_info and "finish_reason" in meta_info:
            self._apply_terminal_info(args, meta_info)
        self._check_lengths()

    def _apply_terminal_info(self, args: Any, meta_info: dict) -> None:
        if getattr(args, "sglang_speculative_algorithm", False):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        finish = meta_info["finish_reason"]["type"]
        self.status = {"length": Status.TRUNCATED, "abort": Status.ABORTED,
                       "stop": Status.COMPLETED}.get(finish, self.status)

    def _check_lengths(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length "
                             f"{self.response_length}")


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
