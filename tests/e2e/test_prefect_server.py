"""A real `prefect server start` and a process worker on loopback, driven through the API as the UI drives them.

The server and the worker run in process groups of their own, in a temporary PREFECT_HOME, and are stopped by
pid (the group is killed) at the end of the module; the teardown asserts that no process they started is left.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import S3_KEY, S3_SECRET
from paths import DATA, ROOT
from process_sessions import session_processes, wait_until_gone

PREFECT = [sys.executable, "-m", "prefect"]
SLIMEFLOW = [sys.executable, "-m", "slimeflow.cli"]
SERVER_START_S = 120
RUN_S = 240
POLL_S = 0.2
"""How often a wait asks the server again (a final state or a log line is seen this much late at most)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@dataclass
class Services:
    """The processes this module started (each the leader of its own process group) and every pid seen under them."""

    env: dict[str, str]
    logs: Path
    started: list[subprocess.Popen] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)

    def start(self, name: str, argv: list[str], cwd: Path) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - the child writes it until it is stopped
        process = subprocess.Popen(argv, cwd=cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        log.close()
        self.started.append(process)
        return process

    def remember_descendants(self) -> None:
        import psutil

        for process in self.started:
            try:
                self.seen |= {p.pid for p in psutil.Process(process.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass

    def stop(self, process: subprocess.Popen, grace_s: float = 10) -> None:
        """SIGTERM to the process's group, SIGKILL after `grace_s`; then any descendant that left the group."""
        import psutil

        self.remember_descendants()
        self.seen.add(process.pid)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)  # start_new_session: the group id is the leader's pid
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        for pid in self.seen:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass

    def leftovers(self) -> list[str]:
        import psutil

        alive = []
        for pid in sorted(self.seen):
            try:
                process = psutil.Process(pid)
                if process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(process.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        return alive


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> Iterator[Services]:
    """The processes of this module; at teardown every one is stopped by pid and none may be left."""
    home = tmp_path_factory.mktemp("prefect-server")
    env = {**os.environ, "PREFECT_HOME": str(home / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_LOGGING_LEVEL": "INFO", "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
           # A flow run's process and its Ray workers import the test plug-ins (outage_reward) from here.
           "PYTHONPATH": os.pathsep.join(filter(None, [str(DATA / "slime_plugins"), os.environ.get("PYTHONPATH")])),
           # The worker's S3 keys (moto's): a run reads them where it runs, never from its parameters.
           "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    env.pop("PREFECT_API_URL", None)
    found = Services(env, home)
    yield found
    for process in reversed(found.started):  # the worker before the server it talks to
        found.stop(process)
    assert not found.leftovers(), f"processes left after the harness stopped: {found.leftovers()}"


@pytest.fixture(scope="module")
def prefect_server(services: Services) -> Iterator[str]:
    """`prefect server start` on a free loopback port; yields its API URL once /api/health answers."""
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    # With its UI (the browser test's), told where the API is: it would otherwise send the browser to port 4200.
    services.env["PREFECT_UI_API_URL"] = url
    server = services.start("server", [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            services.logs)
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if server.poll() is not None:
            pytest.fail(f"prefect server exited with {server.returncode}:\n{_tail(services.logs / 'server.log')}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"prefect server not healthy after {SERVER_START_S} s:\n"
                        f"{_tail(services.logs / 'server.log')}")
        time.sleep(0.5)
    services.env["PREFECT_API_URL"] = url
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


def _deploy(services: Services, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*SLIMEFLOW, "deploy"], cwd=cwd, env=services.env, capture_output=True, text=True,
                          timeout=300)


def _deployments() -> dict[str, dict]:
    """Every deployment on the server, by name, as what a deploy sets: ids, schedules, pull steps, parameters."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        found = client.read_deployments()
    return {d.name: {
        "id": d.id, "entrypoint": d.entrypoint, "description": d.description, "tags": sorted(d.tags),
        "parameters": d.parameters, "work_pool": d.work_pool_name, "job_variables": d.job_variables,
        "pull_steps": d.pull_steps, "schema": d.parameter_openapi_schema,
        "schedules": sorted((s.slug, s.schedule.cron, s.schedule.timezone, s.active) for s in d.schedules),
        "concurrency": d.global_concurrency_limit and d.global_concurrency_limit.limit,
        "collision": d.concurrency_options and d.concurrency_options.collision_strategy,
    } for d in found}


@pytest.fixture(scope="module")
def deploy_cwd(tmp_path_factory) -> Path:
    """Where `slimeflow deploy` runs: not the checkout (and so the worker's working directory)."""
    return tmp_path_factory.mktemp("deploy-cwd")


@pytest.fixture(scope="module")
def first_deploy(prefect_server: str, services: Services, deploy_cwd: Path) -> subprocess.CompletedProcess:
    return _deploy(services, deploy_cwd)


def _start_worker(services: Services, cwd: Path, name: str = "worker") -> subprocess.Popen:
    return services.start(name, [*PREFECT, "worker", "start", "--pool", "slimeflow", "--type", "process"], cwd)


@pytest.fixture(scope="module")
def prefect_worker(first_deploy, services: Services, deploy_cwd: Path) -> subprocess.Popen:
    """A process worker polling the `slimeflow` pool (which the first deploy created) every second."""
    return _start_worker(services, deploy_cwd)


@dataclass
class Deploys:
    """`slimeflow deploy`, then `prefect deploy --all` from the checkout, then `slimeflow deploy` again (the last
    one while the worker starts: it runs no flow until asked), and the server's deployments after each."""

    results: list[subprocess.CompletedProcess]
    after: list[dict[str, dict]]


@pytest.fixture(scope="module")
def deployed(first_deploy, prefect_worker, services: Services, deploy_cwd: Path) -> Deploys:
    after = [_deployments()]
    results = [first_deploy]
    for argv, cwd in (([*PREFECT, "deploy", "--all"], ROOT), ([*SLIMEFLOW, "deploy"], deploy_cwd)):
        results.append(subprocess.run(argv, cwd=cwd, env=services.env, capture_output=True, text=True, timeout=300))
        after.append(_deployments())
    return Deploys(results, after)


@pytest.mark.slow
def test_slimeflow_deploy_and_prefect_deploy_all_make_the_same_deployments(deployed, services, deploy_cwd):
    from prefect import get_client

    from slimeflow import stages

    for attempt, result in enumerate(deployed.results, 1):
        assert result.returncode == 0, f"deploy #{attempt}:\n{result.stdout}\n{result.stderr}"
    assert "created work pool 'slimeflow'" in deployed.results[0].stdout
    assert "created work pool" not in deployed.results[2].stdout
    with get_client(sync_client=True) as client:
        # The filter endpoints that `prefect work-pool ls` / `prefect deployment ls` call, with limit: null
        # (refused with 422 by prefect 3.8.8's server under fastapi >= 0.151).
        assert [(p.name, p.type) for p in client.read_work_pools()] == [("slimeflow", "process")]
    first, from_checkout, again = deployed.after
    assert set(first) == {"pipeline", *stages.available()}
    pipeline = first["pipeline"]
    assert pipeline["entrypoint"] == "slimeflow.flows.pipeline.pipeline_flow"
    assert pipeline["schedules"] == [("daily", "0 3 * * *", "UTC", False)]
    assert first["train"]["concurrency"] == 1 and first["train"]["collision"] == "ENQUEUE"
    workdir = "prefect.deployments.steps.set_working_directory"
    assert {d["pull_steps"][0][workdir]["directory"] for d in first.values()} == {str(deploy_cwd.resolve())}
    # `prefect deploy --all` in the checkout: the same deployments (ids included), run in the checkout instead.
    assert {d["pull_steps"][0][workdir]["directory"] for d in from_checkout.values()} == {str(ROOT.resolve())}
    same = lambda found: {n: {k: v for k, v in d.items() if k != "pull_steps"} for n, d in found.items()}  # noqa: E731
    assert same(from_checkout) == same(first)
    assert again == first  # nothing changed, nothing doubled


def _run_pipeline(config: dict, services: Services):
    """Create a flow run of the pipeline deployment (the UI's "Run") and wait for a final state."""
    from prefect.deployments import run_deployment

    started = time.monotonic()
    run = run_deployment("slimeflow-pipeline/pipeline", parameters={"config": config}, timeout=RUN_S,
                         poll_interval=POLL_S)
    services.remember_descendants()
    assert run.state is not None and run.state.is_completed(), (
        f"flow run {run.name}: {run.state} after {time.monotonic() - started:.0f} s\n"
        f"worker log:\n{_tail(services.logs / 'worker.log', 60)}")
    return run


def _stage_logs(parent_id, expected: list[str], wait_s: float = 30) -> str:
    """The logs of a flow run and its subflows, once they hold every `expected` line (logs arrive in batches)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
            ids = [parent_id, *(r.id for r in runs)]
            logs = "\n".join(log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids))))
            if all(line in logs for line in expected) or time.monotonic() > deadline:
                return logs
            time.sleep(POLL_S)


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + 60)
def test_a_run_reaches_s3_with_the_workers_keys_and_none_is_stored_as_a_parameter(
        deployed, services, s3_bucket, s3_config, tmp_path):
    from prefect import get_client

    from slimeflow.io.storage import Storage

    output = f"{s3_bucket}/runs/worker-s3"
    run = _run_pipeline({"name": "worker-s3", "workdir": str(tmp_path / "run"), "output": output,
                         "model": {"hf_checkpoint": "tiny:llama?seed=0"},
                         "infra": {"s3_endpoint_url": s3_config.endpoint_url, "s3_region": "us-east-1"}}, services)
    assert Storage(s3_config).exists(f"{output}/manifests/model.json")
    with get_client(sync_client=True) as client:
        stored = [json.dumps(r.parameters) for r in client.read_flow_runs(limit=200)]
    assert sum(output in p for p in stored) == 2, "the pipeline's run and its model stage's"
    assert not [p for p in stored if S3_KEY in p or S3_SECRET in p], "a credential in a flow run's parameters"
    assert run.parameters["config"]["infra"] == {"s3_endpoint_url": s3_config.endpoint_url, "s3_region": "us-east-1"}


def test_deploy_without_a_server_says_how_to_start_one(capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from slimeflow.deployments.deploy import main

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main([]) == 1
    err = capsys.readouterr().err
    assert "PREFECT_API_URL is not set" in err and "prefect server start" in err


def test_deploy_to_an_unreachable_server_names_it(capsys):
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from slimeflow.deployments.deploy import main

    url = f"http://127.0.0.1:{_free_port()}/api"
    with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_CLIENT_MAX_RETRIES: 0}):
        assert main([]) == 1
    assert f"cannot reach the Prefect server at {url}" in capsys.readouterr().err


def test_deploy_refuses_an_unknown_deployment_and_lists_the_known_ones(capsys):
    from slimeflow.deployments.deploy import main

    with pytest.raises(SystemExit) as exit_:
        main(["pipelin"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown deployment 'pipelin'" in err and "pipeline, model, convert" in err


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + 120)
def test_the_pipelines_schedules_once_activated_create_runs_and_the_worker_runs_them(deployed, services):
    """The pipeline's declared daily schedule, switched on as the UI's toggle does, creates its coming runs at 03:00
    UTC (and switched off, takes them back); an hourly schedule added as the UI's "Add schedule" makes it creates
    runs of the pipeline's default parameters (the model stage), and the worker runs the first when it is due."""
    from datetime import UTC, datetime, timedelta

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.client.schemas.schedules import IntervalSchedule

    hour = timedelta(hours=1)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("slimeflow-pipeline/pipeline")

        def scheduled(count: int = 3):
            runs = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(
                deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id]))) if r.auto_scheduled]
            return sorted(runs, key=lambda r: r.expected_start_time) if len(runs) >= count else None

        [daily] = deployment.schedules
        client.update_deployment_schedule(deployment.id, daily.id, active=True)
        nightly = _wait_for("runs created by the daily schedule", scheduled, 60, services, poll_s=1)
        assert {(r.expected_start_time.hour, r.expected_start_time.minute) for r in nightly} == {(3, 0)}
        days = [b.expected_start_time - a.expected_start_time for a, b in itertools.pairwise(nightly)]
        assert days == [timedelta(days=1)] * (len(nightly) - 1)
        client.update_deployment_schedule(deployment.id, daily.id, active=False)  # its coming runs go with it
        _wait_for("the daily schedule's runs removed", lambda: scheduled(count=0) == [], 30, services, poll_s=0.5)

        # Far enough ahead that the scheduler (a loop every second here) creates the first run before it is due;
        # the worker starts the run's process when it is due within its prefetch window (10 s), so the process
        # starts while the anchor comes.
        anchor = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=8)
        [schedule] = client.create_deployment_schedules(
            deployment.id, [(IntervalSchedule(interval=hour, anchor_date=anchor), True)])
        runs = _wait_for("runs created by the interval schedule", scheduled, 60, services, poll_s=1)
        starts = [r.expected_start_time for r in runs]
        assert starts[:3] == [anchor, anchor + hour, anchor + 2 * hour]
        assert runs[0].parameters == deployment.parameters  # prefect.yaml's defaults
        state = _final_state(runs[0].id, services, timeout_s=RUN_S)
        assert state.is_completed(), state
        client.update_deployment_schedule(deployment.id, schedule.id, active=False)
        remaining = scheduled(count=0)
        assert [r.id for r in remaining] == [runs[0].id]
    name = deployment.parameters["config"]["name"]  # the worker ran it in its working directory, runs/<name>
    manifest = json.loads((Path(deployment.pull_steps[0]["prefect.deployments.steps.set_working_directory"][
        "directory"]) / "runs" / name / "manifests" / "model.json").read_text())
    assert manifest["stage"] == "model"


# --- a training pipeline on the worker: cancelled, a second run on its workdir, killed and retried, artifacts ---

TRAIN_S = 600
"""The bound on a training pipeline's waits: one takes ~60-120 s on an idle 2-core machine, and over 300 s at load 12-16."""


def _train_pipeline(workdir: Path, num_rollout: int) -> dict:
    """model -> preprocess -> train -> evaluate on the default tiny Llama and the demo's n+1 task, a checkpoint every
    second rollout, in the parameters' canonical form."""
    from slimeflow.config.pipeline import load_pipeline_config
    from slimeflow.deployments.definitions import canonical

    data = ROOT / "examples" / "data"
    return canonical(load_pipeline_config({
        "name": "orchestrated", "workdir": str(workdir), "hf_checkpoint": "tiny:llama?seed=0",
        "stages": ["model", "preprocess", "train", "evaluate"],
        "preprocess": {"input": [str(data / "increment-train.jsonl")],
                       "eval_input": {"increment": str(data / "increment-eval.jsonl")},
                       "input_key": "prompt", "label_key": "label"},
        "train": {"rollout-batch-size": 4, "n-samples-per-prompt": 2, "num-rollout": num_rollout,
                  "rollout-max-response-len": 1, "rm-type": "prefix_match", "lr": 1.0e-3, "save-interval": 2,
                  "eval-interval": 2, "eval-temperature": 0.0, "eval-max-response-len": 1},
        "evaluate": {"eval-temperature": 0.0, "eval-max-response-len": 1, "rm-type": "prefix_match"},
    }))


def _submit(config: dict):
    """Create a flow run of the pipeline deployment and return at once (the UI's "Run", not waiting)."""
    from prefect.deployments import run_deployment

    return run_deployment("slimeflow-pipeline/pipeline", parameters={"config": config}, timeout=0)


def _wait_for(what: str, check, timeout_s: float, services: Services, poll_s: float = 0.05):
    """Poll `check()` until it returns something truthy; fail naming `what` (with the worker's log) after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            logs = "\n".join(f"{log.name}:\n{_tail(log, 30)}" for log in sorted(services.logs.glob("worker*.log")))
            pytest.fail(f"{what}: not after {timeout_s} s\n{logs}")
        time.sleep(poll_s)


def _state(flow_run_id):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def _final_state(flow_run_id, services: Services, timeout_s: float = TRAIN_S):
    return _wait_for(f"flow run {flow_run_id} in a final state",
                     lambda: (state := _state(flow_run_id)) is not None and state.is_final() and state,
                     timeout_s, services, poll_s=0.5)


def _flow_run_process(flow_run_id, services: Services) -> int | None:
    """The pid of the process a worker started for `flow_run_id` (Prefect puts it in a session of its own)."""
    import psutil

    for worker in services.started:
        try:
            children = psutil.Process(worker.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for child in children:
            try:
                if child.environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id) and os.getsid(child.pid) == child.pid:
                    return child.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                continue
    return None


def _tracker(workdir: Path) -> int | None:
    path = workdir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.slow
@pytest.mark.timeout(2 * TRAIN_S)
def test_a_second_run_on_a_busy_workdir_is_refused_and_a_cancelled_run_leaves_no_process(
        deployed, services, tmp_path):
    workdir = tmp_path / "run"
    config = _train_pipeline(workdir, num_rollout=200)  # far more than the test lets it train
    first = _submit(config)
    _wait_for("the first run's first checkpoint", lambda: _tracker(workdir), TRAIN_S, services)
    sid = _flow_run_process(first.id, services)
    assert sid is not None, "the worker's process for the first run"

    # The same config on the same workdir, while the first trains: refused at once, naming the workdir and who holds it.
    second = _final_state(_submit(config).id, services)
    assert second.is_failed(), second
    message = second.message or ""
    assert f"work directory {workdir} is in use by another slimeflow run (pipeline run 'orchestrated'" in message
    assert "--workdir of its own" in message
    # ... and the first is untouched: still running, still checkpointing.
    reached = _tracker(workdir)
    assert _state(first.id).is_running()
    _wait_for("a checkpoint of the first run after the refusal", lambda: (_tracker(workdir) or 0) > reached,
              TRAIN_S, services)

    # Cancel as the UI's "Cancel" does; the worker stops the flow run's process group, and with it Ray's processes.
    from prefect import get_client
    from prefect.states import Cancelling

    services.remember_descendants()
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(first.id, Cancelling(), force=True)
    assert _final_state(first.id, services, timeout_s=120).is_cancelled()
    wait_until_gone(sid, timeout=60, poll=0.5)  # Ray's actors exit a second or more after their raylet


@pytest.mark.slow
@pytest.mark.timeout(3 * TRAIN_S + RUN_S)
def test_a_run_whose_worker_died_mid_train_resumes_from_its_checkpoint_when_retried(
        deployed, prefect_worker, services, deploy_cwd, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.states import AwaitingRetry, Crashed

    workdir = tmp_path / "run"
    # Four rollouts, checkpoints 1 and 3: killed after 1, the retried run trains 2 and 3 (more rollouts and saves
    # add seconds each, and check nothing new).
    num_rollout = 4
    config = _train_pipeline(workdir, num_rollout=num_rollout)
    run = _submit(config)
    _wait_for("the first checkpoint", lambda: _tracker(workdir), TRAIN_S, services)
    sid = _flow_run_process(run.id, services)
    # The worker's machine is lost: the worker's process group and the flow run's session (Prefect starts each flow
    # run in a session of its own: killing the worker alone would leave it training), every process at once.
    services.remember_descendants()
    os.killpg(prefect_worker.pid, signal.SIGKILL)
    for pid in session_processes(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    prefect_worker.wait(timeout=30)
    wait_until_gone(sid, timeout=60, poll=0.5)
    killed_at = _tracker(workdir)  # the checkpoint the kill left (one may have committed since it was seen)
    assert killed_at < num_rollout - 1, "killed after the last checkpoint: the test no longer tests a resume"

    # The server still sees the run Running. Marked Crashed (the UI's "Change state", or a zombie-run automation),
    # then retried as the UI's "Retry" does; a new worker picks it up.
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Crashed(message="worker lost"), force=True)
        client.set_flow_run_state(run.id, AwaitingRetry(message="Retry from the UI"), force=True)
    _start_worker(services, deploy_cwd, "worker-2")
    state = _final_state(run.id, services)
    assert state.is_completed(), f"{state}\n{_tail(services.logs / 'worker-2.log', 60)}"

    # Finished stages reused, training resumed after the checkpoint the kill left, each rollout on record once.
    reused = [f"{stage}: inputs, config and code unchanged; reusing" for stage in ("model", "preprocess")]
    logs = _stage_logs(run.id, reused)
    assert all(line in logs for line in reused), logs
    trained = json.loads((workdir / "manifests" / "train.json").read_text())
    assert trained["counts"]["start_rollout_id"] == killed_at + 1
    assert trained["counts"]["rollouts_run"] == num_rollout - (killed_at + 1)
    assert trained["outputs"]["checkpoint"].endswith(f"iter_{num_rollout - 1:07d}")
    lines = [json.loads(line) for line in (workdir / "train" / "rollouts.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "rollout/reward_mean" in r]
    # Each once, the resumed ones all there. The checkpointed rollout itself may lack its line: the loop reports a
    # rollout after its save, weight update and eval, and the kill can land between the save and the report.
    assert steps == sorted(set(steps)) and set(range(killed_at + 1, num_rollout)) <= set(steps) <= set(range(num_rollout)), \
        steps

    # What the stages published: links to their manifests, the reward curve, the eval scores.
    with get_client(sync_client=True) as client:
        subflows = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
        ids = [r.id for r in subflows if r.state is not None and r.state.is_completed()]
        artifacts = {a.key: a for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))}
    manifest = workdir / "manifests" / "train.json"
    # A path on the worker's disk, shown as text: a file:// link would open nothing on another machine.
    assert (artifacts["slimeflow-train-manifest"].type, artifacts["slimeflow-train-manifest"].data) == (
        "markdown", f"`{manifest}`")
    curve = artifacts["slimeflow-train-reward-curve"]
    assert curve.type == "image" and curve.data.startswith("data:image/png;base64,")
    assert base64.b64decode(curve.data.split(",", 1)[1]) == (workdir / "train" / "reward_curve.png").read_bytes()
    table = artifacts["slimeflow-evaluate-eval"]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    evaluated = json.loads((workdir / "manifests" / "evaluate.json").read_text())["metrics"]
    assert {(r["set"], r["metric"]): r["score"] for r in rows} == {
        tuple(key.split("/")[1:]): value for key, value in evaluated.items() if key.startswith("eval/")}
    assert ("increment", "avg_at_1") in {(r["set"], r["metric"]) for r in rows}

    # A rerun of the finished pipeline on the worker (the UI's "Run" again) reuses every stage and rewrites no
    # manifest (the worker's pipeline-and-rerun test, merged here: its stages were model, convert and preprocess).
    stages = ("model", "preprocess", "train", "evaluate")
    first = {stage: (workdir / "manifests" / f"{stage}.json").stat().st_mtime_ns for stage in stages}
    rerun = _run_pipeline(config, services)
    assert {stage: (workdir / "manifests" / f"{stage}.json").stat().st_mtime_ns for stage in stages} == first, (
        "a rerun with unchanged inputs rewrote a manifest")
    reused = [f"{stage}: inputs, config and code unchanged; reusing" for stage in stages]
    logs = _stage_logs(rerun.id, reused)
    assert all(line in logs for line in reused), logs


# --- the UI's reruns: "Retry" on a failed run, "Run" with changed parameters ---

RETRY_FROM_THE_UI = "Retry from the UI"
"""The message of the state the UI's Retry button sets: POST /flow_runs/<id>/set_state {type: SCHEDULED, name:
AwaitingRetry, message: "Retry from the UI"}, force false in the UI a browser opens by default (prefect/server/ui,
retryFlowRun), true in the V2 UI; unforced, the server's own rules must accept it."""


