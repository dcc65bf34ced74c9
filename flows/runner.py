"""Run the pipeline flow against the configured Prefect API, else an ephemeral local server that dies with the run."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import httpx
from prefect.logging.handlers import APILogWorker
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    get_current_settings,
    temporary_settings,
)

from slimeflow.config.pipeline import PipelineConfig
from slimeflow.engine.launch import free_port
from slimeflow.supervise import dies_with_this_process, exit_description

EPHEMERAL_STARTUP_TIMEOUT_S = 180
"""How long the ephemeral Prefect server may take to start (its SQLite migrations crawl on a loaded machine)."""
_STOP_GRACE_S = 5

logger = logging.getLogger("slimeflow.flows.runner")


def run_pipeline(config: PipelineConfig) -> dict[str, dict]:
    """Call the pipeline flow, pointing Prefect at `config.infra.prefect_api_url` when it is set.

    Without one (and no PREFECT_API_URL in Prefect's settings), the run starts Prefect's ephemeral server itself
    (ephemeral_server) rather than letting Prefect start it: Prefect's is a plain child, stopped only at the
    interpreter's exit, which a SIGTERM or SIGKILL to the driver skips, leaving the server running. Its first-start
    telemetry write races the SQLite migrations ("database is locked" tracebacks on a fresh PREFECT_HOME), so
    analytics are off for it; and it is given EPHEMERAL_STARTUP_TIMEOUT_S to come up (Prefect's 20 s default fails
    a run on a busy machine) unless the user set PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.
    """
    from slimeflow.flows.pipeline import pipeline_flow

    api = config.infra.prefect_api_url
    updates = {PREFECT_API_URL: api} if api else {PREFECT_SERVER_ANALYTICS_ENABLED: False}
    if not api and PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.name not in os.environ:
        updates[PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS] = EPHEMERAL_STARTUP_TIMEOUT_S
    with temporary_settings(updates=updates):
        own = PREFECT_API_URL.value() is None
        with ephemeral_server(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()) if own else nullcontext():
            return pipeline_flow(config)


@contextmanager
def ephemeral_server(timeout_s: float) -> Iterator[str]:
    """Prefect's ephemeral API server (what Prefect starts when no API is set) as a child that dies with this
    process (supervise.die_with_parent: a SIGKILLed driver takes it along), pointed at by PREFECT_API_URL while the
    body runs, stopped when it ends. Yields the API URL."""
    url = f"http://127.0.0.1:{free_port()}/api"
    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    command = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
               "--host", "127.0.0.1", "--port", url.split(":")[2].split("/")[0], "--log-level", "error",
               "--lifespan", "on"]
    logger.info("starting Prefect's ephemeral server on %s (it stops with this run)", url)
    server = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, preexec_fn=dies_with_this_process())
    try:
        _wait_healthy(server, url, timeout_s)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
            # The run's last log lines reach the server before it stops ("Error logging to API" otherwise).
            APILogWorker.drain_all(timeout=_STOP_GRACE_S, at_exit=False)
    finally:
        server.terminate()
        try:
            server.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_healthy(server: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"Prefect's ephemeral server at {url} {exit_description(server.returncode)} "
                                   "while starting (its output is above); set PREFECT_API_URL to use a running "
                                   "server instead")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prefect's ephemeral server at {url} did not answer within {timeout_s} s; raise "
                                   f"{PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.name} on a busy machine, or "
                                   "set PREFECT_API_URL to use a running server")
            time.sleep(0.1)
