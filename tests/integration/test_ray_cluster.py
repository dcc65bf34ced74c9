"""A Ray cluster as slime's users start one (issue 23, item 3): `ray start --head` and a second raylet joined with
`ray start --address`, on this host, one logical GPU each. The train stage runs on it twice: from this process
through the Prefect flow with --ray-address, and as a Ray job (`ray job submit` to the dashboard's Jobs API on
loopback), where the stage joins the job's cluster by the RAY_ADDRESS Ray sets. Each time the trainer and the engine
land on different nodes (Ray's state API says where each actor ran) and the checkpoint goes to a local path both
nodes see.

The cluster is this module's alone: its own temp dir and ports, token authentication off (Ray 2.60 turns it on
for `ray start` wherever ~/.ray/auth_token exists, and a driver given an address does not read that file); it is
stopped by pid, every process that names its temp dir and their children, never by `ray stop`, which stops every
Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import yaml
from conftest import _free_port

pytestmark = pytest.mark.slow

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
START_S = 180
JOB_S = 300
# Two one-GPU nodes: one trainer rank and one engine fill them, and PACK must put them on different nodes.
PLACEMENT = {"actor-num-gpus-per-node": 1, "rollout-num-gpus": 1, "num-gpus-per-node": 1}
TRAIN = {"num-rollout": 2, "rollout-batch-size": 2, "n-samples-per-prompt": 2, "eval-interval": None,
         "save-interval": None, **PLACEMENT}


@dataclass
class LocalCluster:
    """A head and a worker raylet started by `ray start`, everything they write under `root`."""

    root: Path
    gcs_address: str
    dashboard_url: str
    env: dict[str, str]

    def ray(self, *args: str, timeout: float = START_S) -> subprocess.CompletedProcess:
        done = subprocess.run([*RAY, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"ray {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def processes(self) -> list:
        """Every process of this cluster: those that name its temp dir, and their children (workers' engines)."""
        import psutil

        mine = []
        for proc in psutil.process_iter(["cmdline"]):
            if any(f"{self.root}/" in part for part in proc.info["cmdline"] or ()):
                mine.append(proc)
        found = {p.pid: p for p in mine}
        for proc in mine:
            with contextlib.suppress(psutil.NoSuchProcess):
                found.update({c.pid: c for c in proc.children(recursive=True)})
        return list(found.values())

    def stop(self) -> list[int]:
        """SIGTERM, then SIGKILL after 5 s; returns the pids still alive after both (none expected). The GCS server
        and one of the head's Python daemons outlive a SIGTERM by more than 15 s here, and nothing needs to last."""
        import psutil

        alive = self.processes()
        for signal_them, grace_s in (("terminate", 5), ("kill", 10)):
            for proc in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    getattr(proc, signal_them)()
            _, alive = psutil.wait_procs(alive, timeout=grace_s)
        return [p.pid for p in alive]


def start_cluster(root: Path) -> LocalCluster:
    gcs_port, dashboard_port = _free_port(), _free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0",
           # a user's nodes have slimeflow on PATH; here it is this interpreter's environment
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cluster = LocalCluster(root, f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dashboard_port}", env)
    node = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", "1",
            "--object-store-memory", str(100 * 1024 * 1024), "--disable-usage-stats"]
    cluster.ray("start", "--head", "--port", str(gcs_port), "--dashboard-host", "127.0.0.1",
                "--dashboard-port", str(dashboard_port), "--ray-client-server-port", str(_free_port()),
                "--dashboard-agent-listen-port", str(_free_port()), "--temp-dir", str(root / "head"), *node)
    cluster.ray("start", "--address", cluster.gcs_address, "--dashboard-agent-listen-port", str(_free_port()),
                "--temp-dir", str(root / "worker"), *node)
    return cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    ray.shutdown()  # a local Ray another test started
    root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    started = None
    try:
        started = start_cluster(root)
        yield started
    finally:
        ray.shutdown()
        left = (started or LocalCluster(root, "", "", {})).stop()
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes of the test cluster still alive: {left}"


@pytest.fixture(scope="module")
def train_inputs(tmp_path_factory) -> dict:
    """The tiny model and the demo's prompt data, prepared once for both runs."""
    from train_helpers import train_section

    return train_section(tmp_path_factory.mktemp("inputs"), **TRAIN)


