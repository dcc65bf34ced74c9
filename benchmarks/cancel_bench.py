"""How long a cancelled Ray-hosted run holds its process group: Prefect's cancel, without Prefect's server.

A driver in a session of its own (as Prefect's process worker starts a flow run) installs a SIGTERM handler like
Prefect's flow engine (it raises), starts the local Ray cluster with slimeflow's init_ray, starts two actors and
waits on them inside stopping_local_ray_on_termination, as the train stage does. This process then sends SIGTERM to the driver's whole group, as the worker
does on Cancel, and times (a) until the driver's handler ran and (b) until no process of the session is left
(zombies aside): Prefect's worker waits for (b), up to its 30 s grace, before it SIGKILLs the group.

    .venv/bin/python benchmarks/cancel_bench.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

DRIVER = """
import signal, sys, time
import ray
from slimeflow.cluster import init_ray, stopping_local_ray_on_termination

class Termination(BaseException):  # Prefect's TerminationSignal
    pass

def host(signum, frame):
    print("handler", time.time(), flush=True)
    raise Termination
signal.signal(signal.SIGTERM, host)
init_ray(None)

@ray.remote
class Busy:
    def wait(self, s):
        time.sleep(s)

actors = [Busy.remote() for _ in range(2)]
ray.get([a.wait.remote(0) for a in actors])
print("ready", flush=True)
try:
    with stopping_local_ray_on_termination():  # as the train stage runs its loop
        while True:
            ray.get([a.wait.remote(0.2) for a in actors])
except Termination:
    print("raised", time.time(), flush=True)
    raise
"""


def session(sid: int) -> list[int]:
    """The live processes (zombies aside) of session `sid`."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                alive.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return alive


def one_round(limit_s: float) -> tuple[float, float, int]:
    """Seconds until the driver's handler raised, until the session was empty; processes in it when signalled."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(driver.stdout), daemon=True)
    reader.start()
    try:
        while not any(line.startswith("ready") for line in lines):
            if driver.poll() is not None:
                raise RuntimeError(f"the driver exited before it was ready: {driver.returncode}")
            time.sleep(0.05)
        time.sleep(1.0)  # the actors' wait loop under way
        members = len(session(driver.pid))
        start = time.time()
        os.killpg(driver.pid, signal.SIGTERM)
        deadline = time.monotonic() + limit_s
        while session(driver.pid) and time.monotonic() < deadline:
            driver.poll()  # reap the driver: a zombie is not a member any more
            time.sleep(0.05)
        gone = time.time() - start
        reader.join(timeout=1)
        raised = next((float(line.split()[1]) - start for line in lines if line.startswith("raised")), -1.0)
        return raised, gone, members
    finally:
        for pid in session(driver.pid):  # past the limit: what Prefect does after its grace
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        driver.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds to wait for the group (Prefect: 30)")
    args = parser.parse_args()
    gones = []
    for i in range(args.rounds):
        raised, gone, members = one_round(args.limit)
        gones.append(gone)
        how = f"handler raised after {raised:.2f} s" if raised >= 0 else "a Ray call failed first"
        print(f"round {i + 1}: {members} processes; {how}, group empty after {gone:.2f} s; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"median group empty after {statistics.median(gones):.2f} s over {args.rounds} rounds")


if __name__ == "__main__":
    main()