def _manifests(workdir: Path) -> dict[str, tuple[str, str]]:
    """(created_at, cache_key) of each stage's manifest: a reused stage keeps both, a rerun one gets new ones."""
    return {path.stem: (data["created_at"], data["cache_key"])
            for path in sorted((workdir / "manifests").glob("*.json")) if (data := json.loads(path.read_text()))}


def _subflow_states(parent_id) -> dict[str, list]:
    """Each stage's subflow runs under `parent_id`, oldest first (a retried pipeline keeps its first attempt's)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
        flows = {f.id: f.name for f in client.read_flows()}
    found: dict[str, list] = {}
    for run in sorted(runs, key=lambda r: r.created):
        found.setdefault(flows[run.flow_id].removeprefix("slimeflow-"), []).append(run.state)
    return found


@dataclass
class Retried:
    """A training pipeline that failed after its first checkpoint (its reward service down) and, the cause fixed,
    was retried as the UI's Retry does."""

    run_id: object
    workdir: Path
    config: dict
    failed: object
    failed_train: object
    checkpoint_at_failure: int | None
    before_retry: dict[str, tuple[str, str]]
    finished: object


def _wait_healthy(name: str, process: subprocess.Popen, url: str, services: Services) -> None:
    import httpx

    deadline = time.monotonic() + SERVER_START_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"{name} exited with {process.returncode}:\n{_tail(services.logs / f'{name}.log')}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{name} not healthy after {SERVER_START_S} s:\n{_tail(services.logs / f'{name}.log')}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def mlflow_server(services: Services) -> str:
    """`mlflow server` on a free loopback port (its UI is what the stages' MLflow links open); stopped with the
    module's other processes."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = services.start("mlflow", [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
                                        "--port", str(port), "--workers", "1",
                                        "--backend-store-uri", f"sqlite:///{services.logs / 'mlflow.db'}"],
                             services.logs)
    _wait_healthy("mlflow", process, f"{url}/health", services)
    return url


@pytest.fixture(scope="module")
def retried(deployed, services, mlflow_server, tmp_path_factory) -> Retried:
    from prefect import get_client
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import AwaitingRetry

    base = tmp_path_factory.mktemp("retried")
    workdir, outage = base / "run", base / "reward-service-down"
    outage.touch()
    custom = base / "reward.yaml"
    custom.write_text(f"reward_outage_marker: {outage}\n")
    config = _train_pipeline(workdir, num_rollout=4)
    config["train"]["reward"] = {**config["train"]["reward"], "rm_type": None,
                                 "custom_rm_path": "outage_reward.reward"}
    config["train"]["custom_config_path"] = str(custom)
    config["infra"] = {**(config.get("infra") or {}), "mlflow_tracking_uri": mlflow_server}
    run = _submit(config)
    failed = _final_state(run.id, services)
    failed_train = _subflow_states(run.id)["train"][-1]
    checkpoint = _tracker(workdir)
    before = _manifests(workdir)

    outage.unlink()  # the cause fixed: the reward service is back
    with get_client(sync_client=True) as client:
        retry = client.set_flow_run_state(run.id, AwaitingRetry(message=RETRY_FROM_THE_UI), force=False)
    assert retry.status == SetStateStatus.ACCEPT, retry.details
    finished = _final_state(run.id, services)
    services.remember_descendants()
    return Retried(run.id, workdir, config, failed, failed_train, checkpoint, before, finished)


@pytest.mark.slow
@pytest.mark.timeout(3 * TRAIN_S)
def test_retry_of_a_failed_run_reuses_every_finished_stage_and_resumes_training(retried, services):
    assert retried.failed.is_failed(), retried.failed
    assert retried.failed_train is not None and retried.failed_train.is_failed(), retried.failed_train
    assert "reward service down" in (retried.failed_train.message or ""), retried.failed_train.message
    # It failed after its first checkpoint (rollout 1 of 0..3), before train or evaluate wrote a manifest.
    assert retried.checkpoint_at_failure == 1
    assert set(retried.before_retry) == {"model", "preprocess"}

    assert retried.finished.is_completed(), f"{retried.finished}\n{_tail(services.logs / 'worker.log', 60)}"
    after = _manifests(retried.workdir)
    assert {stage: after[stage] for stage in retried.before_retry} == retried.before_retry  # not rewritten
    reused = [f"{stage}: inputs, config and code unchanged; reusing" for stage in ("model", "preprocess")]
    logs = _stage_logs(retried.run_id, reused)
    assert all(line in logs for line in reused), logs
    trained = json.loads((retried.workdir / "manifests" / "train.json").read_text())
    assert trained["counts"]["start_rollout_id"] == 2 and trained["counts"]["rollouts_run"] == 2
    assert trained["outputs"]["checkpoint"].endswith("iter_0000003")
    # The run page lists the first attempt's subflows beside the retry's: train failed once, then completed.
    subflows = {stage: [s.type.value for s in states] for stage, states in _subflow_states(retried.run_id).items()}
    assert set(subflows) == {"model", "preprocess", "train", "evaluate"}, subflows
    assert all(states[-1] == "COMPLETED" for states in subflows.values()) and subflows["train"][0] == "FAILED", subflows


@pytest.mark.slow
@pytest.mark.timeout(2 * TRAIN_S)
def test_a_run_with_changed_parameters_reruns_only_the_stages_whose_inputs_changed(retried, services):
    """The UI's "Run" with one evaluate parameter changed (create_flow_run_from_deployment with new parameters):
    model, preprocess and train are reused; evaluate, whose config changed, reruns."""
    import copy

    from prefect import get_client

    assert retried.finished.is_completed(), retried.finished
    before = _manifests(retried.workdir)
    changed = copy.deepcopy(retried.config)
    changed["evaluate"]["eval_max_response_len"] = 2
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("slimeflow-pipeline/pipeline")
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"config": changed})
    state = _final_state(run.id, services)
    assert state.is_completed(), f"{state}\n{_tail(services.logs / 'worker.log', 60)}"
    after = _manifests(retried.workdir)
    assert {s for s in after if after[s] == before[s]} == {"model", "preprocess", "train"}  # not rewritten
    assert after["evaluate"][1] != before["evaluate"][1] and after["evaluate"][0] >= before["evaluate"][0]
    reused = [f"{stage}: inputs, config and code unchanged; reusing" for stage in ("model", "preprocess", "train")]
    logs = _stage_logs(run.id, reused)
    assert all(line in logs for line in reused) and "evaluate: inputs, config and code unchanged" not in logs, logs
    evaluated = json.loads((retried.workdir / "manifests" / "evaluate.json").read_text())
    assert evaluated["config"]["eval_max_response_len"] == 2


# --- the UI in a real browser: headless Chromium from the system's packages, driven by Playwright ---

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
UI_WAIT_S = 60
"""The longest any page state is waited for (a page of the UI shows in a few seconds on a busy 2-core machine; the
bound leaves room for load averages of 20-50 that other work brings here)."""
SUBMIT_WAIT_S = 90
"""The longest the form's create_flow_run is waited on: the server holds a request up to 60 s on a locked SQLite
database (Prefect's PRAGMA busy_timeout) before it answers 503."""


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium from the system (apt-get install chromium, as .ci/run does); Playwright never downloads one
    here. Skipped, saying why, where there is none or SLIMEFLOW_SKIP_BROWSER_TEST is set (to spare its ~30 s)."""
    if os.environ.get("SLIMEFLOW_SKIP_BROWSER_TEST"):
        pytest.skip("the Prefect UI browser test is switched off by SLIMEFLOW_SKIP_BROWSER_TEST")
    if CHROMIUM is None:
        pytest.skip("no Chromium on PATH (chromium, chromium-browser or google-chrome): apt-get install -y chromium")
    # Ubuntu's apt chromium-browser is a stub for the snap, which a container cannot run: a browser that does not
    # start is a machine without one, not a failure of the UI.
    try:
        version = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"{CHROMIUM} does not run here ({err}): apt-get install -y chromium (Debian's, not a snap stub)")
    if version.returncode != 0:
        pytest.skip(f"{CHROMIUM} --version exited {version.returncode} ({(version.stdout + version.stderr).strip()[-200:]}):"
                    " apt-get install -y chromium (Debian's, not a snap stub)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


@dataclass
class Pages:
    """One browser page on the server's UI. Every wait is on a state of the page, bounded by UI_WAIT_S, and ends in
    a screenshot under `shots` (pytest's tmp dir: kept as the run's artifacts, never in the repository); a wait that
    times out fails naming what it waited for, the page's URL and the screenshot."""

    page: object
    ui: str
    shots: Path

    def show(self, path: str, shot: str, text: str, tab: str | None = None):
        """Open `path` (and click its `tab`), wait until `text` shows."""
        self.page.goto(f"{self.ui}{path}", timeout=UI_WAIT_S * 1000)
        if tab is not None:
            self.wait(f"the {tab!r} tab", shot, lambda ms: self.page.get_by_text(tab, exact=True).first.click(
                timeout=ms), keep=False)
        return self.wait(repr(text), shot, lambda ms: self.page.get_by_text(text).first.wait_for(timeout=ms))

    def wait(self, what: str, shot: str, until, keep: bool = True):
        """`until(timeout_ms)`, a Playwright wait; a screenshot after it (`keep`) or when it times out."""
        from playwright.sync_api import TimeoutError as PageTimeout

        picture = self.shots / f"{shot}.png"
        try:
            until(UI_WAIT_S * 1000)
        except PageTimeout:
            self.page.screenshot(path=str(picture), full_page=True)
            pytest.fail(f"{what} not shown after {UI_WAIT_S} s at {self.page.url}; screenshot: {picture}\n"
                        f"the page says: {self.page.inner_text('body')[-1500:]}")
        if keep:
            self.page.screenshot(path=str(picture), full_page=True)
        return self.page


@pytest.fixture
def pages(browser, prefect_server: str, tmp_path) -> Iterator[Pages]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    shots = tmp_path / "screenshots"
    shots.mkdir()
    yield Pages(context.new_page(), prefect_server.removesuffix("/api"), shots)
    context.close()
    print(f"screenshots of the Prefect UI: {shots}")


def _artifacts_of(flow_run_id) -> dict[str, object]:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return {a.key: a for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))}


