"""MLflow tracking in a temporary sqlite file: nested runs, flattened params, metrics, failure status."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from slimeflow.io.tracking import Tracker, flatten


def test_flatten_nested_params():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None}) == {"a.b": 1, "a.c.d": [1, 2], "e": None}


def test_nested_runs_params_metrics_and_failure(mlflow_uri, tmp_path):
    tracker = Tracker(mlflow_uri, "exp", artifact_location=(tmp_path / "artifacts").as_uri())
    params = {"train": {"batch": {"rollout_batch_size": 32}, "long": "x" * 7000}}
    with tracker.run("pipeline") as parent:
        with tracker.run("train", params, parent_run_id=parent) as child:
            tracker.log_metrics(child, {"reward": 0.5}, step=3)
            tracker.log_metrics(child, {"reward": 0.7}, step=4)
        with pytest.raises(RuntimeError), tracker.run("export", parent_run_id=parent):
            raise RuntimeError("boom")
    client = MlflowClient(mlflow_uri)
    train = client.get_run(child)
    assert train.data.params["train.batch.rollout_batch_size"] == "32"
    assert len(train.data.params["train.long"]) == 6000  # MLflow's limit, truncated visibly with "..."
    assert [m.value for m in client.get_metric_history(child, "reward")] == [0.5, 0.7]
    assert train.data.tags["mlflow.parentRunId"] == parent
    runs = {r.info.run_name: r.info.status for r in client.search_runs([tracker.experiment_id])}
    assert runs == {"pipeline": "FINISHED", "train": "FINISHED", "export": "FAILED"}
    # The same experiment is found, not created twice.
    assert Tracker(mlflow_uri, "exp").experiment_id == tracker.experiment_id


# A process that imports MLflow, says it is ready, waits for the signal, then opens the tracker.
RACER = """
import sys, time
from pathlib import Path
from slimeflow.io.tracking import Tracker
ready, go = Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.001)
print(Tracker(sys.argv[1], "exp").experiment_id)
"""


def test_two_processes_create_one_fresh_sqlite_store_together(tmp_path):
    """Two `slimeflow run` on a fresh work directory: both create the store and experiment, neither fails in
    MLflow's migrations (`table _alembic_tmp_experiments already exists`)."""
    uri, go = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", RACER, uri, str(r), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both start together
    results = [p.communicate(timeout=60) for p in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-2000:]
    assert len({out.strip() for out, _ in results}) == 1  # one experiment, found by the second
