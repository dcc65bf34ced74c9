"""Processes that live and die together: a child with the process that started it (a conversion's ranks, an
engine), and words for how a child ended.

A parent killed leaves its children running; die_with_parent closes that gap, by the kernel where it can
(Linux's PR_SET_PDEATHSIG), else by a thread that watches for the parent's end. What a child starts in turn (Ray's
agents under its raylet) is out of that reach: `reaped_with_this_process` keeps a watcher beside the run that kills
every descendant it has seen once the run is gone. And `periodically`, a small ticking thread for work beside a body
(torch_dist's write-behind).
"""

from __future__ import annotations

import ctypes
import functools
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil

_PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 1.0
"""How often die_with_parent's watcher thread looks for its parent (a graceful stop comes this much late at most)."""


def exit_description(returncode: int) -> str:
    """`subprocess`'s returncode in words: 'exited with 1', 'was killed by SIGKILL (...)'."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = " (SIGKILL: often the kernel's out-of-memory killer, see `dmesg`)" if -returncode == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


@functools.cache
def _prctl() -> Callable[..., int] | None:
    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def parent_gone(parent_pid: int) -> bool:
    """Whether `parent_pid`, the process that started this one, has ended: this one has then been reparented (to
    init or a subreaper), which, unlike probing the pid, a reuse of the pid cannot hide."""
    return os.getppid() != parent_pid


def die_with_parent(parent_pid: int, stop: Callable[[], object] | None = None) -> None:
    """End this process when `parent_pid`, the process that started it, ends; now if it has already gone.

    Without `stop` the end is a SIGKILL: on Linux the kernel's (PR_SET_PDEATHSIG), sent as soon as the parent's
    thread that started this process ends, so that thread must wait for it (launch.py's does); elsewhere a watcher
    thread's. With `stop` (a graceful shutdown, e.g. a server's exit flag), a watcher thread calls it once, within
    PARENT_POLL_S of the parent's end: for a process whose starting thread may end before it (an engine restarted
    by the health monitor's thread). ValueError when `parent_pid` is a live process other than the parent."""
    if parent_gone(parent_pid) and _alive(parent_pid):
        raise ValueError(f"--parent-pid {parent_pid} is not this process's parent (that is {os.getppid()}); pass "
                         "the pid of the process that starts this one")
    if stop is None and _kernel_kills_with_parent():
        if parent_gone(parent_pid):  # it may have died before the request was made
            os._exit(1)
        return
    threading.Thread(target=_watch_parent, args=(parent_pid, stop or _kill_self), name="parent-watch",
                     daemon=True).start()


def dies_with_this_process() -> Callable[[], None]:
    """A `subprocess.Popen(preexec_fn=...)` that makes the child die_with_parent of this process (the thread that
    starts it). prctl is looked up here, in the parent: the child between fork and exec only calls it."""
    _prctl()
    return functools.partial(die_with_parent, os.getpid())


def kill_descendants() -> None:
    """SIGKILL every process this one started, and theirs: what a run stopped by a signal leaves."""
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            continue


REAP_POLL_S = 0.5
"""How often the reaper lists the watched process's descendants."""
REAP_TOKEN = "SLIMEFLOW_REAP_TOKEN"
"""The environment variable that marks every process a reaped run starts, and what they start in turn."""


@contextmanager
def reaped_with_this_process() -> Iterator[subprocess.Popen]:
    """While the body runs, a watcher process (`python -m slimeflow.supervise PID TOKEN`) outlives this one if it is
    killed, and then SIGKILLs what it started. For what die_with_parent cannot reach: grandchildren such as Ray's
    dashboard and runtime-env agents, which outlived a SIGKILLed driver by up to 60 s (their own check of the raylet
    waits on the dead GCS). A process is the run's if it was seen among this one's descendants (listed every
    REAP_POLL_S) or carries the run's token in its environment (set here, so everything started in the body inherits
    it: that covers one started and orphaned between two listings). Stopped when the body ends."""
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    previous = os.environ.get(REAP_TOKEN)
    os.environ[REAP_TOKEN] = token
    watcher = subprocess.Popen([sys.executable, "-m", "slimeflow.supervise", str(os.getpid()), token],
                               stdin=subprocess.DEVNULL, close_fds=True)
    try:
        yield watcher
    finally:
        watcher.terminate()
        watcher.wait()
        if previous is None:
            os.environ.pop(REAP_TOKEN, None)
        else:
            os.environ[REAP_TOKEN] = previous


def reap_when_gone(pid: int, token: str | None = None, poll_s: float = REAP_POLL_S) -> list[int]:
    """Watch `pid` until it ends (a zombie counts as ended), then SIGKILL the descendants it had and every process
    whose environment holds REAP_TOKEN=`token`; the pids killed."""
    seen: dict[int, float] = {}  # pid -> start time: a pid reused by another process after its own exit is spared
    me = os.getpid()
    try:
        watched = psutil.Process(pid)
        while watched.status() != psutil.STATUS_ZOMBIE:
            for child in watched.children(recursive=True):
                with _gone_is_fine():
                    seen.setdefault(child.pid, child.create_time())
            time.sleep(poll_s)
    except psutil.NoSuchProcess:
        pass
    killed = []
    for process in psutil.process_iter():
        with _gone_is_fine():
            if process.pid == me:
                continue
            ours = seen.get(process.pid) == process.create_time() or (
                token is not None and process.environ().get(REAP_TOKEN) == token)
            if ours:
                process.kill()
                killed.append(process.pid)
    return killed


@contextmanager
def _gone_is_fine() -> Iterator[None]:
    try:
        yield
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists (any user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _kernel_kills_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent ends; False where it cannot (off Linux)."""
    prctl = _prctl()
    if prctl is None:
        return False
    if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return True


def _watch_parent(parent_pid: int, stop: Callable[[], object]) -> None:
    while not parent_gone(parent_pid):
        time.sleep(PARENT_POLL_S)
    stop()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def periodically(interval: float, tick: Callable[[], object], name: str) -> Iterator[None]:
    """Call `tick()` every `interval` seconds on a daemon thread named `name` while the body runs; the thread is
    stopped (at once, not at its next tick) and joined when the body ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval):
            tick()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


if __name__ == "__main__":  # the reaper of reaped_with_this_process
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the run ended normally: nothing to reap
    reap_when_gone(int(sys.argv[1]), sys.argv[2])
