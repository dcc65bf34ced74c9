"""Run the pipeline flow against the configured Prefect API (or an ephemeral local server)."""

from __future__ import annotations

from slimeflow.config.pipeline import PipelineConfig


def run_pipeline(config: PipelineConfig) -> dict[str, dict]:
    """Call the pipeline flow, pointing Prefect at `config.infra.prefect_api_url` when it is set.

    Without one, Prefect starts an ephemeral server; its first-start telemetry write races the SQLite
    migrations ("database is locked" tracebacks on a fresh PREFECT_HOME), so analytics are off for it.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings

    from slimeflow.flows.pipeline import pipeline_flow

    api = config.infra.prefect_api_url
    updates = {PREFECT_API_URL: api} if api else {PREFECT_SERVER_ANALYTICS_ENABLED: False}
    with temporary_settings(updates=updates):
        return pipeline_flow(config)
