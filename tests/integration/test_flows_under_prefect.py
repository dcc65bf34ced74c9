"""The pipeline flow under Prefect writing its manifests to S3 (the deployments' schemas are in
tests/unit/test_flows.py; the pipeline's run, its MLflow runs and a rerun in tests/e2e/test_train_e2e.py)."""

from __future__ import annotations

import json

import pytest

from slimeflow.config.pipeline import load_pipeline_config
from slimeflow.io.storage import Storage


@pytest.mark.slow
def test_pipeline_writes_its_manifests_to_s3(prefect_harness, tmp_path, mlflow_uri, s3_bucket, s3_config):
    from slimeflow.flows.runner import run_pipeline

    infra = {"mlflow_tracking_uri": mlflow_uri, "s3_endpoint_url": s3_config.endpoint_url,
             "s3_access_key_id": s3_config.access_key_id,
             "s3_secret_access_key": s3_config.secret_access_key.get_secret_value(), "s3_region": "us-east-1"}
    config = load_pipeline_config({"name": "s3run", "hf_checkpoint": "tiny:llama", "workdir": str(tmp_path),
                                   "output": f"{s3_bucket}/runs/s3run", "infra": infra})
    model = run_pipeline(config)["model"]
    stored = json.loads(Storage(s3_config).read_text(f"{s3_bucket}/runs/s3run/manifests/model.json"))
    assert stored["hashes"] == model["hashes"]


@pytest.mark.parametrize("user_set", [None, "7"])
def test_the_ephemeral_server_gets_time_to_start_on_a_busy_machine_unless_the_user_says(monkeypatch, user_set):
    """Prefect's 20 s start-up limit for its ephemeral server failed `make demo` at load average 15; a user's own
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS is kept."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as timeout

    import slimeflow.flows.pipeline
    from slimeflow.flows import runner

    if user_set is None:
        monkeypatch.delenv(timeout.name, raising=False)
    else:
        monkeypatch.setenv(timeout.name, user_set)
    seen = []
    monkeypatch.setattr(slimeflow.flows.pipeline, "pipeline_flow", lambda config: seen.append(timeout.value()))
    runner.run_pipeline(load_pipeline_config({"name": "t", "hf_checkpoint": "tiny:qwen2"}))
    assert seen == [runner.EPHEMERAL_STARTUP_TIMEOUT_S if user_set is None else int(user_set)]
