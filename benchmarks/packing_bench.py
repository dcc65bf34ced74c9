"""Packing into micro-batches vs padding to the longest sample, on long-tailed RL-like lengths.

Samples are prompt + response tokens: prompts lognormal (median 150), responses lognormal (median 1,500,
sigma 0.9) cut at 8,192 (the max response length, where truncated responses pile up). For each batch size and
token budget (max_tokens_per_gpu) it prints: micro-batches used by pack_micro_batches vs the lower bound
ceil(total tokens / budget), the budget utilisation (total / (micro-batches x budget)), and the same for the
baseline of fixed-size micro-batches padded to the longest sample (the largest count that fits the budget at the
longest sample), with the ratio of micro-batches padded / packed, all measured in the same run. Also with --balance-data over 8 data-parallel ranks (each rank packed on its
own, every rank running the largest rank's count).

    .venv/bin/python benchmarks/packing_bench.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

from slimeflow.train.packing import pack_micro_batches, padded_micro_batches, split_for_data_parallel

MAX_RESPONSE = 8192


def rollout_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(16, int(rng.lognormvariate(math.log(150), 0.5)))
            + min(MAX_RESPONSE, max(1, int(rng.lognormvariate(math.log(1500), 0.9)))) for _ in range(n)]


def measure(lengths: list[int], budget: int) -> dict[str, float]:
    start = time.perf_counter()
    packed = pack_micro_batches(lengths, budget)
    seconds = time.perf_counter() - start
    padded = padded_micro_batches(lengths, budget)
    total = sum(lengths)
    return {"bound": math.ceil(total / budget), "packed": len(packed), "util": total / (len(packed) * budget),
            "padded": len(padded), "padded_util": total / (len(padded) * budget), "ms": seconds * 1e3}


def measure_dp(lengths: list[int], budget: int, dp: int) -> dict[str, float]:
    ranks = split_for_data_parallel(lengths, dp, balance_data=True)
    counts = [len(pack_micro_batches([lengths[i] for i in r], budget)) for r in ranks]
    bound = max(math.ceil(sum(lengths[i] for i in r) / budget) for r in ranks)
    return {"bound": bound, "packed": max(counts), "util": sum(lengths) / (dp * max(counts) * budget)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print("command:", " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    print(f"{'samples':>7} {'budget':>6} | {'bound':>5} {'packed':>6} {'over':>4} {'util':>6} | "
          f"{'padded':>6} {'pad-util':>8} | {'padded/packed':>13} {'pack ms':>7}")
    worst_util, worst_over = 1.0, 0
    for n in (256, 1024):
        for budget in (16384, 32768):
            for seed in range(args.seeds):
                r = measure(rollout_lengths(n, seed), budget)
                worst_util, worst_over = min(worst_util, r["util"]), max(worst_over, r["packed"] - r["bound"])
                print(f"{n:>7} {budget:>6} | {r['bound']:>5} {r['packed']:>6} {r['packed'] - r['bound']:>4} "
                      f"{r['util']:>6.1%} | {r['padded']:>6} {r['padded_util']:>8.1%} | "
                      f"{r['padded'] / r['packed']:>12.2f}x {r['ms']:>7.1f}")
    print(f"packing alone: worst utilisation {worst_util:.1%} (goal >= 95%), worst excess over the bound "
          f"{worst_over} micro-batch(es) (goal <= 1)")
    print("\nbalance_data over 8 DP ranks, 1024 samples (each rank runs the largest rank's micro-batch count):")
    for budget in (16384, 32768):
        for seed in range(args.seeds):
            r = measure_dp(rollout_lengths(1024, seed), budget, 8)
            print(f"  budget {budget:>6} seed {seed}: per-rank bound {r['bound']:>3}, micro-batches {r['packed']:>3}, "
                  f"utilisation {r['util']:.1%}")


if __name__ == "__main__":
    main()
