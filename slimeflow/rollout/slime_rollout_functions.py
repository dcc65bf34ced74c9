"""slime's whole rollout and eval functions in place of slimeflow's rollout (--rollout-function-path,
--eval-function-path), called with slime's signature and slime's data-source API over ours."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slimeflow.config.train import TrainConfig
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.rewards import reward_value
from slimeflow.rollout.rollout import RolloutResult, rollout_metrics
from slimeflow.rollout.slime_plugins import plugin_name, returned_sample, slime_args
from slimeflow.rollout.slime_rollout_hooks import post_process_rewards, slime_view
from slimeflow.slime_compat.rollout.base_types import call_rollout_fn


@dataclass
class EngineFreeContext:
    """What run_rollout_function reads of a rollout's context when no engine runs (--debug-train-only with a rollout
    function, slime's SFT): the config and slime's `args` (no engine client, router or reward scorer in them)."""

    config: TrainConfig
    args: Any = field(default=None)
    rollout_id: int | None = None

    def __post_init__(self) -> None:
        if self.args is None:
            self.args = slime_args(self.config)


def _leaves(value: Any) -> list[Any]:
    return [leaf for item in value for leaf in _leaves(item)] if isinstance(value, list) else [value]


def run_rollout_function(function: Callable[..., Any], ctx: Any, data: Any, rollout_id: int) -> RolloutResult:
    """--rollout-function-path, as slime calls it: `generate_rollout(args, rollout_id, data_source,
    evaluation=False)` -> RolloutFnTrainOutput or list[list[Sample]] (a group may nest lists of samples). Every
    sample must carry its reward (a dict is reduced with --reward-key). Returns the rollout's RolloutResult."""
    ctx.rollout_id = rollout_id
    source = slime_view(data, rollout_id)
    where = f"--rollout-function-path {plugin_name(function)}"
    started = time.perf_counter()
    output = call_rollout_fn(function, ctx.args, rollout_id, source, evaluation=False)
    groups = []
    for group in output.samples:
        samples = [returned_sample(view, where) for view in _leaves(group)]
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


def run_eval_function(function: Callable[..., Any], ctx: Any, data: Any, rollout_id: int | None) -> dict[str, float]:
    """--eval-function-path, as slime calls it: `eval_generate_rollout(args, rollout_id, data_source,
    evaluation=True)` -> RolloutFnEvalOutput or its data dict {set name: {"rewards", "truncated"?, "samples"?}}.
    Metrics as slime logs them: eval/<set> (mean reward), eval/<set>/truncated_rate, and the function's own;
    --custom-eval-rollout-log-function-path sees the data first (True: none of these)."""
    ctx.rollout_id = rollout_id
    where = f"--eval-function-path {plugin_name(function)}"
    output = call_rollout_fn(function, ctx.args, rollout_id, slime_view(data, rollout_id), evaluation=True)
    metrics = {k: float(v) for k, v in (output.metrics or {}).items() if isinstance(v, int | float)}
    for name, result in output.data.items():
        rewards = result.get("rewards") if isinstance(result, dict) else None
        if not rewards:
            raise ValueError(f"{where} returned no rewards for eval set {name!r}; give data[{name!r}]['rewards']")
        metrics[f"eval/{name}"] = sum(float(r) for r in rewards) / len(rewards)
        if result.get("truncated"):
            metrics[f"eval/{name}/truncated_rate"] = sum(result["truncated"]) / len(result["truncated"])
    path = ctx.config.eval.custom_eval_rollout_log_function_path
    if path is not None:
        log = load_plugin(path, "custom-eval-rollout-log-function-path")
        if log(rollout_id, ctx.args, output.data, dict(metrics)):
            return {}
    return metrics
