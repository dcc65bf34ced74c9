"""slime.rollout.base_types: what a rollout function (--rollout-function-path) returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slimeflow.slime_compat.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    """A training rollout: the groups of samples (a group may hold lists of samples) and extra metrics."""

    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """An evaluation: per dataset name, its 'rewards' (and 'truncated', 'samples'), and extra metrics."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def call_rollout_fn(fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """`fn(*args, evaluation=...)`, a bare return wrapped in the output type, as slime does for old functions."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, RolloutFnTrainOutput | RolloutFnEvalOutput):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    return output
