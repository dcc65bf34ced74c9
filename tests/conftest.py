"""Session-wide fixtures: one Prefect harness, a moto S3 server on loopback, MLflow in a temporary sqlite file.

PREFECT_HOME must point at a temporary directory before prefect is imported anywhere, so it is set here, at
collection time, not inside a fixture.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from pathlib import Path

import pytest

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="slimeflow-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect-home")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# Tests never reach a model hub: everything they load is built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

S3_KEY = "testing-key"
S3_SECRET = "testing-secret"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (the first flow run pays for start-up and migrations)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def moto_server():
    """A real S3-protocol server on loopback (moto's ThreadedMotoServer), as s3fs's own tests use."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_config(moto_server):
    """S3 settings pointing at the moto server; credentials are passed explicitly, never via the environment."""
    from slimeflow.io.storage import S3Config

    return S3Config(endpoint_url=moto_server, access_key_id=S3_KEY, secret_access_key=S3_SECRET, region="us-east-1")


@pytest.fixture
def s3_bucket(s3_config):
    """A fresh, empty bucket on the moto server; yields its s3:// URI."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key=S3_KEY,
        secret=S3_SECRET,
        client_kwargs={"endpoint_url": s3_config.endpoint_url},
        skip_instance_cache=True,
    )
    name = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return f"s3://{name}"


@pytest.fixture
def mlflow_uri(tmp_path):
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture(scope="session")
def session_tmp() -> Path:
    return _SESSION_TMP


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """A one-rank gloo process group with megatron-core's model-parallel state (TP=PP=1), for one module."""
    import torch
    from megatron.core import parallel_state

    store = tmp_path_factory.mktemp("world") / "rendezvous"
    torch.distributed.init_process_group("gloo", init_method=store.as_uri(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
