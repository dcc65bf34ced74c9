"""The cost of running the log-prob pass in the training steps' micro-batches (issue: first-step ppo_kl under
--use-dynamic-batch-size) against packing the rank's whole share at once, as the pass did before.

One tiny Llama (benchmarks/megatron_step.py's), a rollout of --samples unequal samples split into optimizer steps of
--global-batch-size, packed under --max-tokens-per-gpu. Each backend (torch; Megatron in a one-rank gloo world)
computes the old policy's log-probs of the whole rollout both ways, alternating, --rounds times after one warm-up
of each. Printed: the micro-batch count and padded tokens of each plan, each way's median and spread (min-max) of
wall and CPU seconds, the ratio of medians (per step / whole share), and the load average before and after.

    .venv/bin/python benchmarks/log_prob_plan.py [--rounds 3] [--samples 32] [--global-batch-size 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from megatron_step import converted_model, make_batch

from slimeflow.config.train import TrainConfig


def plans(backend, batch, global_batch_size: int) -> dict[str, list[list[list[int]]] | None]:
    """The two ways: None (the backend packs the whole batch, one step) and the training steps' micro-batches."""
    from slimeflow.train.train_step import plan_steps, step_micro_batches

    lengths = batch.total_lengths
    steps = [step_micro_batches(backend, lengths, share) for _, share in plan_steps(batch, global_batch_size, 0, 1, False)]
    return {"whole share": None, "per step": steps}


def padded_tokens(micro_batches: list[list[int]], lengths: list[int]) -> int:
    """Tokens the forward runs: each micro-batch's rows right-padded to its longest."""
    return sum(len(m) * max(lengths[i] for i in m) for m in micro_batches)


def timed(backend, batch, steps) -> tuple[float, float]:
    started, cpu = time.perf_counter(), time.process_time()
    backend.compute_log_probs(batch, steps=steps)
    return time.perf_counter() - started, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from slimeflow.train.backends.megatron.backend import MegatronBackend
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint
    from slimeflow.train.backends.torch.backend import TorchBackend

    tmp = Path(tempfile.mkdtemp(prefix="log-prob-plan-"))
    hf, release = converted_model(tmp, args.hidden_size, args.layers)
    config = TrainConfig(batch={"rollout_batch_size": args.samples // 2, "n_samples_per_prompt": 2, "num_rollout": 1,
                                "global_batch_size": args.global_batch_size, "use_dynamic_batch_size": True,
                                "max_tokens_per_gpu": args.max_tokens_per_gpu}, optimizer={"lr": 1e-5})
    batch = make_batch(args.samples, 64, 192)
    lengths = batch.total_lengths
    backends = {"torch": TorchBackend(hf, config.optimizer, config.algorithm, config.batch, device="cpu"),
                "megatron": MegatronBackend(hf, release, config.optimizer, config.algorithm, config.batch,
                                            config.megatron, init_method=(tmp / "rendezvous").as_uri())}
    load_checkpoint(backends["megatron"], release, weights_only=True)
    ways = plans(backends["torch"], batch, args.global_batch_size)
    for way, steps in ways.items():
        micros = backends["torch"].micro_batches(lengths) if steps is None else [m for s in steps for m in s]
        print(f"{way:11s}: {len(micros)} micro-batches, {padded_tokens(micros, lengths)} padded tokens "
              f"(of {sum(lengths)})")
    load_before = os.getloadavg()
    walls = {(name, way): [] for name in backends for way in ways}
    cpus = {(name, way): [] for name in backends for way in ways}
    for backend in backends.values():
        for steps in ways.values():
            timed(backend, batch, steps)  # warm-up, not counted
    for _ in range(args.rounds):
        for name, backend in backends.items():
            for way, steps in ways.items():
                wall, cpu = timed(backend, batch, steps)
                walls[name, way].append(wall)
                cpus[name, way].append(cpu)
    backends["megatron"].close()
    load_after = os.getloadavg()
    print(f"{args.samples} samples of ~256 tokens, steps of {args.global_batch_size}, --max-tokens-per-gpu "
          f"{args.max_tokens_per_gpu}, 1 thread, {args.rounds} rounds")
    for label, table in (("wall", walls), ("CPU", cpus)):
        for name in backends:
            for way in ways:
                values = table[name, way]
                print(f"{label:4s} {name:8s} {way:11s} median {statistics.median(values):.3f} s, spread "
                      f"{min(values):.3f}-{max(values):.3f}")
            ratio = statistics.median(table[name, "per step"]) / statistics.median(table[name, "whole share"])
            print(f"{label:4s} {name:8s} per step / whole share: {ratio:.3f}x")
    print(f"load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
