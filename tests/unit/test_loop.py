"""loop.py drives the actors in slime's order, saves and evaluates on schedule, and starts after a checkpoint."""

from __future__ import annotations

import json

import pytest

from slimeflow.config.train import TrainConfig
from slimeflow.stages.train import loop
from slimeflow.stages.train import placement as placement_module
from slimeflow.stages.train.remote import LoopError


class Recorder:
    def __init__(self, start=0, saved=None):
        self.calls, self.start, self.saved = [], start, saved or {}

    # the rollout manager's side
    def generate(self, rollout_id):
        self.calls.append(("generate", rollout_id))
        return f"batch-{rollout_id}", {"rollout/reward_mean": 0.5}, [[f"row-{rollout_id}"]]

    def evaluate(self, version):
        self.calls.append(("eval", version))
        return {"eval/x/avg_at_1": float(version)}

    def state_dict(self, trained=None):
        return {"offset": len(self.calls)}

    def load_state_dict(self, state):
        self.calls.append(("restore", state))

    # the actor group's side
    def load(self):
        return self.start, self.saved

    def train(self, rollout_id, batch):
        self.calls.append(("train", rollout_id, batch))
        return {"pg_loss": 0.1}

    def save(self, rollout_id, extra):
        self.calls.append(("save", rollout_id))
        return f"iter_{rollout_id}"

    def wait_for_save(self):
        self.calls.append(("wait_for_save",))

    def update_weights(self, version):
        self.calls.append(("update", version))


class Reports:
    def __init__(self, recorder=None):
        self.rollouts, self.evals, self.recorder, self.starts = [], [], recorder, []

    def started(self, start_rollout_id, evaluates_first, saved=None):
        self.starts.append((start_rollout_id, evaluates_first))

    def generated(self, rollout_id, row_ids):
        if self.recorder is not None:
            self.recorder.calls.append(("generated", rollout_id))

    def rollout(self, rollout_id, metrics):
        self.rollouts.append((rollout_id, sorted(metrics)))

    def evaluation(self, version, metrics):
        self.evals.append(version)


class FakePlacement:
    def __init__(self, recorder, **train):
        base = {"batch": {"rollout_batch_size": 1, "num_rollout": 4}, "checkpoint": {"save_interval": 2},
                "eval": {"eval_interval": 2}}
        for group, values in train.items():
            base.setdefault(group, {}).update(values)
        self.config = TrainConfig.model_validate(base)
        self.rollout_manager = self.actor_group = recorder


def test_the_loop_runs_in_slimes_order_and_reports_every_rollout():
    recorder, reports = Recorder(), Reports()
    result = loop.train(FakePlacement(recorder), 4, reports)
    names = [c[0] for c in recorder.calls]
    assert names == ["update", "eval",
                     "generate", "train", "update",
                     "generate", "train", "save", "update", "eval",
                     "generate", "train", "update",
                     "generate", "train", "save", "update", "eval", "wait_for_save"]
    assert ("train", 2, "batch-2") in recorder.calls and ("update", 4) in recorder.calls
    assert [r[0] for r in reports.rollouts] == [0, 1, 2, 3] and reports.evals == [0, 2, 4]
    assert result.checkpoint == "iter_3" and result.row_ids[1] == [["row-1"]]
    assert "time/generate" in reports.rollouts[0][1] and "time/save" in reports.rollouts[1][1]


def test_row_ids_are_reported_before_the_save_that_covers_them():
    recorder = Recorder()
    loop.train(FakePlacement(recorder), 2, Reports(recorder))
    names = [c[0] for c in recorder.calls]
    assert names.index("generated") < names.index("train")
    assert names[names.index("save") - 2:names.index("save")] == ["generated", "train"]


def test_a_resumed_loop_restores_the_data_position_and_starts_after_the_checkpoint():
    recorder = Recorder(start=2, saved={"data_source": {"offset": 7}, "rollout_id": 1})
    placement = FakePlacement(recorder, eval={"skip_eval_before_train": True})
    result = loop.train(placement, 4, Reports())
    assert recorder.calls[:2] == [("restore", {"offset": 7}), ("update", 2)]
    assert [c[1] for c in recorder.calls if c[0] == "generate"] == [2, 3]
    assert result.start_rollout_id == 2 and sorted(result.row_ids) == [2, 3]


def test_weights_are_pushed_every_update_weights_interval_and_evaluated_as_served():
    recorder, reports = Recorder(), Reports()
    placement = FakePlacement(recorder, weight_sync={"update_weights_interval": 2}, eval={"eval_interval": 1})
    loop.train(placement, 5, reports)
    assert [c[1] for c in recorder.calls if c[0] == "update"] == [0, 2, 4]
    # Evaluation after rollout k runs on the weights the engines serve: the last pushed version.
    assert [c[1] for c in recorder.calls if c[0] == "eval"] == ["0", "0", "2", "2", "4", "4"]
    assert reports.evals == [0, 1, 2, 3, 4, 5]
    assert [loop.served_version(r, 0, 2) for r in range(5)] == [0, 0, 2, 2, 4]
    assert [loop.served_version(r, 3, 4) for r in range(3, 10)] == [3, 4, 4, 4, 4, 8, 8]  # resumed at 3


def test_a_finished_run_does_nothing():
    recorder = Recorder(start=4)
    result = loop.train(FakePlacement(recorder), 4, Reports())
    assert recorder.calls == [] and result.row_ids == {}


def test_should_run_every_interval_and_at_the_end():
    assert [r for r in range(7) if loop.should_run(3, r, 7)] == [2, 5, 6]
    assert not any(loop.should_run(None, r, 7) for r in range(7))


