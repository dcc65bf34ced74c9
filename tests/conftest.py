"""Session-wide fixtures: one Prefect harness, a moto S3 server on loopback, MLflow in a temporary sqlite file, one
local Ray, and the tiny models converted to torch_dist once.

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
from paths import DATA, ROOT, TESTS, TIERS

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


@pytest.fixture
def one_thread():
    """One torch thread: on a shared, loaded CPU two threads made each tiny step 10-20x slower (barrier waits)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


RAY_WORKER_PATHS = (*TIERS, TESTS, DATA / "slime_plugins", ROOT / "examples" / "search-r1")
"""What the session's Ray workers import from: test modules (a test's reward function) and the helpers they import,
slime-style plug-ins, the search-r1 example's plug-ins (as its run.sh's PYTHONPATH)."""


class _SessionRay:
    """The GCS address of the Ray this session started (None: none running)."""

    address: str | None = None


@pytest.fixture(scope="session", autouse=True)
def _rank_pool():
    """The session's Megatron worlds (megatron_steps.run_world) run in one reused set of spawned processes, stopped
    at the session's end. SLIMEFLOW_TESTS_FRESH_RANKS=1 gives every world fresh processes instead (to tell a state
    leak between worlds from a bug)."""
    from megatron_steps import use_rank_pool

    pool = use_rank_pool(not os.environ.get("SLIMEFLOW_TESTS_FRESH_RANKS"))
    yield pool
    use_rank_pool(False)


@pytest.fixture(scope="session")
def _session_ray():
    import ray

    yield _SessionRay
    if _SessionRay.address is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def local_ray(_session_ray):
    """One local Ray for the session's tests that run on Ray, started as the train stage starts it (init_ray: this
    machine's cores, the local system config) with workers that import RAY_WORKER_PATHS; the train stage and the
    conversion join it. Started by the first test that asks and shut down at the session's end. A module that needs
    a cluster of its own shape (two raylets, logical GPUs) shuts it down and starts its own; the next test that asks
    for this one starts it again (and replaces a Ray that is not it)."""
    import ray

    from slimeflow.cluster import init_ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address == _session_ray.address:
        yield
        return
    ray.shutdown()
    with pytest.MonkeyPatch.context() as patch:  # read by the raylet, whose workers inherit it
        patch.setenv("PYTHONPATH", os.pathsep.join([*map(str, RAY_WORKER_PATHS), os.environ.get("PYTHONPATH", "")]))
        init_ray(None)
    _session_ray.address = ray.get_runtime_context().gcs_address
    yield


@pytest.fixture
def slime_plugins_importable(monkeypatch, local_ray):
    """The slime-style plug-ins of tests/data/slime_plugins importable here and in local_ray's workers."""
    monkeypatch.syspath_prepend(str(DATA / "slime_plugins"))


@pytest.fixture(scope="session")
def tiny_torch_dist(tmp_path_factory):
    """`get(spec)`: the tiny HF model of `spec` and its torch_dist conversion ({"hf", "release"}), built and
    converted once per spec for the whole session. Read-only: a test that changes them copies them first."""
    from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, read_hf_source
    from slimeflow.families.tiny import build_tiny_model

    built: dict[object, dict[str, Path]] = {}

    def get(spec) -> dict[str, Path]:
        if spec not in built:
            tmp = tmp_path_factory.mktemp("tiny-torch-dist")
            hf = build_tiny_model(tmp / "hf", spec)
            staged, _ = convert_hf_to_torch_dist(read_hf_source(hf), tmp / "ckpt")
            staged.rename(tmp / "ckpt" / "release")
            built[spec] = {"hf": hf, "release": tmp / "ckpt" / "release"}
        return built[spec]

    return get


@pytest.fixture(scope="session")
def megatron_one_process(tiny_torch_dist, tmp_path_factory) -> dict:
    """The Megatron backend at TP1 PP1 in this process, two steps on the test rollout from the tiny Llama's
    checkpoint: the reference run that the parallel layouts are compared with, trained once for the session."""
    from megatron_steps import make_job, rollout_batch, train_job, two_step_config

    from slimeflow.families.tiny import TinyModelSpec

    model = tiny_torch_dist(TinyModelSpec(seed=7))
    batch = rollout_batch(model["hf"])
    job = make_job(tmp_path_factory.mktemp("megatron-one"), "one", model["hf"], model["release"], batch,
                   two_step_config())
    return {"batch": batch, **train_job(0, 1, job)}


LONGEST_FIRST = ("test_prefect_server.py", "test_family_matrix.py")
"""Modules of several minutes: under pytest-xdist they start first, so no worker is left alone with one at the end."""
TIER_ORDER = ("e2e", "integration", "unit")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`: a worker per core, a module to a worker), the longest modules and tiers go
    first and the short ones fill the gaps; run in one process, the order stays the tiers' (testpaths: the fastest
    first, so a broken unit fails the run in minutes). The Makefile passes --no-loadscope-reorder, without which
    xdist would order the modules by their number of tests instead."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def rank(item) -> tuple[int, int]:
        path = Path(str(item.fspath))
        tier = TIER_ORDER.index(path.parent.name) if path.parent.name in TIER_ORDER else len(TIER_ORDER)
        return (0 if path.name in LONGEST_FIRST else 1, tier)

    items.sort(key=rank)
