"""Prefect: every deployment imports with a parameter schema the server accepts; the pipeline runs and logs to MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimeflow.config.pipeline import load_pipeline_config
from slimeflow.io.storage import ArtifactRecord, Storage


@pytest.fixture(scope="module")
def deployment_specs():
    from slimeflow.deployments.definitions import specs

    return specs()


def test_each_deployment_loads_by_module_path_and_its_parameters_pass_the_servers_schema(deployment_specs):
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    for spec in deployment_specs:
        entrypoint = f"{spec.flow.fn.__module__}.{spec.flow.fn.__name__}"  # what a worker imports
        flow = load_flow_from_entrypoint(entrypoint)
        schema = parameter_schema(flow.fn).model_dump()
        assert "config" in schema["properties"], (spec.name, schema)
        assert schema["definitions"], "the config models should appear in the schema"
        # The server's own check (enforce_parameter_schema): the YAML shorthand `hf_checkpoint` at the top of
        # a pipeline config passes the flow's pydantic validation but not this.
        validate(spec.parameters, schema, raise_on_error=True)
        assert flow.validate_parameters(spec.parameters)["config"] is not None


def test_a_deployment_per_available_stage_and_the_pipeline(deployment_specs):
    from slimeflow import stages

    assert {s.name for s in deployment_specs} == {"pipeline", *stages.available()}
    assert [s.cron for s in deployment_specs if s.cron], "an example cron schedule"


@pytest.mark.slow
def test_pipeline_flow_runs_under_prefect_and_logs_to_mlflow(prefect_harness, tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    from slimeflow.flows.runner import run_pipeline

    config = load_pipeline_config(
        {"name": "flowtest", "hf_checkpoint": "tiny:qwen2?seed=1", "workdir": str(tmp_path / "work"),
         "infra": {"mlflow_tracking_uri": mlflow_uri}}
    )
    manifests = run_pipeline(config)

    model = manifests["model"]
    checkpoint = Path(model["outputs"]["hf_checkpoint"])
    assert (checkpoint / "config.json").is_file()
    assert model["facts"]["model_type"] == "qwen2" and model["counts"]["parameters"] > 0
    manifest_uri = str(tmp_path / "work" / "manifests" / "model.json")
    on_disk = json.loads(Path(manifest_uri).read_text())
    assert on_disk["hashes"]["content"] == model["hashes"]["content"]
    for record in model["artifacts"]:  # every fingerprint verifies against the files
        Storage().read_bytes(str(checkpoint / record["path"]), expect=ArtifactRecord.model_validate(record))

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("flowtest")
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if r.info.run_name == "flowtest")
    stage = next(r for r in runs if r.info.run_name == "model")
    assert parent.info.status == stage.info.status == "FINISHED"
    assert stage.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert stage.data.params["model.hf_checkpoint"] == "tiny:qwen2?seed=1"
    assert stage.data.metrics["model.parameters"] == model["counts"]["parameters"]
    assert stage.data.tags["manifest_uri"] == manifest_uri


@pytest.mark.slow
def test_a_rerun_reuses_the_built_model_and_reports_the_same_content_hash(prefect_harness, tmp_path, mlflow_uri):
    from slimeflow.flows.runner import run_pipeline

    data = {"name": "rerun", "hf_checkpoint": "tiny:llama", "workdir": str(tmp_path),
            "infra": {"mlflow_tracking_uri": mlflow_uri}}
    first = run_pipeline(load_pipeline_config(data))["model"]
    second = run_pipeline(load_pipeline_config(data))["model"]
    assert first["hashes"]["content"] == second["hashes"]["content"]
    assert first["outputs"]["hf_checkpoint"] == second["outputs"]["hf_checkpoint"]


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
