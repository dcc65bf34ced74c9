"""CPU seconds of every process on the machine while a command runs, grouped by what the process is.

    .venv/bin/python benchmarks/cpu_by_process.py --out cpu.json -- make test
    .venv/bin/python benchmarks/cpu_by_process.py --report cpu.json [--only /path/of/the/clone]

Samples /proc twice a second (each process's own utime + stime, the highest seen per pid and start time) while the
command runs, then prints the groups: Ray workers, Megatron ranks, engines, Prefect servers and flow runs, ...
and the machine's busy cores per minute (from /proc/stat): the minutes well under the core count are waits (a
poll, a sleep, a lone module at the end), not work.
A process that lives under half a second can be missed; one that is killed keeps its last sample. Every process of
the machine is sampled: `--only` keeps those whose command line holds the given text (a fresh clone's path names
its venv in every process it starts, Ray's included).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")
GROUPS = (  # (group, text in the command line); the first that matches names the process
    ("mypy", "mypy"), ("ruff", "ruff"), ("pip install", "pip install"),
    ("Ray workers (actors)", "default_worker"), ("Ray workers (actors)", "ray::"), ("Ray's own", "gcs_server"),
    ("Ray's own", "/raylet"), ("Ray's own", "dashboard"), ("Ray's own", "log_monitor"), ("Ray's own", "monitor.py"),
    ("Ray's own", "agent"), ("Ray's own", "/ray/"), ("xdist workers", "sys.stdin.readline"),
    ("engine subprocesses", "slimeflow.engine"), ("routers", "router"), ("conversion workers", "checkpoint.worker"),
    ("Prefect servers", "prefect server"), ("Prefect servers", "uvicorn"), ("Prefect workers", "worker start"),
    ("Prefect flow runs", "prefect.engine"), ("Prefect flow runs", "prefect.runner"),
    ("multiprocessing children (Megatron ranks, ...)", "multiprocessing"), ("slimeflow CLI", "bin/slimeflow"),
    ("MLflow", "mlflow"), ("moto", "moto"), ("Chromium", "chrom"),
)


def sample(records: dict, now: float) -> None:
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            key = f"{name}:{fields[19]}"  # pid and start time: a reused pid is another process
            cpu = (int(fields[11]) + int(fields[12])) / TICK
            if key not in records:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    args = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
                records[key] = {"pid": int(name), "ppid": int(fields[1]), "args": args, "cpu": 0.0, "first": now}
            if "default_worker" in records[key]["args"] and "title" not in records[key]:
                with open(f"/proc/{name}/cmdline", "rb") as f:  # Ray retitles a worker with its actor's class
                    title = f.read().split(b"\0")[0].decode(errors="replace")
                if title.startswith("ray::") and title != "ray::IDLE":
                    records[key]["title"] = title[:100]
            records[key]["cpu"] = max(records[key]["cpu"], cpu)
            records[key]["last"] = now
        except (OSError, ValueError, IndexError):
            pass  # the process ended while being read


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot: idle and iowait are not busy."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def group(args: str) -> str:
    return next((name for name, text in GROUPS if text in args), "other")


def timeline(points: list[list[float]]) -> None:
    """Busy cores per minute of the run, from (time, busy jiffies) points."""
    if len(points) < 2:
        return
    start = points[0][0]
    print("busy cores per minute (of", os.cpu_count(), "):")
    by_minute: dict[int, list[list[float]]] = collections.defaultdict(list)
    for point in points:
        by_minute[int((point[0] - start) // 60)].append(point)
    for minute, pts in sorted(by_minute.items()):
        if len(pts) > 1:
            cores = (pts[-1][1] - pts[0][1]) / TICK / (pts[-1][0] - pts[0][0])
            print(f"  min {minute:3d}  {cores:4.2f}  " + "#" * round(cores * 10))


def report(records: list[dict], only: str | None, points: list[list[float]] | None = None) -> None:
    timeline(points or [])
    kept = [r for r in records if only is None or only in r["args"]]
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for r in kept:
        groups[group(r["args"])][0] += r["cpu"]
        groups[group(r["args"])][1] += 1
    print(f"{sum(r['cpu'] for r in kept):.0f} CPU s over {len(kept)} processes")
    for name, (cpu, count) in sorted(groups.items(), key=lambda item: -item[1][0]):
        print(f"{cpu:8.0f} CPU s {count:5d} processes  {name}")
    actors: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for r in kept:
        if "title" in r:
            actors[r["title"].split(".")[0].split(":")[2]][0] += r["cpu"]
            actors[r["title"].split(".")[0].split(":")[2]][1] += 1
    for name, (cpu, count) in sorted(actors.items(), key=lambda item: -item[1][0]):
        print(f"{cpu:8.0f} CPU s {count:5d} Ray actors  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="where to write the samples (JSON)")
    parser.add_argument("--report", help="print the groups of a samples file")
    parser.add_argument("--only", help="keep the processes whose command line holds this text")
    parser.add_argument("command", nargs="*")
    options = parser.parse_args()
    if options.report:
        with open(options.report) as f:
            data = json.load(f)
        if isinstance(data, list):  # written before the timeline was recorded
            data = {"processes": data, "busy": []}
        report(data["processes"], options.only, data["busy"])
        return 0
    if not options.command or not options.out:
        parser.error("give --out FILE -- COMMAND, or --report FILE")
    records: dict = {}
    points: list[list[float]] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            now = time.time()
            sample(records, now)
            points.append([now, busy_jiffies()[0]])
            done.wait(0.5)

    sampler = threading.Thread(target=loop, daemon=True)
    sampler.start()
    try:
        code = subprocess.call(options.command)
    finally:
        done.set()
        sampler.join()
        with open(options.out, "w") as f:
            json.dump({"processes": list(records.values()), "busy": points}, f)
    report(list(records.values()), options.only, points)
    return code


if __name__ == "__main__":
    sys.exit(main())
