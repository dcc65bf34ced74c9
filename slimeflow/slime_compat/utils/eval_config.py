"""slime.utils.eval_config: per-dataset eval settings (slime's --eval-config YAML, `eval.datasets` and
`eval.defaults`) as `EvalDatasetConfig`s, for eval functions (--eval-function-path) that read such a file themselves.

slimeflow's own evaluation takes the --eval-* flags and refuses --eval-config; this module holds slime's contract for
plug-ins: every field resolves as dataset entry > eval.defaults > the args fallback in ARG_FALLBACKS (None when no
fallback is set); an unknown key, in a dataset entry or in the defaults, raises ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["ARG_FALLBACKS", "EvalDatasetConfig", "build_eval_dataset_configs", "ensure_dataset_list",
           "pick_from_args"]

ARG_FALLBACKS: dict[str, tuple[str, ...]] = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt", "n_samples_per_prompt"),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "min_eval_samples": (),
    "stop": ("rollout_stop",),
    "stop_token_ids": ("rollout_stop_token_ids",),
    "min_new_tokens": ("eval_min_new_tokens",),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": ("metadata_key",),
    "multimodal_keys": ("multimodal_keys",),
    "apply_chat_template": ("apply_chat_template",),
    "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "custom_rm_path": ("eval_custom_rm_path", "custom_rm_path"),
}
"""Field -> the args attributes it falls back to, first one set wins (slime's table)."""


@dataclass
class EvalDatasetConfig:
    """One eval dataset: where it is, how its rows read, how it is sampled and scored (None: not set)."""

    name: str
    path: str
    rm_type: str | None = None
    custom_rm_path: str | None = None
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    multimodal_keys: dict[str, str] | None = None
    apply_chat_template: bool | None = None
    apply_chat_template_kwargs: dict[str, Any] | None = None
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_generate_function_path: str | None = None
    app_service: str | None = None
    eval_task_timeout: int | None = None
    min_eval_samples: int | None = None
    eval_early_stop_remaining: int | None = None
    eval_early_stop_idle_timeout: float | None = None
    message_processor: dict[str, Any] | None = None
    reward_model: dict[str, Any] | None = None
    remote_environment: dict[str, Any] | None = None
    metadata_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.metadata_overrides is None:
            self.metadata_overrides = {}
        if not isinstance(self.metadata_overrides, dict):
            raise TypeError(f"eval dataset {self.name!r}: metadata_overrides must be a mapping, "
                            f"got {type(self.metadata_overrides).__name__}")
        if self.min_eval_samples is not None and self.min_eval_samples <= 0:
            raise ValueError(f"eval dataset {self.name!r}: min_eval_samples must be positive when set, "
                             f"got {self.min_eval_samples}")

    @property
    def cache_key(self) -> tuple[Any, ...]:
        """What identifies the dataset's rows (for caching them)."""
        return self.name, self.path, self.input_key, self.label_key, self.tool_key, self.metadata_key

    def inject_metadata(self, sample_metadata: Any) -> dict[str, Any]:
        """A copy of a sample's metadata with rm_type (when set) and metadata_overrides applied."""
        metadata = dict(sample_metadata) if isinstance(sample_metadata, dict) else {}
        if self.rm_type is not None:
            metadata["rm_type"] = self.rm_type
        metadata.update(self.metadata_overrides)
        return metadata


FIELDS = frozenset(f.name for f in fields(EvalDatasetConfig))


def pick_from_args(args: Any, attrs: tuple[str, ...]) -> Any:
    """The first of `attrs` that args sets (not None), else None."""
    return next((value for value in (getattr(args, attr, None) for attr in attrs) if value is not None), None)


def ensure_dataset_list(config: Any) -> list[dict[str, Any]]:
    """eval.datasets as a list of dicts: a list of entries (each with a `name`) or a mapping name -> entry."""
    if config is None:
        return []
    if isinstance(config, dict):
        return [{"name": name, **dict(entry or {})} for name, entry in config.items()]
    if isinstance(config, list | tuple):
        entries = [dict(entry or {}) for entry in config]
        for i, entry in enumerate(entries):
            if "name" not in entry:
                raise ValueError(f"eval.datasets[{i}] has no `name`; every evaluation dataset entry needs one")
        return entries
    raise TypeError(f"eval.datasets must be a list or a mapping, got {type(config).__name__}")


def build_eval_dataset_configs(args: Any, raw_config: Iterable[dict[str, Any]],
                               defaults: dict[str, Any] | None) -> list[EvalDatasetConfig]:
    """One EvalDatasetConfig per entry of `raw_config`, each field resolved entry > `defaults` > args."""
    defaults = dict(defaults or {})
    unknown = sorted(set(defaults) - FIELDS)
    if unknown:
        raise ValueError(f"Unknown key(s) in eval.defaults: {unknown}. Valid keys: {sorted(FIELDS)}.")
    configs = []
    for entry in raw_config:
        resolved = {**defaults, **dict(entry or {})}
        for name, attrs in ARG_FALLBACKS.items():
            if name not in resolved:
                resolved[name] = pick_from_args(args, attrs)
        unknown = sorted(set(resolved) - FIELDS)
        if unknown:
            raise ValueError(f"eval dataset {resolved.get('name')!r}: unknown key(s) {unknown}. "
                             f"Valid keys: {sorted(FIELDS)}.")
        configs.append(EvalDatasetConfig(**resolved))
    return configs
