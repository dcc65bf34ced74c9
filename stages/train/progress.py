"""A progress bar over the loop's rollouts: a Reporter that passes every report on to another (the RolloutLog) and
moves the bar, with the latest rollout reward and held-out scores beside it."""

from __future__ import annotations

from collections.abc import Callable

from slimeflow.stages.train.loop import Metrics, Reporter

REWARD = "rollout/reward_mean"
EVAL_SCORE = "/avg_at_1"
"""An eval set's score: eval/<name>/avg_at_1 (with one greedy sample per prompt, its accuracy)."""


class ProgressReporter:
    """Forwards to `inner`; `update(done, note)` draws the bar (slimeflow.progress.step_progress)."""

    def __init__(self, inner: Reporter, update: Callable[[int, str], None]) -> None:
        self.inner = inner
        self.update = update
        self.done = 0
        self.figures: dict[str, float] = {}

    def started(self, start_rollout_id: int, evaluates_first: bool, saved: Metrics | None = None) -> None:
        self.inner.started(start_rollout_id, evaluates_first, saved)
        self.done = start_rollout_id
        self.update(self.done, "")

    def generated(self, rollout_id: int, row_ids: list[list[str]]) -> None:
        self.inner.generated(rollout_id, row_ids)

    def rollout(self, rollout_id: int, metrics: Metrics) -> None:
        self.inner.rollout(rollout_id, metrics)
        if REWARD in metrics:
            self.figures["reward"] = metrics[REWARD]
        self.done = rollout_id + 1
        self.update(self.done, self.note())

    def evaluation(self, version: int, metrics: Metrics) -> None:
        self.inner.evaluation(version, metrics)
        for key, value in metrics.items():
            if key.startswith("eval/") and key.endswith(EVAL_SCORE):
                self.figures[key.removeprefix("eval/").removesuffix(EVAL_SCORE)] = value
        self.update(self.done, self.note())

    def note(self) -> str:
        return "  ".join(f"{name} {value:.2f}" for name, value in self.figures.items())
