"""init_ray in a process whose host handles SIGTERM (a Prefect flow run): the host's handler stays in charge; a
process joined to one cluster refuses another's address."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import signal, sys
import ray
from slimeflow.cluster import init_ray

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
ray.shutdown()
print(other)
print("kept" if kept else "replaced")
"""


@pytest.mark.slow  # a Ray cluster starts and stops: 13 s on 2 cores
def test_a_hosts_sigterm_handler_survives_ray_init():
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.splitlines()[-2:] == ["refused", "kept"]
