"""A conversion's processes live and die together: ranks with the process that started them, checkpoint writers
with their rank, and a rank whose writer died stops at once.

megatron-core's dist_checkpointing forks writer processes and waits for them on a queue with no timeout: a writer
killed (by the out-of-memory killer, say) leaves its rank waiting forever, and the other ranks with it in a
collective. And a rank killed, or a parent killed, leaves its children running. Linux's PR_SET_PDEATHSIG and a
small watchdog thread close both gaps; off Linux these do nothing.
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
from pathlib import Path

_PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.1
"""How often a rank checks its writers: a dead writer fails the conversion within this much (plus the parent's poll)."""


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


def children_die_with_this_process() -> None:
    """Every process forked from now on (dist_checkpointing's writers) gets die_with_parent(this process).
    PR_SET_PDEATHSIG follows the forking thread: a rank forks its writers from its main thread."""
    _prctl()  # loaded here, not in the child
    owner = os.getpid()
    os.register_at_fork(after_in_child=lambda: die_with_parent(owner))


def child_pids() -> list[int]:
    """This process's children (zombies included), from /proc/<pid>/task/<tid>/children; [] where that is absent."""
    pids: list[int] = []
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        try:
            pids.extend(int(pid) for pid in children.read_text().split())
        except OSError:  # the thread ended
            continue
    return pids


def failed_child() -> tuple[int, int] | None:
    """(pid, returncode as subprocess reports it) of a child that exited non-zero or by a signal, else None.
    Peeks without reaping (WNOWAIT): whoever waits for the child still can."""
    for pid in child_pids():
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped meanwhile
            continue
        if info is None:
            continue
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if code != 0:
            return pid, code
    return None


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


@contextmanager
def stop_when_a_child_fails(message: Callable[[int, int], str], interval: float = WATCH_INTERVAL_S
                            ) -> Iterator[None]:
    """While the body runs, check this process's children every `interval` seconds; when one has failed, write
    `message(pid, returncode)` to stderr and end this process at once with status 1 (its other children then
    die by die_with_parent). The body may be stuck waiting for that child, so nothing gentler would do."""

    def check() -> None:
        failed = failed_child()
        if failed is not None:
            sys.stderr.write(message(*failed) + "\n")
            sys.stderr.flush()
            os._exit(1)

    with periodically(interval, check, "child watchdog"):
        yield
