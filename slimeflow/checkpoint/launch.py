"""Starting a conversion's ranks: local subprocesses, or Ray tasks that each start one.

Either way every rank is a fresh `python -c` process running worker.main on the same job file (a rank holds a
process-global process group, so it never runs inside a long-lived process). With Ray, the job file, the rendezvous and the checkpoint directory must be on storage that every
node sees at the same path (a local Ray on this machine always does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from slimeflow.supervise import exit_description

Launcher = Literal["local", "ray"]
LAUNCHERS: tuple[str, ...] = ("local", "ray")
RAY_PLACEMENT_TIMEOUT_S = 300
"""How long the Ray launcher waits for the cluster to place every rank at once before giving up."""
POLL_INTERVAL_S = 0.05
"""How often the local launcher checks its ranks (a conversion's end is seen this much late at most)."""

# The collector is off from the first import on (worker.process_main says why).
_WORKER = "import gc; gc.disable(); from slimeflow.checkpoint.worker import process_main; process_main()"


def launch(job_path: Path, processes: int, launcher: Launcher = "local", ray_address: str | None = None) -> None:
    """Run ranks 0..processes-1 of the job and return when all have succeeded; RuntimeError naming the first
    rank that failed, with the end of its log, after stopping the others."""
    if launcher == "local":
        _launch_local(job_path, processes)
    elif launcher == "ray":
        _launch_ray(job_path, processes, ray_address)
    else:
        raise ValueError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")


def start_rank(job_path: Path, rank: int) -> subprocess.Popen:
    """Start one rank as a subprocess logging to `rank-<r>.log` next to the job file, in a process group of its
    own (whatever it starts joins it: stop_rank ends them together); it dies with this process."""
    with _log(job_path, rank).open("wb") as out:
        return subprocess.Popen([sys.executable, "-c", _WORKER, str(job_path), str(rank), "--parent-pid",
                                 str(os.getpid())], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_rank(proc: subprocess.Popen) -> None:
    """SIGKILL a rank's process group (the rank and whatever it started, or left if it has already ended), and
    reap the rank."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left in the group
        pass
    proc.wait()


def rank_failure(job_path: Path, rank: int, code: int) -> RuntimeError:
    tail = _log(job_path, rank).read_text(encoding="utf-8", errors="replace")[-3000:]
    return RuntimeError(f"conversion rank {rank} {exit_description(code)}:\n{tail}")


def _log(job_path: Path, rank: int) -> Path:
    return job_path.parent / f"rank-{rank}.log"


def _launch_local(job_path: Path, processes: int) -> None:
    procs: list[subprocess.Popen] = []
    failed = None
    try:
        procs.extend(start_rank(job_path, rank) for rank in range(processes))
        failed = _first_failure(procs)
    finally:
        for proc in procs:  # after a failure or an interruption: a rank that succeeded has nothing left
            if proc.poll() != 0:
                stop_rank(proc)
    if failed is not None:
        raise rank_failure(job_path, failed, procs[failed].returncode)


def _first_failure(procs: list[subprocess.Popen]) -> int | None:
    """Wait until every rank has succeeded (None) or one has failed (its rank). Of ranks seen failing together,
    one killed by a signal comes first: the others' errors (a peer's closed connection) follow from it."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return min(failed, key=lambda rank: (codes[rank] >= 0, rank))
        if all(code == 0 for code in codes):
            return None
        time.sleep(POLL_INTERVAL_S)


def run_rank(job_path: str, rank: int) -> None:
    """One rank, start to finish, in the calling process's child (the body of a Ray task)."""
    proc = start_rank(Path(job_path), rank)
    try:
        code = proc.wait()
    finally:  # a cancelled task stops its rank; a failed one leaves nothing behind
        if proc.poll() != 0:
            stop_rank(proc)
    if code != 0:
        raise rank_failure(Path(job_path), rank, code)


def _launch_ray(job_path: Path, processes: int, ray_address: str | None) -> None:
    """One Ray task per rank, placed together (a placement group: the ranks rendezvous, so all must run at
    once); a rank takes a GPU when the cluster has one for each (its worker then uses NCCL)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from slimeflow.cluster import init_ray

    init_ray(ray_address)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= processes else 0
    group = placement_group([{"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}] * processes)
    try:
        ready, _ = ray.wait([group.ready()], timeout=RAY_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"the Ray cluster could not place {processes} conversion ranks "
                               f"({'1 GPU and ' if gpus else ''}1 CPU each) within {RAY_PLACEMENT_TIMEOUT_S} s; "
                               f"free resources or pass fewer --processes")
        task = ray.remote(max_calls=1, num_cpus=1, num_gpus=gpus)(run_rank)  # max_calls=1: a fresh worker each
        pending = [task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=rank)).remote(str(job_path), rank) for rank in range(processes)]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayTaskError as err:
                for ref in pending:
                    ray.cancel(ref)
                raise err.cause from None  # the rank's own error: its exit code and log
    finally:
        remove_placement_group(group)
