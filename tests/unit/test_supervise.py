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
