"""die_with_parent, the one way a child ends with the process that started it: a graceful `stop` called once the
parent is gone (the engine's), and a refusal of a pid that is not the parent."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from slimeflow.supervise import PARENT_POLL_S, die_with_parent

# A parent that starts a child and waits; the child asks to be stopped gracefully when its parent is gone, then
# writes a file of its own once it was (a server's loop ending on its exit flag).
PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(120)
"""
CHILD = """
import os, sys, threading
from pathlib import Path
from slimeflow.supervise import die_with_parent
stopped = threading.Event()
die_with_parent(os.getppid(), stop=stopped.set)
Path(sys.argv[1]).write_text(str(os.getpid()))
stopped.wait(120)
Path(sys.argv[1]).write_text("stopped")
"""


def test_a_child_is_stopped_gracefully_soon_after_its_parent_is_killed(tmp_path):
    said = tmp_path / "child"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(said)])
    try:
        deadline = time.monotonic() + 60
        while not said.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert said.exists(), "the child did not start"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + PARENT_POLL_S + 10
        while said.read_text() != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said.read_text() == "stopped"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_live_process_other_than_the_parent_is_refused():
    with pytest.raises(ValueError, match=rf"--parent-pid {os.getpid()} is not this process's parent"):
        die_with_parent(os.getpid(), stop=lambda: None)


# A run that starts a child which starts a grandchild of its own (Ray's raylet and its agents), under the reaper.
RUN = """
import subprocess, sys, time
from pathlib import Path
from slimeflow.supervise import reaped_with_this_process
with reaped_with_this_process():
    child = subprocess.Popen(["sh", "-c", "sleep 300 & echo $! > " + sys.argv[1] + "; wait"])
    time.sleep(300)
"""


def test_a_killed_run_takes_its_grandchildren_along(tmp_path):
    grandchild_file = tmp_path / "grandchild"
    run = subprocess.Popen([sys.executable, "-c", RUN, str(grandchild_file)])
    try:
        deadline = time.monotonic() + 60
        while not (grandchild_file.exists() and grandchild_file.read_text().strip()):
            assert time.monotonic() < deadline, "the grandchild did not start"
            time.sleep(0.05)
        grandchild = int(grandchild_file.read_text())
        run.kill()  # maybe before the reaper listed it: the run's token in its environment marks it
        run.wait()
        deadline = time.monotonic() + 10
        while _running(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(grandchild), "the grandchild outlived the killed run"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def _running(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