@contextlib.contextmanager
def _workers_paused(services: Services) -> Iterator[None]:
    """The module's workers stopped (SIGSTOP to their process groups) for the block, then continued.

    The server creates a run from a deployment in a deferred SQLite transaction: it reads the deployment, validates
    the parameters against its (large, nested) schema, then writes. Any commit in between fails the write at once
    with SQLITE_BUSY_SNAPSHOT, answered 503; Prefect's client retries that, the UI does not. A worker polling every
    second (this module's PREFECT_WORKER_QUERY_SECONDS) commits on each poll (its queues and deployments marked
    ready), so on a loaded machine most of the form's Submits collided with one (503, 503, 201 in a run at load 10).
    The form's run needs no worker: it is cancelled before they poll again."""
    workers = [p for p in services.started if p.poll() is None and "worker" in p.args]
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGCONT)


def _click_submit(page) -> list:
    """The form's Submit, until the server creates the run (3 tries at most); each create_flow_run answer.

    A 503 (a locked SQLite database, see _workers_paused) shows "Oops. Something went wrong." and a person submits
    again, as this does (the click sent to the button itself: the toast can cover it)."""
    answers: list = []
    submit = page.get_by_role("button", name="Submit")
    for attempt in range(3):
        with page.expect_response(lambda r: r.url.endswith("/create_flow_run"), timeout=SUBMIT_WAIT_S * 1000) as sent:
            if attempt == 0:
                submit.click()
            else:
                submit.dispatch_event("click")
        answers.append(sent.value)
        if sent.value.ok:
            break
    return answers


