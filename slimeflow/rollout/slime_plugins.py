"""The boundary between slimeflow's records and slime's plug-in contracts (slimeflow.slime_compat).

A plug-in gets what slime gives it: `args` with slime's attribute names (every train flag, plus the running
router's address and the other names slime's plug-ins read) and slime's `Sample`; what it returns is converted
back to slimeflow's `Sample`. The compat objects carry slimeflow's names too (`args.client`, `args.tokenizer`,
`args.config`; a Sample's fields), so plug-ins written to slimeflow's documented contracts run the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from slimeflow.config.train import TrainConfig
from slimeflow.rollout.filters import FilterOutcome, GroupFilter
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.types import Sample, Status
from slimeflow.slime_compat.rollout.filter_hub.base_types import DynamicFilterOutput
from slimeflow.slime_compat.utils.types import Sample as SlimeSample
from slimeflow.slime_compat.utils.types import floats

SLIME_DEFAULTS: dict[str, Any] = {
    # slime flags slimeflow has no setting for, at the values slimeflow behaves as.
    "rollout_skip_special_tokens": False,
    "rollout_max_context_len": None,
    "rollout_global_dataset": True,
    "sglang_dp_size": None,
    "sglang_enable_deterministic_inference": False,
    "sglang_speculative_algorithm": None,
    "use_rollout_routing_replay": False,
    "use_distributed_post": False,
    "ci_test": False,
    "multimodal_keys": None,
    "apply_chat_template_kwargs": {},
    "rewards_normalization": True,
    "rollout_sample_hook_path": None,
    "eval_function_path": None,
}


class SlimeArgs(SimpleNamespace):
    """slime's `args` namespace; an attribute slimeflow does not have says why (a slime flag it refuses, or none)."""

    def __getattr__(self, name: str) -> Any:
        from slimeflow.config.slime_flags import NOT_YET_SUPPORTED

        flag = "--" + name.replace("_", "-")
        why = (f"slimeflow does not take slime's {flag} ({NOT_YET_SUPPORTED[flag]})" if flag in NOT_YET_SUPPORTED
               else f"slimeflow has no {flag} flag (slime's args.{name}, if slime has it, is not provided)")
        raise AttributeError(f"args.{name}: {why}")


