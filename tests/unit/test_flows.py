"""Prefect: every deployment imports with a parameter schema the server accepts (the pipeline under Prefect:
tests/e2e/test_train_e2e.py, tests/integration/test_flows_under_prefect.py)."""

from __future__ import annotations

import pytest


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
