"""The train stage's progress bar: every report reaches the RolloutLog it wraps, and the bar moves per rollout with
the latest reward and held-out scores beside it."""

from __future__ import annotations

from slimeflow.progress import step_progress
from slimeflow.stages.train.progress import ProgressReporter


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def started(self, start_rollout_id, evaluates_first, saved=None):
        self.calls.append(("started", start_rollout_id, evaluates_first, saved))

    def generated(self, rollout_id, row_ids):
        self.calls.append(("generated", rollout_id, row_ids))

    def rollout(self, rollout_id, metrics):
        self.calls.append(("rollout", rollout_id, metrics))

    def evaluation(self, version, metrics):
        self.calls.append(("evaluation", version, metrics))


def test_progress_forwards_every_report_and_moves_per_rollout():
    inner, bar = Recorder(), []
    reporter = ProgressReporter(inner, lambda done, note: bar.append((done, note)))
    reporter.started(2, True, {"x": 1.0})
    reporter.evaluation(2, {"eval/times/avg_at_1": 0.140625, "eval/times/truncated_rate": 0.8})
    reporter.generated(2, [["r1"]])
    reporter.rollout(2, {"rollout/reward_mean": 0.0625, "lr": 2e-5})
    reporter.evaluation(3, {"eval/times/avg_at_1": 0.65625})
    assert inner.calls == [("started", 2, True, {"x": 1.0}),
                           ("evaluation", 2, {"eval/times/avg_at_1": 0.140625, "eval/times/truncated_rate": 0.8}),
                           ("generated", 2, [["r1"]]),
                           ("rollout", 2, {"rollout/reward_mean": 0.0625, "lr": 2e-5}),
                           ("evaluation", 3, {"eval/times/avg_at_1": 0.65625})]
    assert bar == [(2, ""), (2, "times 0.14"), (3, "times 0.14  reward 0.06"), (3, "times 0.66  reward 0.06")]


def test_step_progress_draws_nothing_unless_enabled(capsys):
    with step_progress("train", 3, enabled=False) as update:
        update(1, "reward 0.5")
    assert capsys.readouterr().out == ""
