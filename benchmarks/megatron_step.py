"""The Megatron backend's training step against the torch backend's: same model, same batch, CPU, one thread.

A tiny Llama (--hidden-size, --layers; vocabulary of the tiny factory) is converted to torch_dist; both backends
start from the same weights in this one process (the Megatron backend in a one-rank gloo world) and alternate,
torch then Megatron, for --rounds rounds. A step is train_step's: prepare (advantages), forward and backward of
every micro-batch, the optimizer step. Printed: each backend's median and spread (min-max) of seconds per step,
wall and CPU time of this process (on a loaded machine the wall time mostly measures the wait for a core), the
ratio of medians (Megatron / torch; goal <= 1.15), and the load average before and after.

With --parallel, the Megatron backend alone in worlds of two processes (one thread each), one layout after another
on the same model and batch: TP2, TP2 with sequence parallelism, DP2, DP2 with the distributed optimizer. Printed:
each layout's median wall seconds per step (rank 0's) and the ratios TP2+SP / TP2 and DP2+distopt / DP2.

    .venv/bin/python benchmarks/megatron_step.py [--rounds 5] [--hidden-size 256] [--layers 4] [--parallel]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from slimeflow.config.train import TrainConfig
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.rollout.types import TrainBatch


def make_batch(samples: int, prompt: int, response: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    totals = [prompt + response - (i % 7) * 4 for i in range(samples)]  # unequal lengths: real padding
    responses = [response - (i % 7) * 4 for i in range(samples)]
    tokens = [torch.randint(3, 250, (t,), generator=g) for t in totals]
    return TrainBatch(tokens=tokens, response_lengths=responses, loss_masks=[torch.ones(n) for n in responses],
                      rewards=torch.tensor([float(i % 2) for i in range(samples)]),
                      rollout_log_probs=[-torch.rand(n, generator=g) for n in responses])


def converted_model(tmp: Path, hidden_size: int, layers: int) -> tuple[Path, Path]:
    """The benchmarks' tiny Llama (8 heads, 4 KV heads, MLP 4 x hidden) as an HF directory and its torch_dist
    release, under `tmp`."""
    from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, read_hf_source

    spec = TinyModelSpec(seed=1, hidden_size=hidden_size, num_hidden_layers=layers,
                         intermediate_size=4 * hidden_size, num_attention_heads=8, num_key_value_heads=4)
    hf = build_tiny_model(tmp / "hf", spec)
    staged, _ = convert_hf_to_torch_dist(read_hf_source(hf), tmp / "ckpt")
    return hf, staged.rename(tmp / "ckpt" / "release")


def timed_step(backend, batch: TrainBatch, config: TrainConfig) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step."""
    from slimeflow.train.train_step import train_on_rollout

    started, cpu = time.perf_counter(), time.process_time()
    train_on_rollout(backend, batch, config, rank=backend.dp_rank, world_size=backend.dp_size)
    return time.perf_counter() - started, time.process_time() - cpu


LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2},
           "tp2+sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
           "dp2": {}, "dp2+distopt": {"use_distributed_optimizer": True}}
"""The --parallel layouts, each a world of two ranks: its Megatron flags (MegatronConfig fields)."""


def _rank_steps(rank: int, world: int, job: dict) -> None:
    """One rank of a --parallel world: load, one warm-up step, `rounds` timed steps; rank 0 writes its walls."""
    from slimeflow.train.backends.megatron.backend import MegatronBackend
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    config = job["config"]
    backend = MegatronBackend(job["hf"], job["release"], config.optimizer, config.algorithm, config.batch,
                              config.megatron, rank=rank, world_size=world, init_method=job["init"])
    try:
        load_checkpoint(backend, job["release"], weights_only=True)
        timed_step(backend, job["batch"], config)
        walls = [timed_step(backend, job["batch"], config)[0] for _ in range(job["rounds"])]
    finally:
        backend.close()
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(walls), encoding="utf-8")


def parallel_steps(tmp: Path, layout: str, job: dict, timeout: float = 900.0) -> list[float]:
    """Rank 0's wall seconds per step in a world of two spawned processes at `layout` (stopped by pid on timeout)."""
    import torch.multiprocessing as mp

    config = job["config"].model_copy(update={"megatron": job["config"].megatron.model_copy(update=LAYOUTS[layout])})
    job = {**job, "config": config, "init": (tmp / f"rendezvous-{layout}").as_uri(), "out": str(tmp / f"{layout}.json")}
    context = mp.start_processes(_rank_steps, args=(2, job), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{layout}: the two ranks did not finish in {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return json.loads(Path(job["out"]).read_text(encoding="utf-8"))


def report_parallel(tmp: Path, job: dict, rounds: int) -> None:
    load_before = os.getloadavg()
    medians = {layout: statistics.median(parallel_steps(tmp, layout, job)) for layout in LAYOUTS}
    load_after = os.getloadavg()
    for layout, median in medians.items():
        print(f"wall {layout:12s} median {median:.3f} s/step ({rounds} rounds, rank 0, 2 processes x 1 thread)")
    print(f"tp2+sp / tp2: {medians['tp2+sp'] / medians['tp2']:.3f}x; "
          f"dp2+distopt / dp2: {medians['dp2+distopt'] / medians['dp2']:.3f}x")
    print(f"load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=192)
    parser.add_argument("--parallel", action="store_true", help="TP2, TP2+SP, DP2, DP2+distopt in 2-process worlds")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from slimeflow.train.backends.megatron.backend import MegatronBackend
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint
    from slimeflow.train.backends.torch.backend import TorchBackend

    tmp = Path(tempfile.mkdtemp(prefix="megatron-step-"))
    hf, release = converted_model(tmp, args.hidden_size, args.layers)
    config = TrainConfig(batch={"rollout_batch_size": args.samples // 2, "n_samples_per_prompt": 2, "num_rollout": 1,
                                "micro_batch_size": 4}, optimizer={"lr": 1e-5})
    batch = make_batch(args.samples, args.prompt, args.response)
    if args.parallel:
        report_parallel(tmp, {"hf": str(hf), "release": str(release), "config": config, "batch": batch,
                              "rounds": args.rounds}, args.rounds)
        return 0
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
