"""async_loop.py, as slime's train_async.py: rollout k+1 is asked for before training on k, weights are pushed every
--update-weights-interval rollouts once the rollout in flight is done, the staleness of every rollout is recorded and
bounded, a save carries the rollout in flight, and the flags that cannot work with it are refused."""

from __future__ import annotations

import pytest
from test_loop import Recorder

from slimeflow.config.pipeline import load_stage_config
from slimeflow.config.train import TrainConfig, staleness_bound
from slimeflow.errors import ConfigError
from slimeflow.stages.train import async_loop


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

    def state_dict(self, trained=None):
        self.calls.append(("state", trained))
        return {"offset": len(self.calls)}

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
        ("result", 2), ("train", 2, "batch-2"), ("state", 2), ("save", 2), ("update", 3), ("wait_for_save",),
    ]


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_staleness_is_recorded_for_every_rollout_and_stays_within_the_interval(interval):
    actors, reports = FakeActors(), Reports()
    async_loop.train(FakePlacement(actors, weight_sync={"update_weights_interval": interval}), 13, reports)
    staleness = [reports.rollouts[k]["async/staleness_max"] for k in range(13)]
    assert staleness[0] == 0 and max(staleness) == interval and min(staleness[1:]) == 1
    pushes = [c[1] for c in actors.calls if c[0] == "update"]
    assert pushes == [0, *range(interval, 14, interval), *([13] if 13 % interval else [])]  # and after the last


@pytest.mark.parametrize("ahead", [1, 2, 3])
@pytest.mark.parametrize("interval", [1, 2, 3])
def test_with_a_deeper_buffer_staleness_stays_within_it_and_the_data_order_is_the_sync_loops(ahead, interval):
    actors, reports = FakeActors(), Reports()
    placement = FakePlacement(actors, weight_sync={"update_weights_interval": interval},
                              placement={"async_buffer_size": ahead})
    async_loop.train(placement, 13, reports)
    staleness = [reports.rollouts[k]["async/staleness_max"] for k in range(13)]
    assert max(staleness) == ahead + interval - 1 and min(staleness[ahead:]) >= ahead  # reached, never exceeded
    # Each rollout asked for once, in order (the rollout manager generates them in turn: the sync loop's data order),
    # with `ahead` of them asked for before the one being trained.
    asked = [c for c in actors.calls if c[0] == "generate"]
    assert [c[1] for c in asked] == list(range(13))
    trains = [c[1] for c in actors.calls if c[0] == "train"]
    assert trains == list(range(13))
    for k in range(13 - ahead):
        assert actors.calls.index(asked[k + ahead]) < actors.calls.index(("train", k, f"batch-{k}"))
    # No push while a rollout asked for is not yet generated (waited for, or its result taken).
    for position, call in enumerate(actors.calls):
        if call[0] == "update":
            done = {c[1] for c in actors.calls[:position] if c[0] in ("wait", "result")}
            assert {c[1] for c in actors.calls[:position] if c[0] == "generate"} <= done


def test_a_resumed_loop_with_a_deeper_buffer_takes_every_saved_rollout_in_flight_first():
    saved = {"data_source": {"offset": 9, "in_flight": [{"rollout_id": 2}, {"rollout_id": 3}]}}
    actors = FakeActors(start=2, saved=saved)
    result = async_loop.train(FakePlacement(actors, placement={"async_buffer_size": 2}), 5, Reports())
    assert actors.calls[:4] == [("restore", saved["data_source"]), ("update", 2), ("generate", 2, 2),
                                ("generate", 3, 2)]
    assert sorted(result.row_ids) == [2, 3, 4]


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
    (["--async", "--debug-rollout-only"], "--async with --debug-rollout-only: there is no trainer"),
    (["--async", "--update-weights-interval", "3", "--max-staleness", "2"],
     "--update-weights-interval 3 with --async-buffer-size 1 lets the async loop train on samples up to 3 policy "
     "versions old (interval + buffer size - 1), more than --max-staleness 2"),
    (["--async", "--async-buffer-size", "3", "--max-staleness", "2"],
     "--update-weights-interval 1 with --async-buffer-size 3 lets the async loop train on samples up to 3"),
    (["--max-staleness", "1"], "--max-staleness 1 needs --async"),
    (["--async-buffer-size", "4"], "--async-buffer-size 4 needs --async (only the asynchronous loop generates"),
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
    # The seeds' async workflow (slime-skill-en.md, Workflow 2): a buffer of 4 rollouts, weights every 2.
    seeds = load_stage_config("train", {"rollout-batch-size": 2, "num-rollout": 2},
                              ["--async", "--async-buffer-size", "4", "--update-weights-interval", "2"])
    assert seeds.placement.async_buffer_size == 4 and staleness_bound(seeds) == 5
