"""Run the pipeline flow against the configured Prefect API (or an ephemeral local server)."""

from __future__ import annotations

import contextlib

from slimeflow.config.pipeline import PipelineConfig


def run_pipeline(config: PipelineConfig) -> dict[str, dict]:
    """Call the pipeline flow, pointing Prefect at `config.infra.prefect_api_url` when it is set."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from slimeflow.flows.pipeline import pipeline_flow

    api = config.infra.prefect_api_url
    settings = temporary_settings(updates={PREFECT_API_URL: api}) if api else contextlib.nullcontext()
    with settings:
        return pipeline_flow(config)
