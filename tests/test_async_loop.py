"""async_loop.py, as slime's train_async.py: rollout k+1 is asked for before training on k, weights are pushed every
--update-weights-interval rollouts once the rollout in flight is done, the staleness of every rollout is recorded and
bounded, a save carries the rollout in flight, and the flags that cannot work with it are refused."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from test_loop import Recorder
from test_train_e2e import launch, row_ids, train_config, wait_until_gone

from slimeflow.config.flags import ConfigError
from slimeflow.config.pipeline import load_stage_config
from slimeflow.stages.rl import async_loop
from slimeflow.stages.rl.config import TrainConfig


class Pending:
    def __init__(self, fake, rollout_id, version):
        self.fake, self.rollout_id, self.version = fake, rollout_id, version

    def wait(self):
        self.fake.calls.append(("wait", self.rollout_id))

    def result(self):
        self.fake.calls.append(("result", self.rollout_id))
        return (f"batch-{self.rollout_id}", {"rollout/weight_version_min": float(self.version),
                                             "rollout/weight_version_max": float(self.version)},
                [[f"row-{self.rollout_id}"]])


class FakeActors(Recorder):
    """test_loop's recorder of the rollout manager and actor group calls, with the async loop's start_generate;
    versions as the engines would report them."""

    def __init__(self, start=0, saved=None, engine_versions=None):
        super().__init__(start, saved)
        self.engine_versions = engine_versions or {}  # engines that kept other weights

    def start_generate(self, rollout_id, version):
        self.calls.append(("generate", rollout_id, version))
        return Pending(self, rollout_id, self.engine_versions.get(rollout_id, version))


class Reports:
    def __init__(self):
        self.rollouts = {}

    def started(self, start_rollout_id, evaluates_first, saved=None):
        pass

    def generated(self, rollout_id, row_ids):
        pass

    def rollout(self, rollout_id, metrics):
        self.rollouts[rollout_id] = metrics

    def evaluation(self, version, metrics):
        pass


class FakePlacement:
    def __init__(self, actors, **train):
        base = {"batch": {"rollout_batch_size": 1, "num_rollout": 6}, "placement": {"async_": True}}
        for group, values in train.items():
            base.setdefault(group, {}).update(values)
        self.config = TrainConfig.model_validate(base)
        self.rollout_manager = self.actor_group = actors


def test_the_next_rollout_is_asked_for_before_training_and_weights_wait_for_it():
    actors = FakeActors()
    async_loop.train(FakePlacement(actors, checkpoint={"save_interval": 3}), 3, Reports())
    assert actors.calls == [
        ("update", 0), ("generate", 0, 0),
        ("result", 0), ("generate", 1, 0), ("train", 0, "batch-0"), ("wait", 1), ("update", 1),
        ("result", 1), ("generate", 2, 1), ("train", 1, "batch-1"), ("wait", 2), ("update", 2),
        ("result", 2), ("train", 2, "batch-2"), ("save", 2), ("wait", 2), ("update", 3),
    ]


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_staleness_is_recorded_for_every_rollout_and_stays_within_the_interval(interval):
    actors, reports = FakeActors(), Reports()
    async_loop.train(FakePlacement(actors, weight_sync={"update_weights_interval": interval}), 13, reports)
    staleness = [reports.rollouts[k]["async/staleness_max"] for k in range(13)]
    assert staleness[0] == 0 and max(staleness) == interval and min(staleness[1:]) == 1
    pushes = [c[1] for c in actors.calls if c[0] == "update"]
    assert pushes == [0, *range(interval, 14, interval), *([13] if 13 % interval else [])]  # and after the last


def test_a_rollout_older_than_the_bound_stops_the_run_with_the_versions():
    # Engines that missed the push of version 2 answer rollout 3 with version 0: three versions stale, bound 2.
    actors = FakeActors(engine_versions={3: 0})
    placement = FakePlacement(actors, weight_sync={"update_weights_interval": 2})
    with pytest.raises(async_loop.StalenessError, match=r"rollout 3 .* versions 0\.\.0: staleness 3\.\.3, outside 0\.\.2"):
        async_loop.train(placement, 6, Reports())
    assert ("train", 3, "batch-3") not in actors.calls


def test_a_resumed_async_loop_restores_the_rollout_in_flight_and_starts_after_the_checkpoint():
    actors = FakeActors(start=2, saved={"data_source": {"offset": 7, "in_flight": {"rollout_id": 2}}})
    result = async_loop.train(FakePlacement(actors), 4, Reports())
    assert actors.calls[:3] == [("restore", {"offset": 7, "in_flight": {"rollout_id": 2}}), ("update", 2),
                                ("generate", 2, 2)]
    assert sorted(result.row_ids) == [2, 3]


@pytest.mark.parametrize(("flags", "message"), [
    (["--async", "--colocate"], "--async with --colocate: slime refuses it too"),
    (["--async", "--partial-rollout"], "--async with --partial-rollout: a continued sample's first tokens"),
    (["--async", "--debug-rollout-only"], "--async with --debug-rollout-only: there is no trainer"),
    (["--async", "--update-weights-interval", "3", "--max-staleness", "2"],
     "--update-weights-interval 3 lets the async loop train on samples up to 3 policy versions old, more than "
     "--max-staleness 2"),
    (["--max-staleness", "1"], "--max-staleness 1 needs --async"),
    (["--async-buffer-size", "4"], "--async-buffer-size: not supported yet (--async (slime's train_async.py) "
                                   "generates one rollout ahead"),
])
def test_what_the_async_loop_cannot_do_is_refused_with_the_reason(flags, message):
    with pytest.raises(ConfigError) as err:
        load_stage_config("train", {"rollout-batch-size": 2, "num-rollout": 2}, flags)
    assert message in str(err.value)


def test_async_is_spelled_as_a_flag_and_in_yaml_and_gives_the_engine_its_own_process():
    for config in (load_stage_config("train", {"rollout-batch-size": 2, "num-rollout": 2}, ["--async"]),
                   load_stage_config("train", {"rollout-batch-size": 2, "num-rollout": 2, "async": True})):
        assert config.placement.async_ and not config.placement.engine_in_process
    kept = load_stage_config("train", {"rollout-batch-size": 2, "num-rollout": 2, "async": True,
                                       "engine-in-process": True})
    assert kept.placement.engine_in_process  # given explicitly: honoured


@pytest.mark.slow
def test_sigkill_mid_async_run_then_resume_trains_every_rollouts_rows_exactly_once_in_the_sync_order(tmp_path):
    from slimeflow.stages.rl.data_source import DataSource

    config, _ = train_config(tmp_path / "prep", **{"num-rollout": 4, "save-interval": 2, "eval-interval": None,
                                                   "rollout-batch-size": 4, "n-samples-per-prompt": 2,
                                                   "async": True, "update-weights-interval": 2, "use-tis": True})
    # The sync loop's data order: rollout k takes the data source's next rollout_batch_size groups.
    source = DataSource.from_prompt_data(config.data.prompt_data, shuffle=config.data.rollout_shuffle,
                                         seed=config.data.rollout_seed)
    expected = {k: [g[0].metadata["row_id"] for g in source.get_groups(4)] for k in range(4)}

    victim = launch(config, tmp_path / "run")
    tracker = tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while not tracker.exists() and time.time() < deadline and victim.poll() is None:
        time.sleep(0.01)
    os.killpg(victim.pid, signal.SIGKILL)  # after the first checkpoint, with rollout 2 generated, not yet trained
    victim.wait()
    wait_until_gone(session=victim.pid, timeout=60)
    assert tracker.read_text() == "1", "the kill should come before the second checkpoint (rollout 3)"
    resumed = launch(config, tmp_path / "run")
    assert resumed.wait(timeout=400) == 0

    assert row_ids(tmp_path / "run") == expected  # each rollout once, in the sync loop's order
    # (A kill between a checkpoint's commit and its rollout's metrics line loses that line, as in the sync loop: the
    # metrics are reported after the save. The row ids above are reported before it.)
    records = {r["step"]: r for line in (tmp_path / "run" / "train" / "rollouts.jsonl").read_text().splitlines()
               for r in [json.loads(line)]}
    assert {2, 3} <= set(records) <= {0, 1, 2, 3}
    # Rollout 2 is the killed run's, carried by checkpoint 1: generated with weights 0 (pushed every 2 rollouts, and
    # only once rollout 2 was generated), not again by the resumed run, whose engines hold version 2 from its start.
    assert records[2]["rollout/weight_version_max"] == 0 and records[2]["async/staleness_max"] == 2
    assert all(0 <= r["async/staleness_min"] <= r["async/staleness_max"] <= 2 for r in records.values())
    # --use-tis weighs by the trainer's over the engine's probabilities: here of the policy 0 to 2 versions old.
    assert all(0.5 < r["tis"] < 2.0 for r in records.values()), [r["tis"] for r in records.values()]
