"""One run per work directory: a second process is refused with who holds it; the holder's death frees it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from slimeflow.io.guard import LOCK_FILENAME, DirectoryBusy, exclusive

HOLD = """
import sys, time
from slimeflow.io.guard import exclusive
with exclusive(sys.argv[1], "pipeline run 'other'"):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path/work (stopped by its pid at the end)."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "work")], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline() == "held\n"
        yield process
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holder_frees_the_directory(holder, tmp_path):
    work = tmp_path / "work"
    with pytest.raises(DirectoryBusy) as refused:
        with exclusive(work, "pipeline run 'mine'"):
            pytest.fail("entered a directory another process holds")
    message = str(refused.value)
    assert f"work directory {work.resolve()} is in use by another slimeflow run" in message
    assert f"pipeline run 'other', pid {holder.pid} on " in message
    assert "--workdir of its own" in message

    os.kill(holder.pid, signal.SIGKILL)  # no clean-up runs: the kernel drops the flock with the process
    holder.wait(timeout=30)
    with exclusive(work, "pipeline run 'mine'"):
        recorded = json.loads((work / LOCK_FILENAME).read_text())
        assert (recorded["purpose"], recorded["pid"]) == ("pipeline run 'mine'", os.getpid())


def test_the_lock_is_reentrant_in_its_process_and_released_after_the_outermost_block(tmp_path):
    with exclusive(tmp_path, "pipeline"):
        with exclusive(tmp_path, "train stage"):  # the pipeline's stages run in its process
            pass
        probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(120)", "pass"), str(tmp_path)],
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode == 1 and "DirectoryBusy" in probe.stderr  # still held by the outer block
    probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(120)", "pass"), str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0 and probe.stdout == "held\n"
