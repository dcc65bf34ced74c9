"""Prefect: prefect.yaml's deployments import by module path with default parameters the server accepts (the
pipeline under Prefect: tests/e2e/test_train_e2e.py, tests/integration/test_flows_under_prefect.py; both deploy
commands against a real server: tests/e2e/test_prefect_server.py)."""

from __future__ import annotations

import pytest

from slimeflow.config.pipeline import STAGE_CONFIGS, PipelineConfig, RunSettings
from slimeflow.deployments.definitions import canonical, load


@pytest.fixture(scope="module")
def deployments() -> list[dict]:
    return load()[0]


def test_each_deployment_loads_by_module_path_and_its_parameters_pass_the_servers_schema(deployments):
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    for deployment in deployments:
        flow = load_flow_from_entrypoint(deployment["entrypoint"])  # what a worker imports
        schema = parameter_schema(flow.fn).model_dump()
        assert "config" in schema["properties"], (deployment["name"], schema)
        assert schema["definitions"], "the config models should appear in the schema"
        # The server's own check (enforce_parameter_schema): the YAML shorthand `hf_checkpoint` at the top of
        # a pipeline config passes the flow's pydantic validation but not this.
        validate(deployment["parameters"], schema, raise_on_error=True)
        assert flow.validate_parameters(deployment["parameters"])["config"] is not None


def test_the_default_parameters_are_valid_configs_in_their_canonical_form(deployments):
    """What the UI's form shows is what the config models make of it: no key they would rename or drop."""
    for deployment in deployments:
        parameters = deployment["parameters"]
        model = PipelineConfig if deployment["name"] == "pipeline" else STAGE_CONFIGS[deployment["name"]]
        assert canonical(model.model_validate(parameters["config"])) == parameters["config"], deployment["name"]
        if "settings" in parameters:
            assert canonical(RunSettings.model_validate(parameters["settings"])) == parameters["settings"]


def test_a_deployment_per_available_stage_and_the_pipeline_on_one_pool(deployments):
    from slimeflow import stages

    assert [d["name"] for d in deployments] == ["pipeline", *stages.available()]
    assert {d["work_pool"]["name"] for d in deployments} == {"slimeflow"}
    assert [d["name"] for d in deployments if d.get("schedules")] == ["pipeline"], "an example cron schedule"
    for deployment in deployments:
        entrypoint = deployment["entrypoint"]
        assert ":" not in entrypoint and entrypoint.startswith("slimeflow.flows."), "a module path: any install runs it"


def test_deploy_options_become_what_prefect_deploy_reads(deployments, tmp_path):
    """--pool and --working-dir as `prefect deploy --pool` and a set_working_directory pull step give them; a
    prefect.yaml that declares its own pull steps keeps them, and --working-dir is refused there."""
    from slimeflow.deployments.deploy import SET_WORKING_DIRECTORY, DeployError, prepare

    actions = {"build": [], "push": [], "pull": None}
    assert prepare(deployments, actions, None, None) == deployments  # as declared: Prefect's defaults apply
    [train] = prepare([d for d in deployments if d["name"] == "train"], actions, "gpu-pool", tmp_path / ".")
    assert train["work_pool"]["name"] == "gpu-pool"
    assert train["pull"] == [{SET_WORKING_DIRECTORY: {"directory": str(tmp_path)}}]
    assert {d["work_pool"]["name"] for d in deployments} == {"slimeflow"}, "the loaded declaration is left as it was"
    with pytest.raises(DeployError, match="declares pull steps for 'pipeline'"):
        prepare(deployments[:1], {**actions, "pull": [{SET_WORKING_DIRECTORY: {"directory": "/srv"}}]}, None, tmp_path)
