"""Time from an engine's SIGKILL to its serving again under --use-fault-tolerance, against a cold engine start.

    .venv/bin/python benchmarks/fault_recovery.py [--repeats 3] [--interval 1] [--timeout 5] [--signal KILL|STOP]
        [--weights-from peer|trainer]

Two embedded engines (processes, one torch thread each) behind sglang-router serve a tiny Llama-style model, with a
pushed weight version "1" (nudged off the checkpoint, so that the restarted engine must be given it). With
`--weights-from trainer` one engine serves it (no router, no peer): the restarted engine gets version 1 as from
TrainActor.push_to, the trainer's kept copy pushed over HTTP (in this process: without the Ray call). The health
monitor (stages/train/fault_tolerance.HealthMonitor) checks every `--interval` s with a `--timeout` s limit. Each
repeat sends `--signal` to engine 0 and waits until the monitor reports it serving again: restarted at its URL,
given the live engine's weights and version, back in the router. Reported: kill to serving again (goal < 10 s on
CPU), its detection part (at most one interval with SIGKILL; the timeout with SIGSTOP) and its recovery part; and,
as the baseline in the same run, a cold start of one engine process (launch until /health answers), timed just
before each kill. Medians over the repeats, with min-max, and the load average before and after. The CPU seconds
the restarted engine spent until it served (user + system) say what its restart costs on an idle core, where a
loaded machine's wall time does not.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slimeflow.config.train import FaultToleranceConfig
from slimeflow.engine.client import EngineClient
from slimeflow.engine.launch import ENGINE_READY_TIMEOUT_S, launch_engine
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.stages.train.engines import EngineSet
from slimeflow.stages.train.fault_tolerance import HealthMonitor, Recovery
from slimeflow.stages.train.weight_sync import WeightSync


def push_nudged(engines: EngineSet, version: str) -> dict[str, Any]:
    """Push the checkpoint's weights + 1e-3 to every engine as `version`; returns them (the trainer's kept copy)."""
    async def once() -> dict[str, Any]:
        async with EngineClient(engines.worker_urls[0], api_key=engines.api_key) as client:
            weights, _ = await client.weights_snapshot()
        nudged = {name: t + 1e-3 for name, t in weights.items()}
        sync = WeightSync(engines.weight_targets())
        await sync.push(nudged, version)
        await sync.aclose()
        return nudged
    return asyncio.run(once())


def trainer_push(engines: EngineSet, kept: dict[str, Any]) -> Any:
    """TrainActor.push_to's work: the kept weights to the restarted engines, over HTTP tensors."""
    def push_to(urls: list[str], version: str) -> str:
        async def once() -> str:
            sync = WeightSync(dataclasses.replace(engines.weight_targets(), worker_urls=tuple(urls)))
            try:
                return await sync.push(kept, version)
            finally:
                await sync.aclose()
        return asyncio.run(once())
    return push_to


def cold_start_s(model: Path) -> float:
    started = time.perf_counter()
    engine = launch_engine(model, num_threads=1)
    try:
        engine.wait_ready("/health", ENGINE_READY_TIMEOUT_S)
        return time.perf_counter() - started
    finally:
        engine.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat), what its start-up costs on an idle core."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kill_to_serving(engines: EngineSet, monitor: HealthMonitor, sig: signal.Signals, interval: float
                    ) -> tuple[float, Recovery]:
    """(kill to serving again, the recovery) for one `sig` to engine 0."""
    before = len(monitor.recoveries)
    with monitor.watching():
        time.sleep(interval / 2)  # mid-cycle: on average the monitor's next check is half an interval away
        killed = time.perf_counter()
        os.kill(engines.processes[0].process.pid, sig)
        deadline = killed + 300
        while len(monitor.recoveries) == before:
            if time.perf_counter() > deadline or monitor.failure:
                raise RuntimeError(f"no recovery within 300 s: {monitor.failure}")
            time.sleep(0.005)
        total = time.perf_counter() - killed
    recovery = monitor.recoveries[-1]
    assert recovery.weight_version == "1" and recovery.weights_from in ("peer", "trainer"), recovery
    return total, recovery


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval", type=float, default=1.0, help="--rollout-health-check-interval")
    parser.add_argument("--timeout", type=float, default=5.0, help="--rollout-health-check-timeout")
    parser.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    parser.add_argument("--weights-from", choices=["peer", "trainer"], default="peer")
    args = parser.parse_args()
    sig = signal.Signals[f"SIG{args.signal}"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", TinyModelSpec(seed=3))
        engines = EngineSet.start(str(model), {}, num_engines=2 if args.weights_from == "peer" else 1, threads=1)
        try:
            kept = push_nudged(engines, "1")
            settings = FaultToleranceConfig(use_fault_tolerance=True, rollout_health_check_interval=args.interval,
                                            rollout_health_check_timeout=args.timeout)
            monitor = HealthMonitor(engines, settings)
            monitor.weight_version = "1"
            monitor.from_trainer = trainer_push(engines, kept)
            cold, total, recovery, phases, restart_cpu = [], [], [], [], []
            for _ in range(args.repeats):
                cold.append(cold_start_s(model))
                whole, own = kill_to_serving(engines, monitor, sig, args.interval)
                total.append(whole)
                recovery.append(own.seconds)
                phases.append(own.phases)
                restart_cpu.append(cpu_seconds(engines.processes[0].process.pid))
        finally:
            engines.stop()
    print(f"SIG{args.signal} to serving again, interval {args.interval:g} s, timeout {args.timeout:g} s, weights from "
          f"the {args.weights_from}, {args.repeats} repeats (median, min-max):")
    print(f"  kill -> serving again  {spread(total)}   goal < 10 s")
    print(f"    detection            {spread([t - r for t, r in zip(total, recovery, strict=True)])}")
    print(f"    recovery             {spread(recovery)}   (router out, restart, weights, router in)")
    for name in phases[0]:
        print(f"      {name:<18} {spread([p[name] for p in phases])}")
    print(f"  cold engine start      {spread(cold)}   (baseline: launch until /health)")
    print(f"  CPU of the restarted engine until serving {spread(restart_cpu)} (one core's worth on an idle machine)")
    print(f"  recovery / cold start  {statistics.median(r / c for r, c in zip(recovery, cold, strict=True)):.2f}x")
    print(f"  load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
