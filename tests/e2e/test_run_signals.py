"""`slimeflow run` stopped by a signal to the driver's pid alone (a scheduler, a container runtime, `kill PID`):
nothing it started outlives it. SIGTERM, SIGINT and SIGHUP: the driver stops what it started; SIGKILL: what it
started notices and exits (Prefect's ephemeral server, Ray's processes). Each run trains until the signal, sent once
the ephemeral server and Ray's raylet both run; SIGTERM once the run has saved a checkpoint too, which the next run
must be able to start from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from process_sessions import kill_session, session_processes, wait_until_gone

from slimeflow.checkpoint.integrity import quick_problems
from slimeflow.io.storage import local_path
from slimeflow.train.backends.checkpoint import resolve_start

ROOT = Path(__file__).resolve().parents[2]
READY_S = 300
GONE_S = 15
SHM = "/dev/shm/"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("signals") / "hf", TinyModelSpec(seed=0))


def _config(workdir: Path, checkpoint: Path, save_interval: int | None) -> Path:
    path = workdir / "run.yaml"
    path.write_text(yaml.safe_dump({
        "name": "signalled", "workdir": str(workdir), "stages": ["train"],
        "train": {"hf-checkpoint": str(checkpoint), "prompt-data": str(ROOT / "examples/data/increment-train.jsonl"),
                  "input-key": "prompt", "label-key": "label", "rollout-batch-size": 2, "n-samples-per-prompt": 2,
                  "num-rollout": 10_000, "rollout-max-response-len": 1, "rm-type": "prefix_match",
                  "save-interval": save_interval}}))
    return path


def _tracker(workdir: Path) -> int | None:
    try:
        return int((workdir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    except (OSError, ValueError):
        return None


def _a_next_run_starts_from_a_whole_checkpoint(workdir: Path) -> None:
    """What the next run's start-up check finds (stages/train/preflight.py): the latest checkpoint is whole."""
    start = resolve_start(str(workdir / "checkpoints"), None)
    assert start.source == "load" and start.ref is not None, start
    problems = quick_problems(local_path(start.ref.uri))
    assert not problems, problems


def _shm_segments(pids) -> set[str]:
    """The /dev/shm files `pids` have mapped or open."""
    found = set()
    for pid in pids:
        try:
            found |= {line.split(None, 5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                      if SHM in line}
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(SHM):
                    found.add(target)
        except (OSError, IndexError):
            continue
    return {s.removesuffix(" (deleted)") for s in found}


def _wait_ready(driver: subprocess.Popen, log: Path) -> dict[int, str]:
    deadline = time.monotonic() + READY_S
    while True:
        alive = session_processes(driver.pid)
        commands = list(alive.values())
        if any("uvicorn" in c for c in commands) and any("raylet" in c for c in commands):
            return alive
        assert driver.poll() is None, f"the run ended ({driver.returncode}) before the signal:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no Prefect server and raylet after {READY_S} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _wait_for_a_checkpoint(driver: subprocess.Popen, workdir: Path, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while _tracker(workdir) is None:
        assert driver.poll() is None, f"the run ended ({driver.returncode}) before a save:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint after {READY_S} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.slow  # a Prefect server and a Ray cluster start per signal: about a minute each on 2 cores
@pytest.mark.timeout(READY_S + 120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_a_signal_to_the_driver_alone_leaves_no_process_and_no_shared_memory(signum, tiny_checkpoint, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the run's own ephemeral server
    log = tmp_path / "run.log"
    # SIGTERM (what a scheduler, a container runtime or systemd sends) also lands after a save, mid-training: the
    # run stops as fast and leaves a checkpoint the next run starts from. Every rollout saves in that case.
    resumes = signum == signal.SIGTERM
    config = _config(tmp_path, tiny_checkpoint, save_interval=1 if resumes else None)
    with log.open("wb") as out:
        driver = subprocess.Popen([sys.executable, "-m", "slimeflow.cli", "run", str(config)],
                                  cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        alive = _wait_ready(driver, log)
        if resumes:
            _wait_for_a_checkpoint(driver, tmp_path, log)
            alive = session_processes(driver.pid)
        segments = _shm_segments(alive)
        os.kill(driver.pid, signum)  # the pid alone, not its group
        try:
            wait_until_gone(driver.pid, timeout=GONE_S)  # the driver too: once exited, it is a zombie until reaped
        except AssertionError as err:
            raise AssertionError(f"{err}; the run's output ends:\n{log.read_text()[-3000:]}") from None
        left = sorted(s for s in segments if os.path.exists(s))
        assert not left, f"/dev/shm segments of the run left after {GONE_S} s: {left}"
        if resumes:
            _a_next_run_starts_from_a_whole_checkpoint(tmp_path)
    finally:
        kill_session(driver)