def slime_args(config: TrainConfig, *, router_url: str | None = None, num_engines: int = 1,
               concurrency: int = 64, **native: Any) -> SlimeArgs:
    """slime's `args` for a plug-in: every leaf of `config` by its slime name (they are slime's flag names),
    `sglang_router_ip`/`sglang_router_port` of `router_url`, `sglang_server_concurrency` (per engine), the
    `SLIME_DEFAULTS`, and `native` (client, tokenizer, ... for slimeflow-style plug-ins) as attributes."""
    values: dict[str, Any] = dict(SLIME_DEFAULTS)
    for group in config.model_fields:
        node = getattr(config, group)
        if hasattr(node, "model_fields"):
            values.update({name: getattr(node, name) for name in node.model_fields})
        else:
            values[group] = node
    values.update({f"sglang_{key}": value for key, value in config.sglang.args.items()})
    # slime's --eval-prompt-data is one list: name, path, name, path, ...
    values["eval_prompt_data"] = [item for pair in config.eval.eval_prompt_data.items() for item in pair] or None
    values.pop("args", None)
    values.update(config.custom_args)  # --custom-config-path's own keys, as slime sets them on its args
    if router_url is not None:
        parts = urlsplit(router_url)
        values.update(sglang_router_ip=parts.hostname, sglang_router_port=parts.port)
    values.update(rollout_num_engines=num_engines, sglang_server_concurrency=max(1, concurrency // num_engines),
                  grpo_std_normalization=not config.algorithm.disable_grpo_std_normalization,
                  config=config, **native)
    return SlimeArgs(**values)


def to_slime(sample: Sample) -> SlimeSample:
    """slime's Sample with this sample's fields (lists copied; metadata shared, as the plug-in may write it)."""
    return SlimeSample(group_index=sample.group_index, index=sample.index, prompt=sample.prompt,
                       tokens=list(sample.tokens), response=sample.response, response_length=sample.response_length,
                       label=sample.label, reward=sample.reward,
                       loss_mask=None if sample.loss_mask is None else list(sample.loss_mask),
                       rollout_log_probs=None if sample.rollout_log_probs is None else list(sample.rollout_log_probs),
                       teacher_log_probs=floats(sample.teacher_log_probs),
                       status=sample.status, metadata=sample.metadata)


def from_slime(sample: Any, origin: Sample, where: str) -> Sample:
    """slimeflow's Sample from what a plug-in returned for `origin` (the reward is kept as it is: a dict reward is
    reduced by the scorer with --reward-key). Raises TypeError naming `where` when it is not a Sample."""
    if not isinstance(sample, SlimeSample | Sample):
        raise TypeError(f"{where} returned {type(sample).__name__}; it must return a Sample or a list of Samples")
    native = Sample(group_index=origin.group_index if sample.group_index is None else sample.group_index,
                    index=origin.index if sample.index is None else sample.index, prompt=sample.prompt,
                    label=sample.label, metadata=dict(sample.metadata or {}), tokens=list(sample.tokens),
                    response=sample.response, response_length=sample.response_length, reward=sample.reward,
                    loss_mask=None if sample.loss_mask is None else list(sample.loss_mask),
                    rollout_log_probs=None if sample.rollout_log_probs is None else list(sample.rollout_log_probs),
                    teacher_log_probs=floats(getattr(sample, "teacher_log_probs", None)),
                    status=Status(sample.status.value), failure_reason=getattr(sample, "failure_reason", None))
    versions = getattr(sample, "weight_versions", None)
    if versions:
        native.metadata["weight_version"] = versions[-1]
    return native


async def call_generate(function: Callable[..., Any], args: Any, sample: Sample, params: dict[str, Any],
                        evaluation: bool = False) -> list[Sample]:
    """slime's custom generate call: `await f(args, sample, sampling_params[, evaluation=])` on slime's Sample;
    a returned Sample or list[Sample] (the trajectory's training samples) as slimeflow Samples."""
    view = to_slime(sample)
    if takes_keyword(function, "evaluation"):
        result = await function(args, view, dict(params), evaluation=evaluation)
    else:
        result = await function(args, view, dict(params))
    where = f"--custom-generate-function-path {plugin_name(function)}"
    results = result if isinstance(result, list) else [result]
    if not results:
        raise ValueError(f"{where} returned an empty list; return the sample (or its samples)")
    return [from_slime(r, sample, where) for r in results]


def takes_keyword(function: Callable[..., Any], name: str) -> bool:
    """Whether `function` takes keyword `name` (by name or through **kwargs)."""
    params = inspect.signature(function).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def plugin_name(function: Callable[..., Any]) -> str:
    """'module:qualname' of a plug-in, for messages."""
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', function)!s}"


def positional_arity(function: Callable[..., Any]) -> tuple[int, int | None]:
    """(required positional parameters, most positional parameters or None for *args)."""
    params = list(inspect.signature(function).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    most = None if any(p.kind is p.VAR_POSITIONAL for p in params) else len(positional)
    return required, most


def accepts(function: Callable[..., Any], n: int) -> bool:
    """Whether `function` can be called with `n` positional arguments."""
    required, most = positional_arity(function)
    return required <= n and (most is None or n <= most)


def load_group_filter(path: str | None, args: Any = None) -> GroupFilter | None:
    """The filter at --dynamic-sampling-filter-path (None when unset): slime's `f(args, samples)` (given `args`,
    returning DynamicFilterOutput or a bool) or slimeflow's `f(group)`."""
    return None if path is None else group_filter(load_plugin(path, "dynamic-sampling-filter-path"), args)


def group_filter(function: Callable[..., Any], args: Any) -> Callable[[Sequence[Sample]], Any]:
    """A dynamic-sampling filter as the sampler calls it (group) -> (keep, reason, keep_when_insufficient):
    slime's `f(args, samples)` returning DynamicFilterOutput (keep may be a tensor) or a bool; slimeflow's `f(group)`."""
    slime_form = accepts(function, 2) and not accepts(function, 1)

    def run(group: Sequence[Sample]) -> FilterOutcome:
        out = function(args, [to_slime(s) for s in group]) if slime_form else function(group)
        if isinstance(out, FilterOutcome):
            return out
        if isinstance(out, DynamicFilterOutput) or hasattr(out, "keep"):
            keep = bool(out.keep)
            return FilterOutcome(keep, None if keep else (out.reason or function.__name__),
                                 keep_when_insufficient=bool(getattr(out, "keep_when_insufficient", False)))
        keep = bool(out)
        return FilterOutcome(keep, None if keep else function.__name__)

    run.__name__ = getattr(function, "__name__", "filter")
    return run


def buffer_filter(function: Callable[..., Any], args: Any) -> Callable[[list[list[Sample]], int], list[list[Sample]]]:
    """A buffer filter as the data source calls it (buffer, num_groups): slime's `f(args, rollout_id, buffer,
    num_samples)` on slime Samples (what it removes from the buffer leaves ours too), or slimeflow's `f(buffer, n)`."""
    if not accepts(function, 4) or accepts(function, 2):
        return function

    def run(buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
        views = [[to_slime(s) for s in group] for group in buffer]
        origin = {id(view): group for view, group in zip(views, buffer, strict=True)}
        where = f"--buffer-filter-path {plugin_name(function)}"
        taken = function(args, None, views, num_groups)
        kept = [origin[id(view)] for view in views if id(view) in origin]
        buffer[:] = kept
        return [[from_slime(s, g, where) for s, g in zip(view, origin.get(id(view), view), strict=True)]
                for view in taken]

    return run


_CALLS: dict[str, tuple[tuple[int, ...], str]] = {
    # flag: (positional arguments it may be called with, the contracts as the user reads them)
    "custom-generate-function-path": ((3,), "async def generate(args, sample, sampling_params, evaluation=False)"),
    "rollout-function-path": ((3,), "generate_rollout(args, rollout_id, data_source, evaluation=False)"),
    "eval-function-path": ((3,), "eval_generate_rollout(args, rollout_id, data_source, evaluation=True)"),
    "dynamic-sampling-filter-path": ((2, 1), "filter(args, samples, **kwargs) -> DynamicFilterOutput (slime's), or "
                                             "filter(group) -> FilterOutcome | bool"),
    "buffer-filter-path": ((4, 2), "buffer_filter(args, rollout_id, buffer, num_samples) (slime's pop_first), or "
                                   "take(buffer, num_groups)"),
    "custom-rm-path": ((2,), "async def reward(args, sample, **kwargs) (with --group-rm: reward(args, samples))"),
    "custom-loss-function-path": ((3,), "loss(config, inputs, reduce) -> (loss, metrics) (docs/rl-api.md)"),
    "custom-advantage-function-path": ((2,), "advantage(config, inputs) -> list[Tensor] (docs/rl-api.md)"),
    "rollout-sample-hook-path": ((2,), "hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None"),
    "rollout-sample-filter-path": ((2,), "filter(args, groups) -> None, setting sample.remove_sample"),
    "custom-reward-post-process-path": ((2,), "post_process(args, samples) -> (raw_rewards, rewards)"),
    "rollout-all-samples-process-path": ((3,), "process(args, all_samples, data_source)"),
    "custom-eval-rollout-log-function-path": ((4,), "log(rollout_id, args, data, extra_metrics) -> bool"),
    "custom-convert-samples-to-train-data-path": ((2,), "convert(args, samples) -> dict"),
    "custom-pg-loss-reducer-function-path": ((4,), "get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, "
                                                   "calculate_per_token_loss) -> reduce(pg_loss)"),
    "data-source-path": ((1,), "a class DataSource(args) with get_samples, add_samples, save, load and __len__"),
    "custom-rollout-log-function-path": ((5,), "log(rollout_id, args, samples, rollout_extra_metrics, "
                                               "rollout_time) -> bool"),
    "custom-megatron-init-path": ((1,), "custom_init(args)"),
    "custom-model-provider-path": ((0,), "provider(pre_process=, post_process=[, vp_stage=][, args=]) -> GPTModel"),
    "custom-megatron-before-log-prob-hook-path": ((3,), "hook(args, model, store_prefix)"),
    "custom-megatron-before-train-step-hook-path": ((6,), "hook(args, rollout_id, step_id, model, optimizer, "
                                                          "opt_param_scheduler)"),
    "rollout-data-postprocess-path": ((3,), "postprocess(args, rollout_id, rollout_data)"),
    "custom-update-weight-post-write-path": ((3,), "hook(args, version_dir, rollout_engines)"),
}


def call_problem(flag: str, function: Callable[..., Any], *, group_rm: bool = False) -> str | None:
    """Why `function` cannot be called the way the run calls the hook of --`flag` (None when it can)."""
    if flag not in _CALLS:
        return None
    counts, contract = _CALLS[flag]
    try:
        inspect.signature(function)
    except (TypeError, ValueError):
        return None  # a builtin or C function without a signature: its call will tell
    if flag == "custom-loss-function-path" and accepts(function, 4) and not accepts(function, 3):
        return ("this is slime's Megatron loss form loss(args, batch, logits, sum_of_sample_mean), which reads "
                "Megatron's packed logits; slimeflow's custom loss is loss(config, inputs, reduce) -> (loss, "
                "metrics) over per-sample log-probs (docs/rl-api.md): port the loss to it")
    if flag == "data-source-path":
        return data_source_problem(function)
    names = list(inspect.signature(function).parameters)
    if flag == "custom-model-provider-path":  # called by keyword, as slime calls it
        missing = [k for k in ("pre_process", "post_process") if not takes_keyword(function, k)]
        return (f"{plugin_name(function)} takes no {' or '.join(missing)} keyword; it is called as {contract}"
                if missing else None)
    if flag == "custom-advantage-function-path" and names[1:2] == ["rollout_data"]:
        return ("this looks like slime's Megatron form advantage(args, rollout_data) that fills "
                "rollout_data['advantages'] and ['returns']; slimeflow's is advantage(config, inputs) -> "
                "list[Tensor] (docs/rl-api.md): port it (slime's form is not supported yet)")
    if not any(accepts(function, n) for n in counts):
        required, most = positional_arity(function)
        takes = f"{required}" if most == required else f"{required} to {'any' if most is None else most}"
        return (f"{plugin_name(function)} takes {takes} positional arguments, but it is called as {contract}; "
                "fix its signature")
    if flag in ("rollout-function-path", "eval-function-path") and not takes_keyword(function, "evaluation"):
        return f"{plugin_name(function)} takes no evaluation= keyword; it is called as {contract}"
    if flag == "custom-generate-function-path" and not inspect.iscoroutinefunction(function):
        return f"{plugin_name(function)} is not an async function; it is awaited as {contract}"
    return None


DATA_SOURCE_METHODS = ("get_samples", "add_samples", "save", "load", "__len__")
"""slime's DataSource API (slime.rollout.data_source.DataSource)."""


def data_source_problem(cls: Any) -> str | None:
    """Why `cls` is not a data source class as slime instantiates one (`cls(args)`, then its DataSource methods)."""
    if not isinstance(cls, type):
        return f"{plugin_name(cls)} is not a class; slime instantiates the data source as cls(args)"
    missing = [name for name in DATA_SOURCE_METHODS if not callable(getattr(cls, name, None))]
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing or abstract:
        return (f"{plugin_name(cls)} lacks {', '.join(missing or abstract)}"
                f"{' (abstract)' if abstract and not missing else ''}; a data source defines get_samples(num_samples), "
                "add_samples(samples), save(rollout_id), load(rollout_id=None) and __len__()")
    if not accepts(cls, 1):
        return f"{plugin_name(cls)}.__init__ must take (self, args): slime instantiates the data source as cls(args)"
    return None
