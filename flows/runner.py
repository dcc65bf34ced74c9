"""Run the pipeline flow against the configured Prefect API (or an ephemeral local server)."""

from __future__ import annotations

from slimeflow.config.pipeline import PipelineConfig

EPHEMERAL_STARTUP_TIMEOUT_S = 180
"""How long the ephemeral Prefect server may take to start (its SQLite migrations crawl on a loaded machine)."""


def run_pipeline(config: PipelineConfig) -> dict[str, dict]:
    """Call the pipeline flow, pointing Prefect at `config.infra.prefect_api_url` when it is set.

    Without one, Prefect starts an ephemeral server; its first-start telemetry write races the SQLite
    migrations ("database is locked" tracebacks on a fresh PREFECT_HOME), so analytics are off for it; and it
    is given EPHEMERAL_STARTUP_TIMEOUT_S to come up (Prefect's 20 s default fails a run on a busy machine with
    "Timed out while attempting to connect to ephemeral Prefect API server") unless the user set
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.
    """
    import os

    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    from slimeflow.flows.pipeline import pipeline_flow

    api = config.infra.prefect_api_url
    updates = {PREFECT_API_URL: api} if api else {PREFECT_SERVER_ANALYTICS_ENABLED: False}
    if not api and PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.name not in os.environ:
        updates[PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS] = EPHEMERAL_STARTUP_TIMEOUT_S
    with temporary_settings(updates=updates):
        return pipeline_flow(config)
