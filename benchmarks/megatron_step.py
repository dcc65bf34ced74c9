"""The Megatron backend's training step against the torch backend's: same model, same batch, CPU, one thread.

A tiny Llama (--hidden-size, --layers; vocabulary of the tiny factory) is converted to torch_dist; both backends
start from the same weights in this one process (the Megatron backend in a one-rank gloo world) and alternate,
torch then Megatron, for --rounds rounds. A step is train_step's: prepare (advantages), forward and backward of
every micro-batch, the optimizer step. Printed: each backend's median and spread (min-max) of seconds per step,
wall and CPU time of this process (on a loaded machine the wall time mostly measures the wait for a core), the
ratio of medians (Megatron / torch; goal <= 1.15), and the load average before and after.

    .venv/bin/python benchmarks/megatron_step.py [--rounds 5] [--hidden-size 256] [--layers 4]
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

from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.stages.rl.config import TrainConfig
from slimeflow.stages.rl.types import TrainBatch


def make_batch(samples: int, prompt: int, response: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    totals = [prompt + response - (i % 7) * 4 for i in range(samples)]  # unequal lengths: real padding
    responses = [response - (i % 7) * 4 for i in range(samples)]
    tokens = [torch.randint(3, 250, (t,), generator=g) for t in totals]
    return TrainBatch(tokens=tokens, response_lengths=responses, loss_masks=[torch.ones(n) for n in responses],
                      rewards=torch.tensor([float(i % 2) for i in range(samples)]),
                      rollout_log_probs=[-torch.rand(n, generator=g) for n in responses])


def timed_step(backend, batch: TrainBatch, config: TrainConfig) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step."""
    from slimeflow.stages.rl.train_step import train_on_rollout

    started, cpu = time.perf_counter(), time.process_time()
    train_on_rollout(backend, batch, config, rank=backend.dp_rank, world_size=backend.dp_size)
    return time.perf_counter() - started, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=192)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, read_hf_source
    from slimeflow.stages.rl.backend.megatron_backend import MegatronBackend
    from slimeflow.stages.rl.backend.megatron_checkpoint import load_checkpoint
    from slimeflow.stages.rl.backend.torch_backend import TorchBackend

    tmp = Path(tempfile.mkdtemp(prefix="megatron-step-"))
    spec = TinyModelSpec(seed=1, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                         intermediate_size=4 * args.hidden_size, num_attention_heads=8, num_key_value_heads=4)
    hf = build_tiny_model(tmp / "hf", spec)
    staged, _ = convert_hf_to_torch_dist(read_hf_source(hf), tmp / "ckpt")
    release = staged.rename(tmp / "ckpt" / "release")
    config = TrainConfig(batch={"rollout_batch_size": args.samples // 2, "n_samples_per_prompt": 2, "num_rollout": 1,
                                "micro_batch_size": 4}, optimizer={"lr": 1e-5})
    batch = make_batch(args.samples, args.prompt, args.response)
    torch_backend = TorchBackend(hf, config.optimizer, config.algorithm, config.batch, device="cpu")
    megatron = MegatronBackend(hf, release, config.optimizer, config.algorithm, config.batch, config.megatron,
                               init_method=(tmp / "rendezvous").as_uri())
    load_checkpoint(megatron, release, weights_only=True)
    load_before = os.getloadavg()
    timed_step(torch_backend, batch, config), timed_step(megatron, batch, config)  # warm-up, not counted
    times: dict[str, list[float]] = {"torch": [], "megatron": []}
    cpu: dict[str, list[float]] = {"torch": [], "megatron": []}
    for _ in range(args.rounds):
        for name, backend in (("torch", torch_backend), ("megatron", megatron)):
            wall, seconds = timed_step(backend, batch, config)
            times[name].append(wall)
            cpu[name].append(seconds)
    megatron.close()
    load_after = os.getloadavg()
    params = sum(p.numel() for p in torch_backend.model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters (hidden {args.hidden_size}, {args.layers} layers); batch "
          f"{args.samples} samples of ~{args.prompt}+{args.response} tokens, micro-batches of 4; 1 thread")
    for label, table in (("wall", times), ("CPU", cpu)):
        for name, values in table.items():
            print(f"{label:4s} {name:9s} median {statistics.median(values):.3f} s/step, spread "
                  f"{min(values):.3f}-{max(values):.3f} ({args.rounds} rounds)")
        ratio = statistics.median(table["megatron"]) / statistics.median(table["torch"])
        print(f"{label:4s} megatron / torch: {ratio:.3f}x (goal <= 1.15)")
    print(f"load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
