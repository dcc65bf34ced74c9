"""The processes of a session, for tests that kill a job (and everything it started) and check nothing is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def session_processes(session: int) -> dict[int, str]:
    """The live processes (zombies aside) of `session`, by pid, each with the start of its command line."""
    alive = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session and fields[0] != "Z":
                alive[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes()[:100].decode(errors="replace")
        except (OSError, ValueError):
            continue  # exited while we looked
    return alive


def wait_until_gone(session: int, timeout: float, poll: float = 0.1) -> None:
    """Wait until no live process (zombies aside) remains in `session`; AssertionError naming them after `timeout`."""
    deadline = time.monotonic() + timeout
    while alive := session_processes(session):
        if time.monotonic() >= deadline:
            raise AssertionError(f"processes {alive} of session {session} still run after {timeout} s")
        time.sleep(poll)


def kill_session(leader: subprocess.Popen) -> None:
    """SIGKILL every live process of the session `leader` (started with start_new_session=True) leads, and reap it:
    a test's cleanup, whatever the test left."""
    for pid in session_processes(leader.pid):
        with contextlib.suppress(ProcessLookupError):  # exited since it was listed
            os.kill(pid, signal.SIGKILL)
    if leader.poll() is None:
        leader.kill()
        leader.wait()
