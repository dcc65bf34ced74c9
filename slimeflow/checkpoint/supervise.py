"""A conversion's processes live and die together: ranks with the process that started them.

A parent killed leaves its children running; Linux's PR_SET_PDEATHSIG closes that gap (off Linux it does
nothing). And `periodically`, a small ticking thread for work beside a body (torch_dist's write-behind).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


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


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the thread that started it ends; end now if `parent_pid`, the
    process that started it, has already gone (it may have died before the request was made)."""
    prctl = _prctl()
    if prctl is None:
        return
    if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def dies_with_this_process() -> Callable[[], None]:
    """A `subprocess.Popen(preexec_fn=...)` that makes the child die_with_parent of this process (the thread that
    starts it). prctl is looked up here, in the parent: the child between fork and exec only calls it."""
    _prctl()
    return functools.partial(die_with_parent, os.getpid())


def adopt_orphans() -> None:
    """Have this process inherit the orphans of its descendants (Linux's PR_SET_CHILD_SUBREAPER) instead of init, so
    that kill_descendants still finds a grandchild whose own parent died first (Ray's agents, once their raylet is
    killed). Off Linux it does nothing."""
    prctl = _prctl()
    if prctl is not None and prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def kill_descendants() -> None:
    """SIGKILL every process this one started, and theirs: what a run stopped by a signal leaves."""
    import psutil  # only on the way out of a stopped run

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            continue


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
