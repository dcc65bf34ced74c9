"""What the flows publish, read from manifests: eval score rows, browsable links, the MLflow run's URL."""

from __future__ import annotations

from slimeflow.flows.artifacts import browser_url, eval_rows, mlflow_run_url
from slimeflow.io.manifest import Manifest
from slimeflow.io.storage import S3Config


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
    aws = S3Config()
    assert browser_url(str(tmp_path / "m.json"), aws) == (tmp_path / "m.json").as_uri()
    # s3:// objects at the store's HTTP endpoint, path-style where one is set, AWS's virtual-hosted URL otherwise.
    assert browser_url("s3://bucket/run/m.json", aws) == "https://bucket.s3.amazonaws.com/run/m.json"
    assert (browser_url("s3://bucket/run a/m.json", S3Config(region="eu-west-1"))
            == "https://bucket.s3.eu-west-1.amazonaws.com/run%20a/m.json")
    assert (browser_url("s3://bucket/run/m.json", S3Config(endpoint_url="http://minio:9000/"))
            == "http://minio:9000/bucket/run/m.json")
    assert browser_url("http://host/x", aws) == "http://host/x"
    assert mlflow_run_url("http://mlflow:5000/", "3", "abc") == "http://mlflow:5000/#/experiments/3/runs/abc"
    assert mlflow_run_url(f"sqlite:///{tmp_path}/mlflow.db", "3", "abc") is None