def test_the_driver_imports_neither_torch_nor_transformers():
    """The train stage's driver only creates the actors and calls them: importing what they compute with would
    put ~0.8 s of torch (and more of transformers) before Ray can start."""
    import subprocess
    import sys

    code = ("import sys, slimeflow.stages.train.stage; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_without_save_interval_the_loop_still_saves_after_the_last_rollout():
    # Without a save the run would end holding no checkpoint: its training lost, nothing for evaluate/export.
    recorder = Recorder()
    placement = FakePlacement(recorder, checkpoint={"save_interval": None}, eval={"eval_interval": None})
    result = loop.train(placement, 3, Reports())
    assert [c for c in recorder.calls if c[0] == "save"] == [("save", 2)] and result.checkpoint == "iter_2"
    assert not any(c[0] == "eval" for c in recorder.calls)  # no --eval-interval: no eval, as in slime


class Killed(Exception):
    pass


def test_a_resumed_run_keeps_each_rollout_once_in_its_record_and_its_mlflow_run(tmp_path):
    from slimeflow.stages.train.stage import RolloutLog

    path = tmp_path / "train" / "rollouts.jsonl"

    class DiesInRollout3(Recorder):
        def train(self, rollout_id, batch):
            if rollout_id == 3:
                raise Killed
            return super().train(rollout_id, batch)

    first_run = []  # the killed attempt's MLflow run: (step, metric) as logged
    try:
        loop.train(FakePlacement(DiesInRollout3()), 4, RolloutLog(path, lambda m, s: first_run.extend((s, k) for k in m)))
    except Killed:
        pass
    with path.open("a") as out:
        out.write('{"step": 3, "rollout/rew')  # a line cut short by the kill
    # The checkpoint covers rollout 1 (save interval 2): the resumed run redoes 2 and 3, and evaluates version 2 first.
    second_run = []
    resumed = Recorder(start=2, saved={"data_source": {"offset": 9}, "rollout_id": 1})
    loop.train(FakePlacement(resumed), 4, RolloutLog(path, lambda m, s: second_run.extend((s, k) for k in m)))

    records = [json.loads(line) for line in path.read_text().splitlines()]
    rollouts = [r["step"] for r in records if "rollout/reward_mean" in r]
    evals = [r["step"] for r in records if "eval/x/avg_at_1" in r]
    assert rollouts == [0, 1, 2, 3] and evals == [0, 2, 4]
    ids = [json.loads(line)["rollout_id"] for line in path.with_name("row_ids.jsonl").read_text().splitlines()]
    assert ids == [0, 1, 2, 3]
    # This attempt's MLflow run holds the whole history, each (step, metric) once.
    assert len(second_run) == len(set(second_run))
    assert {s for s, k in second_run if k == "rollout/reward_mean"} == {0, 1, 2, 3}
    assert {s for s, k in second_run if k == "eval/x/avg_at_1"} == {0, 2, 4}


def test_a_run_killed_between_a_save_and_its_report_keeps_the_saved_rollouts_line(tmp_path):
    """The checkpoint of rollout 1 is committed, then the run dies before rollout 1's line: the resumed run (which
    starts at 2) writes that line from the metrics the checkpoint carries, once, and logs it to its MLflow run."""
    from slimeflow.stages.train.stage import RolloutLog

    path = tmp_path / "train" / "rollouts.jsonl"
    saves = {}

    class DiesAfterSave1(Recorder):
        def save(self, rollout_id, extra):
            saves[rollout_id] = json.loads(json.dumps(extra))  # as the checkpoint's extra_state.json holds it
            if rollout_id == 1:
                raise Killed
            return super().save(rollout_id, extra)

    try:
        loop.train(FakePlacement(DiesAfterSave1()), 4, RolloutLog(path))
    except Killed:
        pass
    assert [r["step"] for r in RolloutLog(path).read() if "rollout/reward_mean" in r] == [0]
    assert saves[1]["report"]["pg_loss"] == 0.1 and "time/train" in saves[1]["report"]

    logged = []
    resumed = Recorder(start=2, saved={"data_source": {"offset": 9}, "rollout_id": 1, "report": saves[1]["report"]})
    loop.train(FakePlacement(resumed), 4, RolloutLog(path, lambda m, s: logged.append((s, sorted(m)))))
    rollouts = [r for r in RolloutLog(path).read() if "rollout/reward_mean" in r]
    assert [r["step"] for r in rollouts] == [0, 1, 2, 3]
    assert rollouts[1]["pg_loss"] == 0.1 and "time/save" not in rollouts[1]  # as it stood at the save
    assert (1, sorted(saves[1]["report"])) in logged

    # Started again from the same checkpoint (killed once more, later): the line is not written twice.
    RolloutLog(path).started(2, evaluates_first=True, saved=saves[1]["report"])
    assert [r["step"] for r in RolloutLog(path).read() if "rollout/reward_mean" in r] == [0, 1]


@pytest.mark.parametrize("outcome", ["ends", "too_slow", "failed"])
def test_a_stopping_run_lets_the_async_commit_in_flight_end_and_says_when_it_did_not(outcome, caplog):
    asked = []

    class Trainers:
        def wait_for_save(self, timeout=None):
            asked.append(timeout)
            if outcome == "failed":
                raise LoopError("committing the last checkpoint (--async-save) failed: OSError: disk gone")
            return outcome == "ends"

    config = TrainConfig.model_validate({"batch": {"rollout_batch_size": 1, "num_rollout": 2},
                                         "checkpoint": {"async_save": True}})
    placement = placement_module.Placement(config, rollout_manager=None, actor_group=Trainers())
    with caplog.at_level("WARNING"):
        placement._let_commit_end()
    assert asked == [placement_module.COMMIT_GRACE_S]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert ("resumes from the previous checkpoint" in warned) == (outcome != "ends")
    assert ("disk gone" in warned) == (outcome == "failed")