def _submit_the_form(pages: Pages, deployment, services: Services):
    """On the pipeline's parameter form: the nested config renders; a changed name starts a run by the form's own
    Submit, whose page then shows it. The run is cancelled at once, as the UI's Cancel does (it
    only has to exist: the worker's runs are the other tests'); returns it."""
    from prefect import get_client
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Cancelling

    page = pages.show(f"/deployments/deployment/{deployment.id}/run", "run-form", "Hf Checkpoint")
    body = page.inner_text("body")
    assert all(field in body for field in ("Workdir", "Infra", "Mlflow Tracking Uri", "Train", "Evaluate")), body
    name = page.locator("textarea").first  # config.name, the form's first text area
    assert name.input_value() == "scheduled-tiny"  # prefect.yaml's default
    name.fill("from-the-form")

    # The run is the one in the answer to the form's own create_flow_run request, read by its id (a listing of the
    # deployment's runs would also hold the runs its schedule made); it is cancelled before any worker polls again.
    with _workers_paused(services):
        answers = _click_submit(page)
        made = [a for a in answers if a.ok]
        assert made, f"the form's create_flow_run answers: {[(a.status, a.text()[:300]) for a in answers]}"
        print(f"the form's Submit: create_flow_run answered {[a.status for a in answers]}")
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(made[0].json()["id"])
            cancel = client.set_flow_run_state(run.id, Cancelling(), force=True)
    assert run.deployment_id == deployment.id and run.parameters["config"]["name"] == "from-the-form", run.parameters
    # Then the UI goes to the deployment's Runs tab (a history change, not a page load: the browser's own location
    # is what is waited on).
    pages.wait("the Runs tab after the form's run was created", "run-form-submitted",
               lambda ms: page.wait_for_function("() => location.search.includes('tab=Runs')", timeout=ms))
    # No worker took it, so the server turns the Cancelling asked for into Cancelled at once (its rule for a
    # Scheduled run without infrastructure), as for the UI's Cancel.
    assert cancel.status == SetStateStatus.REJECT and cancel.state is not None and cancel.state.is_cancelled(), cancel
    # Its own page (the Runs tab lists it only after its next refresh: it left out the run while Scheduled).
    pages.show(f"/runs/flow-run/{run.id}", "submitted-run", run.name)
    assert run.parameters["config"]["model"] == {"hf_checkpoint": "tiny:qwen3?seed=0", "cache_dir": None}
    return run


