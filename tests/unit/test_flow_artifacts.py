"""What the flows publish, read from manifests: eval score rows, browsable links, the MLflow run's URL."""

from __future__ import annotations

from slimeflow.flows.artifacts import eval_rows, link, mlflow_run_url
from slimeflow.io.manifest import Manifest


def test_eval_rows_come_from_the_evaluate_metrics_or_the_train_runs_first_and_last_evaluation():
    evaluated = Manifest(stage="evaluate", metrics={"eval/math/avg_at_4": 0.5, "eval/math/pass_at_4": 0.75,
                                                    "eval/gsm8k/avg_at_1": 0.25, "tokens": 10.0})
    assert eval_rows(evaluated) == [{"set": "gsm8k", "metric": "avg_at_1", "score": 0.25},
                                    {"set": "math", "metric": "avg_at_4", "score": 0.5},
                                    {"set": "math", "metric": "pass_at_4", "score": 0.75}]
    trained = Manifest(stage="train", facts={"eval_first": {"eval/inc/avg_at_1": 0.1},
                                             "eval_last": {"eval/inc/avg_at_1": 0.9}})
    assert eval_rows(trained) == [{"set": "inc", "metric": "avg_at_1", "first": 0.1, "last": 0.9}]
    assert eval_rows(Manifest(stage="train")) == []


def test_links_are_browsable_and_only_a_served_mlflow_store_has_a_run_url(tmp_path):
    assert link(str(tmp_path / "m.json")) == (tmp_path / "m.json").as_uri()
    assert link("s3://bucket/run/m.json") == "s3://bucket/run/m.json"
    assert mlflow_run_url("http://mlflow:5000/", "3", "abc") == "http://mlflow:5000/#/experiments/3/runs/abc"
    assert mlflow_run_url(f"sqlite:///{tmp_path}/mlflow.db", "3", "abc") is None
