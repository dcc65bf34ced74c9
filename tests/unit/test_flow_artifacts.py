"""What the flows publish, read from manifests: eval score rows, links a person can open, the MLflow run's URL."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slimeflow.flows import artifacts
from slimeflow.flows.artifacts import browser_url, eval_rows, markdown_link, mlflow_run_url
from slimeflow.io.manifest import Manifest
from slimeflow.io.storage import S3Config, Storage


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


def test_only_what_another_machine_can_open_is_a_link(tmp_path):
    aws = S3Config()
    # A path on the worker's disk has no URL (a file:// link opens nothing at another machine).
    assert browser_url(str(tmp_path / "m.json"), aws) is None
    assert browser_url((tmp_path / "m.json").as_uri(), aws) is None
    assert browser_url("gs://bucket/m.json", aws) is None
    # s3:// objects at the store's HTTP endpoint, path-style where one is set, AWS's virtual-hosted URL otherwise.
    assert browser_url("s3://bucket/run/m.json", aws) == "https://bucket.s3.amazonaws.com/run/m.json"
    assert (browser_url("s3://bucket/run a/m.json", S3Config(region="eu-west-1"))
            == "https://bucket.s3.eu-west-1.amazonaws.com/run%20a/m.json")
    assert (browser_url("s3://bucket/run/m.json", S3Config(endpoint_url="http://minio:9000/"))
            == "http://minio:9000/bucket/run/m.json")
    assert browser_url("http://host/x", aws) == "http://host/x"
    assert mlflow_run_url("http://mlflow:5000/", "3", "abc") == "http://mlflow:5000/#/experiments/3/runs/abc"
    assert mlflow_run_url("https://mlflow.example/", "3", "abc") == "https://mlflow.example/#/experiments/3/runs/abc"
    assert mlflow_run_url(f"sqlite:///{tmp_path}/mlflow.db", "3", "abc") is None
    assert mlflow_run_url(str(tmp_path / "mlruns"), "3", "abc") is None
    assert markdown_link("s3://b/k", "http://minio:9000/b/k") == "[s3://b/k](http://minio:9000/b/k)"
    assert markdown_link("/runs/a/m.json", None) == "`/runs/a/m.json`"


@pytest.fixture
def published(monkeypatch) -> dict[str, tuple[str, dict]]:
    """The artifacts `publish` creates, by key: (kind, what it was given), instead of a Prefect server's."""
    found: dict[str, tuple[str, dict]] = {}
    for kind in ("markdown", "link", "image", "table"):
        monkeypatch.setattr(artifacts, f"create_{kind}_artifact",
                            lambda kind=kind, **given: found.__setitem__(given["key"], (kind, given)))
    return found


def _train_manifest(tmp_path, output: str) -> Manifest:
    (tmp_path / "reward_curve.png").write_bytes(b"\x89PNG not really")
    return Manifest(stage="train", outputs={"checkpoint": f"{output}/checkpoints/iter_0000003",
                                            "reward_curve": str(tmp_path / "reward_curve.png")})


def test_a_local_run_publishes_its_paths_as_text_and_no_file_link(tmp_path, published):
    manifest_path = str(tmp_path / "manifests" / "train.json")
    tracker = SimpleNamespace(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment_id="1")
    artifacts.publish("train", _train_manifest(tmp_path, str(tmp_path)), manifest_path, Storage(S3Config()),
                      tracker, "abc")
    assert published["slimeflow-train-manifest"] == ("markdown", {
        "key": "slimeflow-train-manifest", "markdown": f"`{manifest_path}`",
        "description": "the train stage's manifest, on the worker's disk"})
    assert "slimeflow-train-mlflow" not in published  # a sqlite store: no UI serves the run
    summary = published["slimeflow-train"][1]["markdown"]
    assert f"manifest: `{manifest_path}`" in summary and f"MLflow run: `abc` in `{tracker.tracking_uri}`" in summary
    assert published["slimeflow-train-reward-curve"][0] == "image"
    assert not [key for key, (_, given) in published.items() if "file://" in str(given)]


def test_a_run_on_a_served_store_and_tracking_server_links_the_object_and_the_mlflow_runs_page(tmp_path, published):
    uri = "s3://bucket/runs/a/manifests/train.json"
    tracker = SimpleNamespace(tracking_uri="http://mlflow:5000", experiment_id="7")
    s3 = S3Config(endpoint_url="http://127.0.0.1:9000")
    artifacts.publish("train", _train_manifest(tmp_path, "s3://bucket/runs/a"), uri, Storage(S3Config()), tracker,
                      "abc", s3)
    object_url, run_page = "http://127.0.0.1:9000/bucket/runs/a/manifests/train.json", \
        "http://mlflow:5000/#/experiments/7/runs/abc"
    assert published["slimeflow-train-manifest"][0] == "link"
    assert published["slimeflow-train-manifest"][1]["link"] == object_url
    assert published["slimeflow-train-mlflow"][1]["link"] == run_page
    summary = published["slimeflow-train"][1]["markdown"]
    assert f"manifest: [{uri}]({object_url})" in summary and f"MLflow run: [abc]({run_page})" in summary


def test_a_local_curve_too_large_to_inline_is_named_as_text(tmp_path, published, monkeypatch):
    monkeypatch.setattr(artifacts, "MAX_INLINE_IMAGE", 4)
    tracker = SimpleNamespace(tracking_uri="http://mlflow:5000", experiment_id="7")
    manifest = _train_manifest(tmp_path, str(tmp_path))
    artifacts.publish("train", manifest, str(tmp_path / "m.json"), Storage(S3Config()), tracker, "abc")
    curve = manifest.outputs["reward_curve"]
    kind, given = published["slimeflow-train-reward-curve"]
    assert (kind, given["markdown"]) == ("markdown", f"reward curve: `{curve}` (too large to inline)")
