"""slime's rollout-level hooks around slimeflow's rollout: sample hooks, the rollout sample filter, reward
post-processing, the all-samples process, the rollout and eval log functions, and the conversion of samples to
train data. Each is called with slime's signature on the rollout's samples (slime's `Sample` is slimeflow's).
A whole rollout or eval function, which replaces the rollout, is slime_rollout_functions.py's."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from slimeflow.config.train import TrainConfig
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.slime_data_source import PluginDataSource
from slimeflow.rollout.slime_plugins import plugin_name, returned_sample, takes_keyword
from slimeflow.rollout.types import Sample, Status, TrainBatch, floats


async def apply_sample_hooks(hooks: Sequence[Callable[..., Any]], args: Any, samples: list[Sample], *,
                             rollout_id: int | None, evaluation: bool) -> list[Sample]:
    """--rollout-sample-hook-path, in order, on each generated sample before its reward, as slime:
    `hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None` (sync or async; None keeps the
    sample it was given, changed in place)."""
    return [await apply_hooks_to_sample(hooks, args, sample, rollout_id=rollout_id, evaluation=evaluation)
            for sample in samples]


async def apply_hooks_to_sample(hooks: Sequence[Callable[..., Any]], args: Any, sample: Sample,
                                **kwargs: Any) -> Sample:
    """`hook(args, sample, **kwargs)` for each hook in order, each given only the keywords it takes (all of them
    with **kwargs); a hook's returned Sample replaces the one the next hook sees."""
    view = sample
    for hook in hooks:
        result = hook(args, view, **{k: v for k, v in kwargs.items() if takes_keyword(hook, k)})
        if inspect.isawaitable(result):
            result = await result
        if result is not None:
            if not isinstance(result, Sample):
                raise TypeError(f"--rollout-sample-hook-path {plugin_name(hook)} returned {type(result).__name__}, "
                                "expected Sample or None (return the Sample, or None after changing it in place)")
            view = result
    return returned_sample(view, "--rollout-sample-hook-path", sample)


def apply_sample_filter(function: Callable[..., Any], args: Any, groups: list[list[Sample]]) -> int:
    """--rollout-sample-filter-path, as slime: `filter(args, groups)` on the rollout's kept groups, setting
    `remove_sample` on the samples that must not train; their loss masks become all 0 (they still count in the
    group's advantage normalisation, as in slime). Returns how many were removed."""
    function(args, [list(group) for group in groups])
    removed = 0
    for sample in (s for group in groups for s in group):
        if sample.remove_sample:
            sample.loss_mask = [0] * sample.response_length
            removed += 1
    return removed


def call_rollout_log(function: Callable[..., Any], rollout_id: int, args: Any, samples: Sequence[Sample],
                     metrics: dict[str, float], seconds: float) -> bool:
    """--custom-rollout-log-function-path, as slime: `log(rollout_id, args, samples, rollout_extra_metrics,
    rollout_time) -> bool`; True skips the default rollout metrics."""
    return bool(function(rollout_id, args, list(samples), dict(metrics), seconds))


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
                      "samples": good}
    return bool(function(rollout_id, args, data, dict(metrics)))


def post_process_rewards(function: Callable[..., Any], args: Any, groups: list[list[Sample]]) -> None:
    """--custom-reward-post-process-path, as slime: `post_process(args, samples) -> (raw_rewards, rewards)` on the
    rollout's samples in order; each sample's reward becomes its post-processed one (the raw one is kept in
    metadata['raw_reward'])."""
    samples = [s for group in groups for s in group]
    where = f"--custom-reward-post-process-path {plugin_name(function)}"
    raw, rewards = function(args, list(samples))
    if len(raw) != len(samples) or len(rewards) != len(samples):
        raise ValueError(f"{where} returned {len(raw)} raw rewards and {len(rewards)} rewards for {len(samples)} "
                         "samples; return one of each per sample")
    for sample, raw_reward, reward in zip(samples, raw, rewards, strict=True):
        sample.metadata["raw_reward"] = float(raw_reward)
        sample.reward = float(reward)
        # on-policy distillation's post-process sets them, as a tensor (slime's on_policy_distillation)
        sample.teacher_log_probs = floats(sample.teacher_log_probs)


def process_all_samples(function: Callable[..., Any], args: Any, kept: list[list[Sample]],
                        finished: list[list[Sample]], source: Any) -> None:
    """--rollout-all-samples-process-path, as slime: `process(args, all_samples, data_source)` on every finished
    group in prompt order, kept or filtered out; it changes the samples in place, and a sample it puts in another's
    place in its group's list replaces that one in the kept groups."""
    ordered = sorted(finished, key=lambda group: group[0].group_index)
    given = [list(group) for group in ordered]
    function(args, given, source)
    back = {id(sample): new for group, new_group in zip(ordered, given, strict=True)
            for sample, new in zip(group, new_group, strict=True)}
    where = f"--rollout-all-samples-process-path {plugin_name(function)}"
    for group in kept:
        group[:] = [returned_sample(back[id(s)], where, s) if id(s) in back else s for s in group]


