"""slime.utils.types: slime's `Sample`, with its fields, `Sample.Status` and methods, for slime's plug-ins.

slimeflow's own record is `slimeflow.rollout.types.Sample`; the rollout converts to this one before it calls a
slime plug-in and back after (slimeflow.rollout.slime_plugins). `Sample.Status` is slimeflow's `Status` (same
members and values as slime's), so a status compares equal on both sides. Multimodal inputs, top-p replay and
routed-expert replay are carried as fields but not produced: slimeflow's engines do not return them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from slimeflow.rollout.types import Status as _Status


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
class Sample:
    """One generated sample, as slime's `Sample` (field names, defaults and methods)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    Status = _Status

    status: _Status = _Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        """Speculative-decoding counters (slimeflow's engines report none: they stay 0)."""

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
        def from_dict(data: dict) -> Sample.SpecInfo:
            return Sample.SpecInfo(**{k: data.get(k, 0) for k in Sample.SpecInfo.__dataclass_fields__})

    spec_info: SpecInfo = field(default_factory=lambda: Sample.SpecInfo())

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens served from the engine's prefix cache."""

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
        def from_dict(data: dict) -> Sample.PrefixCacheInfo:
            return Sample.PrefixCacheInfo(**{k: data.get(k, 0) for k in Sample.PrefixCacheInfo.__dataclass_fields__})

    prefix_cache_info: PrefixCacheInfo = field(default_factory=lambda: Sample.PrefixCacheInfo())

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (status as its value, the info records as dicts), as slime's."""
        value = self.__dict__.copy()
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict) -> Sample:
        """The inverse of to_dict; keys that are not fields become attributes, as in slime."""
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info", {}))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info", {}))
        names = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args: Any) -> float:
        """The reward, or its `args.reward_key` entry when the reward is a dict."""
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
        self.status = {"length": _Status.TRUNCATED, "abort": _Status.ABORTED,
                       "stop": _Status.COMPLETED}.get(finish, self.status)

    def _check_lengths(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length "
                             f"{self.response_length}")
