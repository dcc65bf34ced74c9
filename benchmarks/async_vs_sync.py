"""The async loop (--async, slime's train_async.py) against the synchronous loop on the demo task, same seeds.

The demo's task and hyperparameters as loop_bench.py (16 prompts x 16 samples, 1-token responses, GRPO, lr 1e-3,
greedy held-out accuracy every --eval-interval rollouts); both sides disaggregated (no --colocate), each side's train
stage in a fresh process, the sides interleaved round by round (the order alternating) so that the machine's load
falls on both. Each run stops when the held-out accuracy first reaches --target, or at --max-rollouts.

Figures per side, medians over the runs: completions/s (completions trained / loop seconds without eval; the loop
clock starts when the eval before training lands), seconds to the target (loop time), steps to the target, and
where the time goes (per-rollout phases: time/generate is the sync loop's generation, time/wait_generate the async
loop's wait for a rollout generated while it trained; rollout/completions_per_s the engine side's own rate).

    .venv/bin/python benchmarks/async_vs_sync.py [--rounds 3] [--seed 7] [--target 0.8] [--interval 1] \
        [--async-buffer-size 1] \
        [--sides sync,async,async-thread,async-tis]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_bench import SideResult, prepare, run_slimeflow, slimeflow_config  # noqa: E402  (a sibling script)


def side_config(args, side: str, hf: str, train: str, held_out: str):
    config = slimeflow_config(args, hf, train, held_out)
    if side == "sync":
        return config
    # "async": the engine in a process of its own (--async's default on a CPU); "async-thread": served from a thread
    # of the RolloutManager's process (--engine-in-process true), one process fewer competing for the cores.
    placement = config.placement.model_copy(update={"async_": True, "engine_in_process": side == "async-thread",
                                                    "async_buffer_size": args.async_buffer_size})
    weight_sync = config.weight_sync.model_copy(update={"update_weights_interval": args.interval})
    # "async-tis": --use-tis, the engine's log-probs of the stale policy weighing each token (slime's TIS).
    algorithm = config.algorithm.model_copy(update={"use_tis": side == "async-tis"})
    return config.model_validate({**config.model_dump(), "placement": placement.model_dump(),
                                  "weight_sync": weight_sync.model_dump(), "algorithm": algorithm.model_dump()})


def run_side(args, side: str, paths: tuple[str, str, str], workdir: Path) -> SideResult:
    config = side_config(args, side, *paths)
    assert config.placement.async_ == (side != "sync")
    result = run_slimeflow(args, *paths, workdir, config=config)
    result.name = side
    return result


def summary(side: str, runs: list[SideResult]) -> list[str]:
    def med(values):
        values = [v for v in values if v is not None]
        return (f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]" if values else "-")

    reached = [r for r in runs if r.target_s is not None]
    return [f"{side}: completions/s {med([r.completions_per_s for r in runs])}, "
            f"s to target {med([r.target_s for r in runs])} ({len(reached)}/{len(runs)} reached), "
            f"steps to target {med([r.target_step for r in runs])}, "
            f"final acc {med([r.evals[-1][1] for r in runs])}, start-up s {med([r.startup_s for r in runs])}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--interval", type=int, default=1, help="--update-weights-interval of the async side")
    parser.add_argument("--async-buffer-size", type=int, default=1, help="rollouts generated ahead (async sides)")
    parser.add_argument("--sides", default="sync,async,async-thread",
                        help="which of sync, async, async-thread, async-tis to run (in this order in even rounds)")
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--max-rollouts", type=int, default=300)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    args = parser.parse_args()
    print(f"$ {' '.join(sys.argv)}  (cores {os.cpu_count()}, load {os.getloadavg()})")
    with tempfile.TemporaryDirectory(prefix="async-vs-sync-") as tmp:
        paths = prepare(Path(tmp) / "prep")
        sides = args.sides.split(",")
        results: dict[str, list[SideResult]] = {side: [] for side in sides}
        for round_ in range(args.rounds):
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                result = run_side(args, side, paths, Path(tmp) / f"{side}-{round_}")
                results[side].append(result)
                print(f"round {round_} {side}: {result.completions_per_s:.0f} completions/s, target "
                      f"{result.target_s and round(result.target_s, 1)} s at step {result.target_step}, "
                      f"{result.steps} steps, evals {result.evals}")
                for note in result.notes:
                    print(f"    {note}")
        print()
        for side, runs in results.items():
            print(*summary(side, runs))
        for side in sides[1:]:
            ratio = [a.completions_per_s / s.completions_per_s for s, a in zip(results[sides[0]], results[side],
                                                                              strict=True)]
            print(f"{side}/{sides[0]} completions/s per round: {', '.join(f'{r:.2f}x' for r in ratio)}; "
                  f"median {statistics.median(ratio):.2f}x")
        print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
