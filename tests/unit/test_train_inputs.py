"""What the train stage refuses before Ray starts (its data). How a failure inside a Ray actor reaches the user is in
tests/integration/test_remote_errors.py."""

from __future__ import annotations

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
