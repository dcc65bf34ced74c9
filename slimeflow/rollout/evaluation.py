"""Evaluation on named eval sets through the same rollout engines: avg@n (mean reward) and pass@k.

A response counts as correct when its reward is > 0 (math, gpqa, dapo's +1, any positive f1). Samples whose
generation or reward failed are counted under `failed` and left out of the averages, never scored 0.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slimeflow.rollout.data_source import DataSource
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.rewards import EVAL_SET
from slimeflow.rollout.rollout import RolloutContext, generate_group
from slimeflow.rollout.slime_rollout_hooks import call_eval_log
from slimeflow.rollout.types import Sample, Status


@dataclass(frozen=True)
class EvalSettings:
    """How eval responses are sampled: n per prompt and the sampling overrides (SGLang sampling_params)."""

    n_samples_per_eval_prompt: int
    sampling_params: dict[str, Any]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_ks(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, ... up to n, and n itself."""
    ks = sorted({1, n, *(2**i for i in range(1, n.bit_length()) if 2**i <= n)})
    return ks


def score_set(name: str, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
    """The metrics of one eval set from its generated, scored groups (one group per prompt)."""
    samples = [s for g in groups for s in g]
    good = [s for s in samples if s.status is not Status.FAILED and s.reward is not None]
    n = len(groups[0]) if groups else 1
    metrics = {f"eval/{name}/avg_at_{n}": sum(float(s.reward) for s in good) / max(len(good), 1),
               f"eval/{name}/prompts": float(len(groups)),
               f"eval/{name}/failed": float(len(samples) - len(good)),
               f"eval/{name}/response_len_mean": sum(s.response_length for s in good) / max(len(good), 1),
               f"eval/{name}/truncated_rate": sum(s.status is Status.TRUNCATED for s in good) / max(len(good), 1)}
    usable = [g for g in groups if all(s.status is not Status.FAILED and s.reward is not None for s in g)]
    for k in eval_ks(n):
        values = [pass_at_k(n, sum(float(s.reward) > 0 for s in g), k) for g in usable]
        metrics[f"eval/{name}/pass_at_{k}"] = sum(values) / max(len(values), 1)
    return metrics


async def evaluate_sets(ctx: RolloutContext, sets: Mapping[str, Sequence[Mapping[str, Any]]],
                        settings: EvalSettings) -> dict[str, float]:
    """Generate n responses for every prompt of every set, score them, and return the metrics of each set (none
    when a --custom-eval-rollout-log-function-path function says it logged them itself, as slime)."""
    metrics: dict[str, float] = {}
    results: dict[str, list[list[Sample]]] = {}
    for name, prompts in sets.items():
        source = DataSource(prompts, n_samples_per_prompt=settings.n_samples_per_eval_prompt)
        groups = source.get_groups(len(prompts))
        for group in groups:
            for sample in group:
                sample.metadata.setdefault(EVAL_SET, name)
        done = await asyncio.gather(*(generate_group(ctx, g, settings.sampling_params, evaluation=True)
                                       for g in groups))
        results[name] = list(done)
        metrics.update(score_set(name, done))
    path = ctx.config.eval.custom_eval_rollout_log_function_path
    if path is not None and call_eval_log(load_plugin(path, "custom-eval-rollout-log-function-path"), ctx.rollout_id,
                                          ctx.args, results, metrics):
        return {}
    return metrics