@pytest.mark.slow
@pytest.mark.timeout(TRAIN_S)
def test_the_ui_shows_the_deployments_runs_a_changed_form_and_the_train_stages_artifacts(
        browser, retried, pages, services, mlflow_server):
    """On the module's server, deployments and retried training pipeline (the tests above made them). `browser`
    first: without Chromium the test skips before it builds the retried pipeline (when it runs alone)."""
    import httpx
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    from slimeflow import stages

    assert retried.finished.is_completed(), retried.finished
    # The deployments list: all seven, the pipeline's daily schedule.
    page = pages.show("/deployments", "deployments", "slimeflow-pipeline")
    body = page.inner_text("body")
    assert all(name in body for name in ("pipeline", *stages.available())), body
    assert "At 03:00 AM every day" in body

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("slimeflow-pipeline/pipeline")
    _submit_the_form(pages, deployment, services)

    # The retried pipeline's page: its stage subflows with their states (train's failed first attempt beside).
    page = pages.show(f"/runs/flow-run/{retried.run_id}", "pipeline-run-subflows", "slimeflow-evaluate",
                      tab="Subflow Runs")
    body = page.inner_text("body")
    assert all(f"slimeflow-{stage}" in body for stage in ("model", "preprocess", "train", "evaluate")), body
    assert "Completed" in body and "Failed" in body

    # The train stage's artifacts: the reward curve as an image, the eval table, its manifest (a path on the
    # worker's disk, shown as text) and its MLflow run (a link to the MLflow UI's page of the run).
    with get_client(sync_client=True) as client:
        subflows = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[retried.run_id])))
        flows = {f.id: f.name for f in client.read_flows()}
    [train] = [r for r in subflows if flows[r.flow_id] == "slimeflow-train" and r.state.is_completed()]
    artifacts = _artifacts_of(train.id)
    page = pages.show(f"/runs/flow-run/{train.id}", "train-artifacts", "slimeflow-train-reward-curve",
                      tab="Artifacts")
    assert all(key in page.inner_text("body") for key in artifacts), sorted(artifacts)

    page = pages.show(f"/artifacts/artifact/{artifacts['slimeflow-train-reward-curve'].id}", "reward-curve",
                      "slimeflow-train-reward-curve")
    pages.wait("the reward curve's image, loaded", "reward-curve", lambda ms: page.wait_for_function(
        "() => [...document.images].some(i => i.src.startsWith('data:image/png;base64,') && i.complete"
        " && i.naturalWidth > 0)", timeout=ms))

    page = pages.show(f"/artifacts/artifact/{artifacts['slimeflow-train-eval'].id}", "eval-table", "increment")
    assert "avg_at_1" in page.locator("table").first.inner_text()

    manifest = retried.workdir / "manifests" / "train.json"
    page = pages.show(f"/artifacts/artifact/{artifacts['slimeflow-train-manifest'].id}", "manifest-path",
                      str(manifest))
    assert page.locator("a[href^='file:']").count() == 0, "a file:// link: it opens nothing on another machine"

    run_url = artifacts["slimeflow-train-mlflow"].data.split("](", 1)[1].rstrip(")")  # a link artifact's markdown
    assert run_url.startswith(f"{mlflow_server}/#/experiments/")
    page = pages.show(f"/artifacts/artifact/{artifacts['slimeflow-train-mlflow'].id}", "mlflow-link", mlflow_server)
    assert page.locator(f"a[href='{run_url}']").count() == 1
    run_id = run_url.rsplit("/", 1)[1]
    found = httpx.get(f"{mlflow_server}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=10)
    assert found.status_code == 200 and found.json()["run"]["info"]["run_name"] == "train"
    assert httpx.get(mlflow_server, timeout=10).status_code == 200  # the UI that opens the link's page
