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

from slimeflow.slime_compat.rollout.filter_hub.base_types import DynamicFilterOutput
from slimeflow.slime_compat.utils.types import Sample as SlimeSample
from slimeflow.stages.rl.config import TrainConfig
from slimeflow.stages.rl.plugins import load_plugin
from slimeflow.stages.rl.types import Sample, Status

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
    "data_source_path": None,
}


def slime_args(config: TrainConfig, *, router_url: str | None = None, num_engines: int = 1,
               concurrency: int = 64, **native: Any) -> SimpleNamespace:
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
    values.pop("args", None)
    if router_url is not None:
        parts = urlsplit(router_url)
        values.update(sglang_router_ip=parts.hostname, sglang_router_port=parts.port)
    values.update(rollout_num_engines=num_engines, sglang_server_concurrency=max(1, concurrency // num_engines),
                  grpo_std_normalization=not config.algorithm.disable_grpo_std_normalization,
                  config=config, **native)
    return SimpleNamespace(**values)


def to_slime(sample: Sample) -> SlimeSample:
    """slime's Sample with this sample's fields (lists copied; metadata shared, as the plug-in may write it)."""
    return SlimeSample(group_index=sample.group_index, index=sample.index, prompt=sample.prompt,
                       tokens=list(sample.tokens), response=sample.response, response_length=sample.response_length,
                       label=sample.label, reward=sample.reward,
                       loss_mask=None if sample.loss_mask is None else list(sample.loss_mask),
                       rollout_log_probs=None if sample.rollout_log_probs is None else list(sample.rollout_log_probs),
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
    if _takes(function, "evaluation"):
        result = await function(args, view, dict(params), evaluation=evaluation)
    else:
        result = await function(args, view, dict(params))
    where = f"--custom-generate-function-path {_name(function)}"
    results = result if isinstance(result, list) else [result]
    if not results:
        raise ValueError(f"{where} returned an empty list; return the sample (or its samples)")
    return [from_slime(r, sample, where) for r in results]


def _takes(function: Callable[..., Any], name: str) -> bool:
    params = inspect.signature(function).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _name(function: Callable[..., Any]) -> str:
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


def group_filter(function: Callable[..., Any], args: Any) -> Callable[[Sequence[Sample]], Any]:
    """A dynamic-sampling filter as the sampler calls it (group) -> (keep, reason, keep_when_insufficient):
    slime's `f(args, samples)` returning DynamicFilterOutput (keep may be a tensor) or a bool; slimeflow's `f(group)`."""
    from slimeflow.stages.rl.filters import FilterOutcome

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
        where = f"--buffer-filter-path {_name(function)}"
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
    "custom-rollout-log-function-path": ((5,), "log(rollout_id, args, samples, rollout_extra_metrics, "
                                               "rollout_time) -> bool"),
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
    names = list(inspect.signature(function).parameters)
    if flag == "custom-advantage-function-path" and names[1:2] == ["rollout_data"]:
        return ("this looks like slime's Megatron form advantage(args, rollout_data) that fills "
                "rollout_data['advantages'] and ['returns']; slimeflow's is advantage(config, inputs) -> "
                "list[Tensor] (docs/rl-api.md): port it (slime's form is not supported yet)")
    if not any(accepts(function, n) for n in counts):
        required, most = positional_arity(function)
        takes = f"{required}" if most == required else f"{required} to {'any' if most is None else most}"
        return (f"{_name(function)} takes {takes} positional arguments, but it is called as {contract}; "
                "fix its signature")
    if flag == "rollout-function-path" and not _takes(function, "evaluation"):
        return f"{_name(function)} takes no evaluation= keyword; it is called as {contract}"
    if flag == "custom-generate-function-path" and not inspect.iscoroutinefunction(function):
        return f"{_name(function)} is not an async function; it is awaited as {contract}"
    return None


async def apply_sample_hooks(hooks: Sequence[Callable[..., Any]], args: Any, samples: list[Sample], *,
                             rollout_id: int | None, evaluation: bool) -> list[Sample]:
    """--rollout-sample-hook-path, in order, on each generated sample before its reward, as slime:
    `hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None` (sync or async; None keeps the
    sample it was given, changed in place)."""
    out = []
    for sample in samples:
        view = to_slime(sample)
        for hook in hooks:
            kwargs = {k: v for k, v in {"rollout_id": rollout_id, "evaluation": evaluation}.items() if _takes(hook, k)}
            result = hook(args, view, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            if result is not None:
                if not isinstance(result, SlimeSample):
                    raise TypeError(f"--rollout-sample-hook-path {_name(hook)} returned {type(result).__name__}; "
                                    "return the Sample or None")
                view = result
        out.append(from_slime(view, sample, "--rollout-sample-hook-path"))
    return out


def apply_sample_filter(function: Callable[..., Any], args: Any, groups: list[list[Sample]]) -> int:
    """--rollout-sample-filter-path, as slime: `filter(args, groups)` on the rollout's kept groups, setting
    `remove_sample` on the samples that must not train; their loss masks become all 0 (they still count in the
    group's advantage normalisation, as in slime). Returns how many were removed."""
    views = [[to_slime(s) for s in group] for group in groups]
    function(args, views)
    removed = 0
    for group, view_group in zip(groups, views, strict=True):
        for sample, view in zip(group, view_group, strict=True):
            if view.remove_sample:
                sample.loss_mask = [0] * sample.response_length
                removed += 1
    return removed


def call_rollout_log(function: Callable[..., Any], rollout_id: int, args: Any, samples: Sequence[Sample],
                     metrics: dict[str, float], seconds: float) -> bool:
    """--custom-rollout-log-function-path, as slime: `log(rollout_id, args, samples, rollout_extra_metrics,
    rollout_time) -> bool`; True skips the default rollout metrics."""
    return bool(function(rollout_id, args, [to_slime(s) for s in samples], dict(metrics), seconds))


def call_eval_log(function: Callable[..., Any], rollout_id: int | None, args: Any,
                  results: dict[str, list[list[Sample]]], metrics: dict[str, float]) -> bool:
    """--custom-eval-rollout-log-function-path, as slime: `log(rollout_id, args, data, extra_metrics) -> bool` with
    data = {set name: {"rewards", "truncated", "samples"}} (failed samples left out); True skips the default
    eval metrics."""
    data = {}
    for name, groups in results.items():
        good = [s for g in groups for s in g if s.status is not Status.FAILED and s.reward is not None]
        data[name] = {"rewards": [float(s.reward) for s in good],
                      "truncated": [int(s.status is Status.TRUNCATED) for s in good],
                      "samples": [to_slime(s) for s in good]}
    return bool(function(rollout_id, args, data, dict(metrics)))


def post_process_rewards(function: Callable[..., Any], args: Any, groups: list[list[Sample]]) -> None:
    """--custom-reward-post-process-path, as slime: `post_process(args, samples) -> (raw_rewards, rewards)` on the
    rollout's samples in order; each sample's reward becomes its post-processed one (the raw one is kept in
    metadata['raw_reward'])."""
    samples = [s for group in groups for s in group]
    where = f"--custom-reward-post-process-path {_name(function)}"
    raw, rewards = function(args, [to_slime(s) for s in samples])
    if len(raw) != len(samples) or len(rewards) != len(samples):
        raise ValueError(f"{where} returned {len(raw)} raw rewards and {len(rewards)} rewards for {len(samples)} "
                         "samples; return one of each per sample")
    for sample, raw_reward, reward in zip(samples, raw, rewards, strict=True):
        sample.metadata["raw_reward"] = float(raw_reward)
        sample.reward = float(reward)


def process_all_samples(function: Callable[..., Any], args: Any, kept: list[list[Sample]],
                        finished: list[list[Sample]], source: SlimeDataSource) -> None:
    """--rollout-all-samples-process-path, as slime: `process(args, all_samples, data_source)` on every finished
    group in prompt order, kept or filtered out; what it changes in the kept samples is carried back."""
    ordered = sorted(finished, key=lambda group: group[0].group_index)
    views = [[to_slime(s) for s in group] for group in ordered]
    function(args, views, source)
    back = {id(sample): view for group, view_group in zip(ordered, views, strict=True)
            for sample, view in zip(group, view_group, strict=True)}
    where = f"--rollout-all-samples-process-path {_name(function)}"
    for group in kept:
        group[:] = [from_slime(back[id(s)], s, where) if id(s) in back else s for s in group]


def finish_rollout(ctx: Any, kept: list[list[Sample]], metrics: dict[str, float],
                   finished: list[list[Sample]] | None = None, data: Any = None) -> dict[str, float]:
    """On the kept groups: --custom-reward-post-process-path, --rollout-sample-filter-path, then
    --rollout-all-samples-process-path on every finished group (`finished`, kept or filtered out) with `data`
    as slime's data source, then --custom-rollout-log-function-path; the metrics to log (none when the log
    function says it logged them itself, as slime). `ctx` is the rollout's context."""
    rollout = ctx.config.rollout
    post_process = ctx.config.algorithm.custom_reward_post_process_path
    if post_process is not None:
        post_process_rewards(load_plugin(post_process, "custom-reward-post-process-path"), ctx.args, kept)
    if rollout.rollout_sample_filter_path is not None:
        function = load_plugin(rollout.rollout_sample_filter_path, "rollout-sample-filter-path")
        metrics["rollout/removed_samples"] = float(apply_sample_filter(function, ctx.args, kept))
    if rollout.rollout_all_samples_process_path is not None:
        function = load_plugin(rollout.rollout_all_samples_process_path, "rollout-all-samples-process-path")
        process_all_samples(function, ctx.args, kept, finished or kept, SlimeDataSource(data, ctx.rollout_id))
    if rollout.custom_rollout_log_function_path is not None:
        function = load_plugin(rollout.custom_rollout_log_function_path, "custom-rollout-log-function-path")
        if call_rollout_log(function, ctx.rollout_id, ctx.args, [s for g in kept for s in g], metrics,
                            metrics["rollout/seconds"]):
            return {}
    return metrics


class SlimeDataSource:
    """slime's data-source API (get_samples, add_samples) over slimeflow's buffered data source, for a rollout
    function: groups go out as slime Samples and come back as ours."""

    def __init__(self, data: Any, rollout_id: int):
        self.data, self.rollout_id = data, rollout_id
        self._origin: dict[int, Sample] = {}

    def get_samples(self, num_samples: int) -> list[list[SlimeSample]]:
        """`num_samples` groups (the buffer's first, as slime's data source with buffer)."""
        views = []
        for group in self.data.get_groups(num_samples):
            view = [to_slime(s) for s in group]
            self._origin.update({id(v): s for v, s in zip(view, group, strict=True)})
            views.append(view)
        return views

    def add_samples(self, samples: list[list[SlimeSample]]) -> None:
        """Put groups back into the buffer (aborted ones, continued by a later rollout)."""
        self.data.add_groups([[self.native(s, "data_source.add_samples") for s in group] for group in samples],
                             self.rollout_id)

    def native(self, view: Any, where: str) -> Sample:
        return from_slime(view, self._origin.get(id(view), view), where)

    def get_buffer_length(self) -> int:
        return len(self.data)

    def __len__(self) -> int:
        return len(self.data)


def _leaves(value: Any) -> list[Any]:
    return [leaf for item in value for leaf in _leaves(item)] if isinstance(value, list) else [value]


def run_rollout_function(function: Callable[..., Any], ctx: Any, data: Any, rollout_id: int) -> Any:
    """--rollout-function-path, as slime calls it: `generate_rollout(args, rollout_id, data_source,
    evaluation=False)` -> RolloutFnTrainOutput or list[list[Sample]] (a group may nest lists of samples). Every
    sample must carry its reward (a dict is reduced with --reward-key). Returns the rollout's RolloutResult."""
    import time

    from slimeflow.slime_compat.rollout.base_types import call_rollout_fn
    from slimeflow.stages.rl.rewards import reward_value
    from slimeflow.stages.rl.rollout import RolloutResult, rollout_metrics

    ctx.rollout_id = rollout_id
    source = SlimeDataSource(data, rollout_id)
    where = f"--rollout-function-path {_name(function)}"
    started = time.perf_counter()
    output = call_rollout_fn(function, ctx.args, rollout_id, source, evaluation=False)
    groups = []
    for group in output.samples:
        samples = [source.native(view, where) for view in _leaves(group)]
        for sample in samples:
            if sample.reward is None:
                raise ValueError(f"{where} returned sample {sample.index} (group {sample.group_index}) without a "
                                 "reward; a rollout function rewards its samples (slime's generate_and_rm does)")
            sample.reward = reward_value(sample.reward, ctx.config.reward.reward_key)
        groups.append(samples)
    metrics = rollout_metrics(groups, {}, time.perf_counter() - started)
    metrics.update({k: float(v) for k, v in (output.metrics or {}).items() if isinstance(v, int | float)})
    post_process = ctx.config.algorithm.custom_reward_post_process_path
    if post_process is not None:  # as slime: applied to whatever the rollout function returned
        post_process_rewards(load_plugin(post_process, "custom-reward-post-process-path"), ctx.args, groups)
    return RolloutResult(groups=groups, metrics=metrics)


_TRAIN_DATA_USED = {"tokens", "response_lengths", "rewards", "loss_masks", "rollout_log_probs"}
_TRAIN_DATA_INFO = {"raw_reward", "truncated", "sample_indices", "rollout_ids", "rollout_mask_sums", "total_lengths"}
"""slime train-data keys that only report (slimeflow computes total_lengths and the loss's denominators itself)."""


def train_batch(config: TrainConfig, args: Any, samples: list[Sample]) -> Any:
    """The TrainBatch of a rollout's samples: --custom-convert-samples-to-train-data-path's dict when set (slime's
    `convert(args, samples) -> dict`, whose `rewards` the estimators take as they are), else TrainBatch.from_samples.
    A key that would change training in slime but that slimeflow's trainer does not read is an error."""
    import torch

    from slimeflow.stages.rl.types import TrainBatch

    path = config.algorithm.custom_convert_samples_to_train_data_path
    if path is None:
        return TrainBatch.from_samples(samples)
    function = load_plugin(path, "custom-convert-samples-to-train-data-path")
    where = f"--custom-convert-samples-to-train-data-path {_name(function)}"
    data = function(args, [to_slime(s) for s in samples])
    unread = sorted(set(data) - _TRAIN_DATA_USED - _TRAIN_DATA_INFO)
    missing = sorted({"tokens", "response_lengths", "rewards", "loss_masks"} - set(data))
    if unread or missing:
        raise ValueError(f"{where} returned keys {unread} that slimeflow's trainer does not read (remove them or "
                         f"train with slime)" if unread else f"{where} returned no {missing}; it needs tokens, "
                         "response_lengths, rewards and loss_masks (rollout_log_probs optional)")
    logps = data.get("rollout_log_probs")
    groups = [s.group_index for s in samples] if len(samples) == len(data["tokens"]) else []
    return TrainBatch(tokens=[torch.as_tensor(t, dtype=torch.long) for t in data["tokens"]],
                      response_lengths=[int(n) for n in data["response_lengths"]],
                      loss_masks=[torch.as_tensor(m, dtype=torch.float32) for m in data["loss_masks"]],
                      rewards=torch.as_tensor(data["rewards"], dtype=torch.float32),
                      rollout_log_probs=None if logps is None else [torch.as_tensor(lp, dtype=torch.float32)
                                                                    for lp in logps],
                      group_indices=groups)