@pytest.fixture(scope="module")
def shared_mlflow(tmp_path_factory) -> str:
    """One MLflow database for both runs (a new one costs its schema migrations each time)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def node_roles(address: str) -> dict[str, str]:
    """{node id: "head" or "worker"} of the live nodes."""
    from ray.util.state import list_nodes

    nodes = list_nodes(address=address, filters=[("state", "=", "ALIVE")], detail=True)
    return {n.node_id: "head" if n.is_head_node else "worker" for n in nodes}


def actor_nodes(address: str, job_id: str) -> dict[str, list[str]]:
    """{actor class: [node id, ...]} of job `job_id`'s actors, dead ones included (Ray's state API)."""
    from ray.util.state import list_actors

    where: dict[str, list[str]] = {}
    for actor in list_actors(address=address, filters=[("job_id", "=", job_id)], detail=True, limit=1000):
        where.setdefault(actor.class_name, []).append(actor.node_id)
    return where


def assert_spread(where: dict[str, list[str]], roles: dict[str, str]) -> None:
    """One trainer and one engine, on the cluster's two different nodes."""
    [trainer], [engine] = where["TrainActor"], where["EngineActor"]
    assert {trainer, engine} == set(roles), (where, roles)


def assert_trained(manifest: dict, save: Path) -> None:
    assert manifest["counts"]["rollouts_run"] == 2
    assert manifest["outputs"]["checkpoint"] == str(save / "iter_0000001")
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


FLOW = """
import json, sys
import ray
from slimeflow.config.pipeline import load_pipeline_config
from slimeflow.flows.runner import run_pipeline
run_pipeline(load_pipeline_config(json.loads(sys.argv[1]), sys.argv[2:], {}, only_stage="train"))
print(ray.get_runtime_context().get_job_id())
"""
"""The train flow as a driver of its own (a fresh interpreter, as a user's process is: within pytest's, which earlier
tests joined to and left other Ray clusters, the rollout manager's creation was cancelled in full-suite runs)."""


def test_the_train_flow_runs_on_a_two_node_cluster_by_ray_address(cluster, train_inputs, prefect_harness, tmp_path,
                                                                   shared_mlflow):
    from prefect.settings import PREFECT_API_URL

    save = tmp_path / "checkpoints"
    data = {"name": "cluster", "workdir": str(tmp_path), "train": train_inputs}
    flags = ["--ray-address", cluster.gcs_address, "--save", str(save), "--mlflow-tracking-uri", shared_mlflow]
    driver = subprocess.run([sys.executable, "-c", FLOW, json.dumps(data), *flags], capture_output=True, text=True,
                            env={**cluster.env, "PREFECT_API_URL": PREFECT_API_URL.value()}, timeout=JOB_S)
    assert driver.returncode == 0, (driver.stdout[-2000:], driver.stderr[-4000:])
    manifest = json.loads((tmp_path / "manifests" / "train.json").read_text())
    assert_trained(manifest, save)
    assert_spread(actor_nodes(cluster.gcs_address, driver.stdout.split()[-1]), node_roles(cluster.gcs_address))


def test_ray_job_submit_runs_the_train_stage_on_the_jobs_cluster(cluster, train_inputs, prefect_harness, tmp_path,
                                                                  shared_mlflow):
    """`ray job submit -- slimeflow train train.yaml`: no address given, the stage joins the cluster the job runs
    on (RAY_ADDRESS, set by Ray in the job's environment). The job's flows report to this session's Prefect server
    (as slime's scripts pass environment, by --runtime-env-json), so that it starts no server of its own."""
    from prefect.settings import PREFECT_API_URL
    from ray.job_submission import JobStatus, JobSubmissionClient

    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"train": train_inputs}))
    save, submission = tmp_path / "checkpoints", f"slimeflow-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    submitted = subprocess.run(
        [*RAY, "job", "submit", "--address", cluster.dashboard_url, "--submission-id", submission,
         "--runtime-env-json", json.dumps({"env_vars": {"PREFECT_API_URL": PREFECT_API_URL.value()}}), "--",
         "slimeflow", "train", str(tmp_path / "train.yaml"), "--name", "job", "--workdir", str(tmp_path),
         "--save", str(save), "--mlflow-tracking-uri", shared_mlflow],
        env=cluster.env, capture_output=True, text=True, timeout=JOB_S)
    client = JobSubmissionClient(cluster.dashboard_url)
    info = client.get_job_info(submission)
    assert submitted.returncode == 0 and info.status == JobStatus.SUCCEEDED, (
        f"job {info.status} after {time.monotonic() - started:.0f} s:\n{client.get_job_logs(submission)[-4000:]}")
    manifest = json.loads((tmp_path / "manifests" / "train.json").read_text())
    assert_trained(manifest, save)
    assert_spread(actor_nodes(cluster.gcs_address, info.job_id), node_roles(cluster.gcs_address))
