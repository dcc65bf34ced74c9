"""init_ray in a process whose host handles SIGTERM (a Prefect flow run): the host's handler stays in charge; a
process joined to one cluster refuses another's address; a SIGTERM to the whole process group (Prefect's cancel)
empties the group without waiting on Ray's dying processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from process_sessions import kill_session, session_processes

PROBE = """
import signal, sys
import ray
from slimeflow.cluster import init_ray, local_ray_stopped, stopping_local_ray_on_termination

def host(signum, frame):  # what Prefect's engine installs: a cancellation becomes a Cancelled run
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, host)
init_ray(None)
kept = signal.getsignal(signal.SIGTERM) is host
init_ray(None)  # joined already: nothing to do
try:  # another cluster's address in a process joined to this one: refused, never used silently
    init_ray("127.0.0.1:1")
    other = "used"
except RuntimeError as err:
    other = "refused" if "already connected to the Ray cluster at" in str(err) else repr(err)
print(other)
print("kept" if kept else "replaced")

@ray.remote
def nap(s):
    import time
    time.sleep(s)

try:  # the train stage's loop, cancelled: SIGTERM to the whole group, Ray's GCS, raylet and workers included
    with stopping_local_ray_on_termination():
        ray.get(nap.remote(0))
        print("ready", flush=True)
        while True:
            ray.get(nap.remote(0.2))
except KeyboardInterrupt:
    print("stopped" if local_ray_stopped() else "not stopped", flush=True)
    raise
"""


@pytest.mark.slow  # a Ray cluster starts and is cancelled: 13 s on 2 cores
def test_a_hosts_sigterm_handler_survives_ray_init_and_a_group_sigterm_leaves_no_process(tmp_path):
    out, err = tmp_path / "probe.out", tmp_path / "probe.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        probe = subprocess.Popen([sys.executable, "-c", PROBE], stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while "ready" not in out.read_text():
            assert probe.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.1)
        assert out.read_text().splitlines()[:2] == ["refused", "kept"]
        os.killpg(probe.pid, signal.SIGTERM)  # as Prefect's worker cancels a flow run
        probe.wait(timeout=60)
        # Ray's processes were killed, not left to shut down while the driver waited on them: before, the driver's
        # report to the dying GCS held the group past Prefect's 30 s grace (60 s and more).
        deadline = time.monotonic() + 20
        while session_processes(probe.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not session_processes(probe.pid), err.read_text()[-3000:]
        assert "stopped" in out.read_text().splitlines(), err.read_text()[-3000:]
    finally:
        kill_session(probe)
