"""What the train stage refuses before Ray starts (its data), and how a failure inside a Ray actor reaches the
user: with the cause's type and message, not "the actor died"."""

from __future__ import annotations

import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slimeflow.config.train import TrainConfig
from slimeflow.errors import StageInputError
from slimeflow.io.storage import Storage
from slimeflow.preprocess.writer import schema_for
from slimeflow.stages.base import StageContext
from slimeflow.stages.train import stage


def prompt_parquet(path, rows: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {"row_id": [str(i) for i in range(rows)], "prompt": [f"{i}+1=" for i in range(rows)],
               "label": [str(i + 1) for i in range(rows)], "metadata": ["{}"] * rows, "tools": [None] * rows,
               "prompt_tokens": [None] * rows}
    pq.write_table(pa.table(columns, schema=schema_for("text")), path)
    return str(path)


def train_config(tmp_path, prompt_data: str, eval_sets: dict[str, str]) -> TrainConfig:
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text("{}")
    return TrainConfig.model_validate({
        "batch": {"rollout_batch_size": 2, "num_rollout": 1}, "reward": {"rm_type": "prefix_match"},
        "checkpoint": {"hf_checkpoint": str(hf), "save": str(tmp_path / "ckpt")},
        "data": {"prompt_data": prompt_data}, "eval": {"eval_prompt_data": eval_sets}})


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(address):
        raise AssertionError("the train stage started Ray")

    monkeypatch.setattr(stage, "init_ray", refuse)


def test_bad_data_paths_are_named_before_ray_starts(tmp_path, no_ray):
    (tmp_path / "empty-dir").mkdir()
    prompt_parquet(tmp_path / "zero" / "part-00000.parquet", 0)
    config = train_config(tmp_path, str(tmp_path / "zero"), {
        "missing": str(tmp_path / "no-such-set"), "empty": str(tmp_path / "empty-dir"),
        "good": prompt_parquet(tmp_path / "good.parquet", 2)})
    with pytest.raises(StageInputError, match="the train stage cannot start") as err:
        stage.run(config, StageContext(Storage(), tmp_path / "work", str(tmp_path / "out")))
    problems = err.value.problems
    assert f"--prompt-data: {tmp_path}/zero: has no rows (a set needs at least one prompt)" in problems
    assert f"--eval-prompt-data missing: {tmp_path}/no-such-set: no such file, directory or object" in problems
    assert any(p.startswith("--eval-prompt-data empty: ") and "no .parquet files under it" in p for p in problems)
    assert len(problems) == 3  # the good set is not among them (a parquet of other columns is raw data: see
    # test_raw_prompt_data)
    assert not (tmp_path / "ckpt").exists()  # nothing was claimed or written


def test_good_data_passes_the_check(tmp_path):
    config = train_config(tmp_path, prompt_parquet(tmp_path / "train.parquet", 3),
                          {"eval": prompt_parquet(tmp_path / "eval.parquet", 1)})
    assert stage.data_problems(config, StageContext(Storage(), tmp_path, str(tmp_path))) == []


def test_evaluate_checks_its_sets_the_same_way(tmp_path):
    from slimeflow.config.evaluate import EvaluateConfig
    from slimeflow.stages.evaluate.stage import _eval_sets

    prompt_parquet(tmp_path / "zero.parquet", 0)
    config = EvaluateConfig(eval_prompt_data={"zero": str(tmp_path / "zero.parquet"), "missing": str(tmp_path / "x"),
                                              "good": prompt_parquet(tmp_path / "good.parquet", 2)})
    ctx = StageContext(Storage(), tmp_path, str(tmp_path))
    with pytest.raises(StageInputError, match="--eval-prompt-data") as err:
        _eval_sets(config, ctx)
    assert [p.split(": ")[0] for p in err.value.problems] == ["zero", "missing"]
    good = config.model_copy(update={"eval_prompt_data": {"good": str(tmp_path / "good.parquet")}})
    assert [row["label"] for row in _eval_sets(good, ctx)[0]["good"]] == ["1", "2"]


class Unpicklable(Exception):
    def __init__(self, a, b):  # pickle would call Unpicklable("1/2"): Ray cannot carry it back as it is
        super().__init__(f"{a}/{b}")


class Toy:
    """An actor that fails to start when asked, and whose methods fail."""

    def __init__(self, fail: bool):
        if fail:
            raise ValueError("the prompt dataset is empty")
        self.seen: list[str] = []

    def ping(self) -> str:
        return "pong"

    def unpicklable(self) -> None:
        raise Unpicklable(1, 2)

    def with_callback(self) -> None:
        try:
            self.unpicklable()  # a call from inside the actor raises what the method raises
        except Unpicklable as err:
            raise KeyError(f"callback: {err}") from err


def test_an_actor_failure_reaches_the_driver_with_its_type_and_message():
    import ray

    from slimeflow.cluster import LOCAL_RAY_SYSTEM_CONFIG
    from slimeflow.stages.train.remote import LoopError, call, hosted

    started = not ray.is_initialized()  # an in-process train test earlier in the session may have left its Ray up
    if started:
        ray.init(num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    try:
        broken = ray.remote(num_cpus=0)(hosted(Toy)).remote(True)
        with pytest.raises(LoopError) as err:
            call(broken.ping.remote(), "starting the toy")
        assert str(err.value) == "starting the toy failed: Toy could not start: ValueError: the prompt dataset is empty"
        assert 'raise ValueError("the prompt dataset is empty")' in "".join(err.value.__notes__)  # its traceback
        toy = ray.remote(num_cpus=0)(hosted(Toy)).remote(False)
        assert call(toy.ping.remote(), "ping") == "pong"
        with pytest.raises(LoopError, match=r"^unpicklable failed: Unpicklable: 1/2\n"):
            call(toy.unpicklable.remote(), "unpicklable")
        with pytest.raises(LoopError, match=r"^callback failed: KeyError: 'callback: 1/2'\n"):
            call(toy.with_callback.remote(), "callback")
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        if started:
            ray.shutdown()
