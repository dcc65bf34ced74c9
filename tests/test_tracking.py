"""MLflow tracking in a temporary sqlite file: nested runs, flattened params, metrics, failure status."""

from __future__ import annotations

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
