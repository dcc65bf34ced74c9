"""Cluster helpers that every stage running on Ray shares: start or join Ray (init_ray), the local cluster's
system config, torch threads per process on a CPU, whether the cluster has GPUs, and the scratch directory beside
a run's workdir. The training stage's placement and the distributed conversion both use them.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import ray
from ray._private import worker

LOCAL_RAY_SYSTEM_CONFIG = {
    # Ray runs workers at nice 15 by default; here the actors are the job itself, and at nice 15 training ran
    # 10x slower whenever anything else used the CPU (measured: 3 s vs 0.27 s a step).
    "worker_niceness": 0,
    # Ray's own Prometheus metrics, for a dashboard this cluster does not run: the raylet's wait for its metrics
    # exporter made ray.init take 3.32-3.33 s instead of 2.32-2.33 s (4 runs each). Our metrics go to MLflow.
    "enable_metrics_collection": False,
    "task_events_shutdown_flush_timeout_ms": 100,
}
"""The local cluster's Ray system config (a cluster joined by address keeps its own)."""


def init_ray(address: str | None) -> None:
    """Join the Ray cluster at `address` (RAY_ADDRESS style), else start a local one for this process.

    A SIGTERM handler the host installed (Prefect's, which turns a cancellation into a Cancelled run) stays in charge:
    ray.init replaces it with one that calls sys.exit, and a cancelled flow run would be reported Crashed."""
    if ray.is_initialized():
        joined = ray.get_runtime_context().gcs_address
        if address and address not in ("auto", "local") and not address.startswith("ray://") and address != joined:
            raise RuntimeError(f"this process is already connected to the Ray cluster at {joined}, not the "
                               f"--ray-address {address} asked for: run the stage in a process of its own (or call "
                               "ray.shutdown() first)")
        return
    host_handler = signal.getsignal(signal.SIGTERM)
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # "local": a cluster of its own, even where `ray start` left /tmp/ray/ray_current_cluster, which
        # ray.init() would join (another user's cluster, and then num_cpus is refused). RAY_ADDRESS, read into
        # the run's settings, still wins: it arrives here as `address`.
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=True,
                 configure_logging=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    if callable(host_handler) and threading.current_thread() is threading.main_thread():
        # The handler itself, not a wrapper: Prefect acknowledges a cancel's intent only while its own is installed.
        signal.signal(signal.SIGTERM, host_handler)


_stopped = False


def local_ray_stopped() -> bool:
    """Whether stop_local_ray killed this process's cluster: nothing is left to stop or ask."""
    return _stopped


@contextmanager
def stopping_local_ray_on_termination() -> Iterator[None]:
    """On the way out of a process being stopped (a BaseException that is no Exception: Prefect's TerminationSignal,
    KeyboardInterrupt, SystemExit), SIGKILL the local Ray cluster (stop_local_ray) before anything else waits on it.

    Prefect's cancel sends SIGTERM to the flow run's whole process group, Ray's GCS and raylet included; a driver
    that then shut down through the dying GCS waited on it (Ray's excepthook's report, the actors' stop, the task
    events' flush: 15 s to more than 60 s), and Prefect's worker waits for the whole group, up to 30 s, before its
    SIGKILL. Stopping Ray here, in the stage's code, leaves Prefect's SIGTERM handler in place (Prefect acknowledges
    a cancel's intent only while its own handler is installed). An Exception stops Ray too where the cluster has
    lost its raylet or GCS: the group's SIGTERM may fail a Ray call before the driver's handler has raised."""
    try:
        yield
    except BaseException as exc:
        stop = not isinstance(exc, Exception)
        try:
            stop = stop or _local_ray_lost_a_process()
        except BaseException:  # the handler's exception, raised here
            stop = True
            raise
        finally:
            if stop:
                stop_local_ray()
        raise


def _local_ray_lost_a_process() -> bool:
    node = worker._global_node
    return node is not None and any(info.process.poll() is not None
                                    for infos in node.all_processes.values() for info in infos)


def stop_local_ray() -> None:
    """SIGKILL the processes of the local Ray cluster this process started: the workers first, then the raylet, GCS
    and the rest. No-op where this process started none (not connected, or joined to a cluster by address)."""
    global _stopped
    node = worker._global_node
    if node is None:
        return
    _stopped = True
    if sys.excepthook is worker.custom_excepthook:  # it reports the driver's exception to the GCS, which is gone
        sys.excepthook = worker.normal_excepthook
    own = [info.process for infos in node.all_processes.values() for info in infos if info.process.poll() is None]
    tree = []
    for process in own:
        try:
            tree += psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
    for pid in [p.pid for p in tree] + [p.pid for p in own]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def cpu_threads(processes: int, *, spare: int = 1) -> int:
    """torch threads for each of `processes` computing at once on this machine's CPU, `spare` cores left over.

    Engines and trainers alike keep one core spare for what runs beside their compute (the HTTP servers, the
    rollout manager's event loop, Ray's own processes, other jobs on the machine): a torch thread that waits for a
    core stalls its op's other threads at every barrier. On the demo's loop on a loaded 2-core machine (loop_bench
    --seed 7, 80 steps, two runs each) the train step took a median 0.019 s with 1 thread against 0.16-0.29 s with
    2; its fastest steps were 0.017 s against 0.018-0.019 s, so one thread also loses nothing on a quiet machine
    now that the step's forward runs once per distinct row.
    It holds at real size too: SmolLM2-135M's loop on that machine at load 5-13 (benchmarks/real_loop.py) trained at
    40-65 s a step with 2 trainer threads against 18-33 s with 1 in runs paired with them, and its processes spent
    115-120 CPU s to the same held-out score against 86-88.
    """
    return max(1, ((os.cpu_count() or 1) - spare) // processes)


def has_gpus() -> bool:
    return bool(ray.cluster_resources().get("GPU", 0))


def scratch_dir(workdir: Path | None) -> Path:
    base = workdir if workdir is not None else Path(tempfile.gettempdir())
    path = base / ".ray-scratch"
    path.mkdir(parents=True, exist_ok=True)
    return path
