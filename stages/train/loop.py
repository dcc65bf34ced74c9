"""The loop, as slime's train.py: generate -> train -> save -> update weights -> evaluate, for num_rollout rollouts.

Placement, engines, backends and checkpoints live in the actors (rollout_manager.py, train_actor.py); this file is the algorithm.
A `Reporter` receives every rollout's prompt row ids (as soon as it is generated, so every checkpointed rollout
has them on record), its metrics, and every evaluation; the train stage writes them to rollouts.jsonl,
row_ids.jsonl and MLflow as they come, so a killed run has reported everything up to its death.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # placement.py builds the actors, which read this file's cadence (should_push, served_version)
    from slimeflow.stages.train.placement import Placement

Metrics = dict[str, float]


class Reporter(Protocol):
    def started(self, start_rollout_id: int, evaluates_first: bool, saved: Metrics | None = None) -> None:
        """Before anything else: the loop starts at `start_rollout_id` (after the loaded checkpoint) and, when
        `evaluates_first`, evaluates weights version `start_rollout_id` first. What was reported for later rollouts
        (by a killed run) is redone and must not be kept twice. `saved`: the metrics of the checkpoint's rollout
        (`start_rollout_id - 1`) as they stood at its save, for a run killed between the save and the report."""

    def generated(self, rollout_id: int, row_ids: list[list[str]]) -> None: ...

    def rollout(self, rollout_id: int, metrics: Metrics) -> None: ...

    def evaluation(self, version: int, metrics: Metrics) -> None: ...


@dataclass
class LoopResult:
    """What the loop did: the rollouts it ran, the prompt row ids of each, the last checkpoint and eval scores."""

    start_rollout_id: int
    num_rollout: int
    row_ids: dict[int, list[list[str]]] = field(default_factory=dict)
    checkpoint: str | None = None
    eval_history: dict[int, Metrics] = field(default_factory=dict)
    last_metrics: Metrics = field(default_factory=dict)


def train(placement: Placement, num_rollout: int, report: Reporter) -> LoopResult:
    """Run rollouts [start, num_rollout) where start follows the loaded checkpoint (0 on a fresh run)."""
    config = placement.config
    rollout_manager, actor_group = placement.rollout_manager, placement.actor_group
    start_rollout_id, saved_state = actor_group.load()
    result = LoopResult(start_rollout_id, num_rollout)
    evaluate_first = (start_rollout_id < num_rollout and bool(config.eval.eval_interval)
                      and not config.eval.skip_eval_before_train)
    report.started(start_rollout_id, evaluate_first, saved_state.get("report"))
    if start_rollout_id >= num_rollout:
        return result  # a finished run, started again: nothing left to do
    if saved_state.get("data_source"):
        rollout_manager.load_state_dict(saved_state["data_source"])
    actor_group.update_weights(version=start_rollout_id)

    if evaluate_first:
        result.eval_history[start_rollout_id] = evaluate(rollout_manager, start_rollout_id, report)

    for rollout_id in range(start_rollout_id, num_rollout):
        timer = Timer()
        with timer("generate"):
            batch, rollout_metrics, result.row_ids[rollout_id] = rollout_manager.generate(rollout_id)
        report.generated(rollout_id, result.row_ids[rollout_id])  # before any save that covers this rollout
        with timer("train"):
            train_metrics = actor_group.train(rollout_id, batch)

        if should_save(config.checkpoint.save_interval, rollout_id, num_rollout):
            with timer("save"):
                result.checkpoint = actor_group.save(rollout_id, {"data_source": rollout_manager.state_dict(rollout_id),
                                                                  "report": {**rollout_metrics, **train_metrics,
                                                                             **timer.seconds}})

        if should_push(config.weight_sync.update_weights_interval, rollout_id):
            with timer("update_weights"):
                actor_group.update_weights(version=rollout_id + 1)

        if should_run(config.eval.eval_interval, rollout_id, num_rollout):
            with timer("eval"):
                served = served_version(rollout_id + 1, start_rollout_id, config.weight_sync.update_weights_interval)
                result.eval_history[rollout_id + 1] = evaluate(rollout_manager, rollout_id + 1, report, served)
        result.last_metrics = {**rollout_metrics, **train_metrics, **timer.seconds}
        report.rollout(rollout_id, result.last_metrics)
    actor_group.wait_for_save()  # --async-save: the last checkpoint is committed before the run ends
    return result


class Timer:
    """Seconds per phase of one rollout, as metrics `time/<phase>` (a phase timed twice adds up)."""

    def __init__(self) -> None:
        self.seconds: Metrics = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{phase}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - started


def should_run(interval: int | None, rollout_id: int, num_rollout: int) -> bool:
    """Every `interval` rollouts and after the last one (slime saves and evaluates at the end too)."""
    if interval is None:
        return False
    return (rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout


def should_save(interval: int | None, rollout_id: int, num_rollout: int) -> bool:
    """As should_run, and after the last rollout even without an interval: a run that saved nothing would lose its
    training, and the evaluate and export stages read the final checkpoint. (slime saves nothing when
    --save-interval is unset; we deliberately save once, at the end.)"""
    return should_run(interval, rollout_id, num_rollout) or rollout_id + 1 == num_rollout


def should_push(interval: int, rollout_id: int) -> bool:
    """Push the weights after rollout `rollout_id`: every `interval` rollouts (--update-weights-interval)."""
    return (rollout_id + 1) % interval == 0


def served_version(rollout_id: int, start_rollout_id: int, interval: int) -> int:
    """The weight version the engines serve for rollout `rollout_id`: the last one pushed, at the start
    (`start_rollout_id`) or after a rollout that `should_push`."""
    return max(start_rollout_id, rollout_id - rollout_id % interval)


def evaluate(rollout_manager, version: int, report: Reporter, served: int | None = None) -> Metrics:
    """Evaluate after `version` rollouts, with the weights of version `served` (default `version`; older between
    pushes with --update-weights-interval)."""
    metrics = rollout_manager.evaluate(str(version if served is None else served))
    report.evaluation(version, metrics)
    return metrics
