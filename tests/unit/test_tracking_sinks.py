"""W&B (offline) and TensorBoard beside MLflow: the train stage's metrics arrive there with the same names and steps."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import psutil
import pytest

from slimeflow.config.pipeline import load_stage_config
from slimeflow.errors import ConfigError, StageInputError
from slimeflow.io.sinks import close_sinks, fan_out, open_sinks
from slimeflow.stages.train.stage import RolloutLog

BASE = ["--hf-checkpoint", "tiny:qwen3", "--prompt-data", "p.parquet", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--num-rollout", "2"]
ROLLOUTS = [{"rollout/reward_mean": 0.25, "pg_loss": 0.5}, {"rollout/reward_mean": 0.75, "pg_loss": -0.1}]
EVAL = {"eval/math/avg_at_1": 0.5}


def log_a_run(tmp_path: Path, *flags: str) -> None:
    """Two rollouts and an evaluation through the train stage's reporter, with the sinks the flags ask for."""
    config = load_stage_config("train", None, [*BASE, *flags])
    mlflow_calls: list[tuple[dict[str, float], int]] = []
    sinks = open_sinks(config.logging, tmp_path, {"seed": 1})
    try:
        history = RolloutLog(tmp_path / "train" / "rollouts.jsonl",
                             fan_out(lambda m, step: mlflow_calls.append((m, step)), sinks))
        for rollout_id, metrics in enumerate(ROLLOUTS):
            history.rollout(rollout_id, metrics)
        history.evaluation(2, EVAL)
    finally:
        close_sinks(sinks)
    assert mlflow_calls == [(ROLLOUTS[0], 0), (ROLLOUTS[1], 1), (EVAL, 2)]  # MLflow still gets everything


def test_tensorboard_gets_every_metric_at_its_step(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    log_a_run(tmp_path, "--use-tensorboard", "--tb-project-name", "proj", "--tb-experiment-name", "exp")
    directory = tmp_path / "train" / "tensorboard_log" / "proj" / "exp"
    events = EventAccumulator(str(directory))
    events.Reload()
    scalars = {tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {"rollout/reward_mean": [(0, 0.25), (1, 0.75)], "pg_loss": [(0, 0.5), (1, -0.1)],
                       "eval/math/avg_at_1": [(2, 0.5)]}


def test_tensorboard_dir_from_the_environment_and_a_clear_refusal_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    log_a_run(tmp_path, "--use-tensorboard")
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    monkeypatch.delenv("TENSORBOARD_DIR")
    with pytest.raises(StageInputError, match="neither --tb-project-name nor TENSORBOARD_DIR"):
        log_a_run(tmp_path, "--use-tensorboard")


def wandb_history(run_file: Path) -> list[dict[str, float]]:
    """The history rows of an offline W&B run file (a LevelDB-style log of protobuf records after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, rows, pos, pending = run_file.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows.append({key: value for key, value in items.items() if not key.startswith("_")})
    return rows


def test_wandb_offline_gets_every_metric_at_its_step_and_stops_its_process(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    log_a_run(tmp_path, "--use-wandb", "--wandb-mode", "offline", "--wandb-project", "proj", "--wandb-group", "grp",
              "--disable-wandb-random-suffix")
    (run_file,) = (tmp_path / "train" / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_history(run_file) == [{**ROLLOUTS[0], "rollout/step": 0}, {**ROLLOUTS[1], "rollout/step": 1},
                                       {**EVAL, "eval/step": 2}]
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []


def test_wandb_needs_a_project_and_a_group():
    with pytest.raises(ConfigError, match="--use-wandb needs --wandb-project and --wandb-group"):
        load_stage_config("train", None, [*BASE, "--use-wandb", "--wandb-mode", "offline"])