def slime_view(data: Any, rollout_id: int | None) -> Any:
    """The data source a slime plug-in gets: the --data-source-path object itself (as slime passes it), else
    slime's API over slimeflow's buffered data source."""
    return data.source if isinstance(data, PluginDataSource) else SlimeDataSource(data, rollout_id)


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
    filter_and_process(ctx, kept, metrics, finished, data)
    if rollout.custom_rollout_log_function_path is not None:
        function = load_plugin(rollout.custom_rollout_log_function_path, "custom-rollout-log-function-path")
        if call_rollout_log(function, ctx.rollout_id, ctx.args, [s for g in kept for s in g], metrics,
                            metrics["rollout/seconds"]):
            return {}
    return metrics


def filter_and_process(ctx: Any, kept: list[list[Sample]], metrics: dict[str, float],
                       finished: list[list[Sample]] | None = None, data: Any = None) -> None:
    """The end of slime's default rollout function: --rollout-sample-filter-path on the kept groups, then
    --rollout-all-samples-process-path on every finished group (`finished`) with `data` as slime's data source."""
    rollout = ctx.config.rollout
    if rollout.rollout_sample_filter_path is not None:
        function = load_plugin(rollout.rollout_sample_filter_path, "rollout-sample-filter-path")
        metrics["rollout/removed_samples"] = float(apply_sample_filter(function, ctx.args, kept))
    if rollout.rollout_all_samples_process_path is not None:
        function = load_plugin(rollout.rollout_all_samples_process_path, "rollout-all-samples-process-path")
        process_all_samples(function, ctx.args, kept, finished or kept, slime_view(data, ctx.rollout_id))


class SlimeDataSource:
    """slime's data-source API (get_samples, add_samples) over slimeflow's buffered data source, for a rollout
    function."""

    def __init__(self, data: Any, rollout_id: int):
        self.data, self.rollout_id = data, rollout_id

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """`num_samples` groups (the buffer's first, as slime's data source with buffer)."""
        return self.data.get_groups(num_samples)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Put groups back into the buffer (aborted ones, continued by a later rollout)."""
        self.data.add_groups([[returned_sample(s, "data_source.add_samples") for s in group] for group in samples],
                             self.rollout_id)

    def get_buffer_length(self) -> int:
        return len(self.data)

    def __len__(self) -> int:
        return len(self.data)


_TRAIN_DATA_USED = {"tokens", "response_lengths", "rewards", "loss_masks", "rollout_log_probs", "teacher_log_probs"}
_TRAIN_DATA_INFO = {"raw_reward", "truncated", "sample_indices", "rollout_ids", "rollout_mask_sums", "total_lengths"}
"""slime train-data keys that only report (slimeflow computes total_lengths and the loss's denominators itself)."""


def train_batch(config: TrainConfig, args: Any, samples: list[Sample]) -> Any:
    """The TrainBatch of a rollout's samples: --custom-convert-samples-to-train-data-path's dict when set (slime's
    `convert(args, samples) -> dict`, whose `rewards` the estimators take as they are), else TrainBatch.from_samples.
    A key that would change training in slime but that slimeflow's trainer does not read is an error."""
    path = config.algorithm.custom_convert_samples_to_train_data_path
    if path is None:
        return TrainBatch.from_samples(samples)
    function = load_plugin(path, "custom-convert-samples-to-train-data-path")
    where = f"--custom-convert-samples-to-train-data-path {plugin_name(function)}"
    data = function(args, list(samples))
    unread = sorted(set(data) - _TRAIN_DATA_USED - _TRAIN_DATA_INFO)
    missing = sorted({"tokens", "response_lengths", "rewards", "loss_masks"} - set(data))
    if unread or missing:
        raise ValueError(f"{where} returned keys {unread} that slimeflow's trainer does not read (remove them or "
                         f"train with slime)" if unread else f"{where} returned no {missing}; it needs tokens, "
                         "response_lengths, rewards and loss_masks (rollout_log_probs optional)")
    logps, teacher = data.get("rollout_log_probs"), data.get("teacher_log_probs")
    groups = [s.group_index for s in samples] if len(samples) == len(data["tokens"]) else []
    return TrainBatch(tokens=[torch.as_tensor(t, dtype=torch.long) for t in data["tokens"]],
                      response_lengths=[int(n) for n in data["response_lengths"]],
                      loss_masks=[torch.as_tensor(m, dtype=torch.float32) for m in data["loss_masks"]],
                      rewards=torch.as_tensor(data["rewards"], dtype=torch.float32),
                      rollout_log_probs=None if logps is None else [torch.as_tensor(lp, dtype=torch.float32)
                                                                    for lp in logps],
                      group_indices=groups,
                      teacher_log_probs=None if teacher is None else [torch.as_tensor(lp, dtype=torch.float32)
                                                                      for lp in teacher])
