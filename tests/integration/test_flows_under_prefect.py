"""The pipeline flow under Prefect writing its manifests to S3 (the deployments' schemas are in
tests/unit/test_flows.py; the pipeline's run, its MLflow runs and a rerun in tests/e2e/test_train_e2e.py)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import S3_KEY, S3_SECRET

from slimeflow.config.pipeline import load_pipeline_config
from slimeflow.errors import ConfigError, StorageError
from slimeflow.io.storage import S3Config, Storage


def _no_keys_in_this_process(monkeypatch, tmp_path) -> None:
    """No AWS keys from botocore's sources: the environment, shared files, instance metadata."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _stored_parameters() -> list[str]:
    """The parameters of every flow run the server holds, as JSON."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return [json.dumps(run.parameters) for run in client.read_flow_runs(limit=200)]


@pytest.mark.slow
def test_pipeline_reaches_s3_with_keys_from_a_secret_block_never_its_parameters(
        prefect_harness, monkeypatch, tmp_path, mlflow_uri, s3_bucket, s3_config):
    """The keys from the Secret block the config names; from the worker's environment: tests/e2e/test_prefect_server.py."""
    from prefect.blocks.system import Secret

    from slimeflow.flows.runner import run_pipeline

    _no_keys_in_this_process(monkeypatch, tmp_path)
    # The premise: without the block's keys, nothing reaches the store.
    with pytest.raises(StorageError, match="no S3 credentials found"):
        Storage(S3Config(endpoint_url=s3_config.endpoint_url)).write_text(f"{s3_bucket}/probe", "x")
    Secret(value={"access_key_id": S3_KEY, "secret_access_key": S3_SECRET}).save("s3-test", overwrite=True)
    infra = {"mlflow_tracking_uri": mlflow_uri, "s3_endpoint_url": s3_config.endpoint_url, "s3_region": "us-east-1",
             "s3_credentials_block": "s3-test"}
    output = f"{s3_bucket}/runs/s3run"
    config = load_pipeline_config({"name": "s3run", "hf_checkpoint": "tiny:llama", "workdir": str(tmp_path / "w"),
                                   "output": output, "infra": infra}, [], os.environ)
    model = run_pipeline(config)["model"]
    stored = json.loads(Storage(s3_config).read_text(f"{output}/manifests/model.json"))
    assert stored["hashes"] == model["hashes"]
    parameters = _stored_parameters()
    assert sum(output in p for p in parameters) >= 2, "the pipeline's run and its model stage's"
    assert not [p for p in parameters if S3_SECRET in p or S3_KEY in p], "a credential in a flow run's parameters"


@pytest.mark.slow
def test_a_missing_secret_block_is_named_with_how_to_create_it(prefect_harness, tmp_path, s3_bucket, s3_config):
    from slimeflow.flows.runner import run_pipeline

    config = load_pipeline_config({"name": "noblock", "hf_checkpoint": "tiny:llama", "workdir": str(tmp_path),
                                   "output": f"{s3_bucket}/runs/x",
                                   "infra": {"s3_endpoint_url": s3_config.endpoint_url,
                                             "s3_credentials_block": "no-such-block"}})
    with pytest.raises(ConfigError, match="infra.s3_credentials_block 'no-such-block': no Secret block") as err:
        run_pipeline(config)
    assert "Secret(value={'access_key_id'" in str(err.value)


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
