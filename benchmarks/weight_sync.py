"""Weight sync into an embedded engine on the same host, against a memcpy of the same bytes.

    .venv/bin/python benchmarks/weight_sync.py [--hidden 768] [--layers 6] [--repeats 5] [--rollouts 8]
        [--transports tensor,shared_memory,distributed,ipc] [--model gguf:smollm2-135m-instruct | HF_DIR]

One engine process serves a random Llama-style model (float32; its size is printed), or with `--model` a real one
(a GGUF source is dequantized once into `--cache-dir`, as save_bench.py does; SmolLM2-135M is 538 MB in float32). For each transport the
trainer side uses ("tensor": safetensors bodies over HTTP; "shared_memory": what --colocate uses, the trainer
writes the tensors once into a /dev/shm segment, checking them for NaN/Inf as it copies, and the engine serves from
it; "distributed":
broadcast in a gloo group; "ipc": what colocated SGLang servers take, SGLang's /update_weights_from_tensor body of
flattened buckets shared through /dev/shm handles, which the engine maps and copies from), a `WeightSync` pushes the whole model `--repeats` times in buckets of `--buffer-mb`;
every push is timed from the call to the answer of the engine that has applied it (for the HTTP and gloo paths the
engine parses or receives the tensors, checks them for NaN/Inf and copies them into its parameters). The baseline is `Tensor.copy_` of the same tensors into preallocated ones in this process (one
memcpy, the least any update must do), timed just before each push, so that each pair sees the same load; the
figure is the median of the pairs' ratios (push bytes/s over memcpy bytes/s; goal >= 0.5x), with their spread
(min-max) and the load average before and after. The same ratio of CPU seconds (the trainer's process and every
thread of the engine's, against the memcpy's) is printed beside it: on a loaded machine the wall time of a push is
mostly its four thread wake-ups waiting for a core, which the CPU time leaves out.

Then the loop's pattern: `--rollouts` rollouts that push after every Nth (stages/train/loop.should_push), for N = 1
and 4, giving seconds of weight sync per rollout (medians over `--repeats` runs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from slimeflow.checkpoint.hf_source import materialise
from slimeflow.config.model import ModelConfig
from slimeflow.engine.launch import new_api_key, start_engine
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.storage import Storage
from slimeflow.stages.train.engines import WeightTargets
from slimeflow.stages.train.loop import should_push
from slimeflow.stages.train.weight_sync import WeightSync


def memcpy_seconds(weights: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(wall, CPU) seconds of copying `weights` into `targets`."""
    start, cpu = time.perf_counter(), time.process_time()
    for name, t in weights.items():
        targets[name].copy_(t)
    return time.perf_counter() - start, time.process_time() - cpu


def engine_cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of process `pid` so far (schedstat: nanoseconds, unlike /proc/PID/stat's ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


async def paired_seconds(sync: WeightSync, weights: dict[str, torch.Tensor], repeats: int, tag: str,
                         engine_pid: int) -> list[tuple[float, float, float, float]]:
    """(memcpy wall, push wall, memcpy CPU, push CPU of this process and the engine's, this process's alone) per push, each memcpy timed
    right before its push. Under load the wall times mostly wait for a core (each push wakes four threads in two
    processes); the CPU times count the passes over the bytes."""
    targets = {name: torch.empty_like(t) for name, t in weights.items()}
    memcpy_seconds(weights, targets)  # touch every page once: the engine's parameters are resident too
    await sync.push(weights, f"{tag}-warm")  # the distributed transport makes its group here
    rows = []
    for i in range(repeats):
        copy, copy_cpu = memcpy_seconds(weights, targets)
        start, cpu, engine_cpu = time.perf_counter(), time.process_time(), engine_cpu_seconds(engine_pid)
        await sync.push(weights, f"{tag}-{i}")
        push = time.perf_counter() - start
        trainer_cpu = time.process_time() - cpu
        push_cpu = trainer_cpu + engine_cpu_seconds(engine_pid) - engine_cpu
        rows.append((copy, push, copy_cpu, push_cpu, trainer_cpu))
    return rows


async def per_rollout_seconds(sync: WeightSync, weights: dict[str, torch.Tensor], interval: int,
                              rollouts: int) -> float:
    spent = 0.0
    for rollout_id in range(rollouts):
        if should_push(interval, rollout_id):
            start = time.perf_counter()
            await sync.push(weights, f"interval{interval}-{rollout_id}")
            spent += time.perf_counter() - start
    return spent / rollouts


def bench_model(args: argparse.Namespace, tmp: Path) -> Path:
    """The HF directory the engine serves: --model's, or a random Llama-style one of --hidden and --layers."""
    if args.model:
        return materialise(ModelConfig(hf_checkpoint=args.model, cache_dir=str(args.cache_dir)), Storage(),
                           args.cache_dir)
    spec = TinyModelSpec(seed=0, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                         intermediate_size=4 * args.hidden)
    return build_tiny_model(tmp / "model", spec)


def spread(values: list[float]) -> str:
    return f"{min(values):.4f}-{max(values):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rollouts", type=int, default=8, help="0: no per-rollout figures")
    parser.add_argument("--buffer-mb", type=float, default=512.0, help="--update-weight-buffer-size in MiB")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine and of the memcpy")
    parser.add_argument("--model", default=None, help="an HF directory or a GGUF source (default: a random model)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "slimeflow" / "bench-models")
    parser.add_argument("--transports", default="tensor,shared_memory,distributed",
                        help="comma-separated, of tensor, shared_memory, distributed, ipc")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the memcpy runs with the engine's thread count (OpenMP teams spin)
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "| load before:", os.getloadavg())

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(args, Path(tmp))
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        weights = {name: p.detach() for name, p in model.named_parameters()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        print(f"model: {nbytes / 2**20:.1f} MiB float32 in {len(weights)} tensors; buffer {args.buffer_mb:g} MiB")
        key = new_api_key()
        with start_engine(model_dir, num_threads=args.threads, api_key=key) as engine:
            targets = WeightTargets((engine.url,), str(model_dir), api_key=key)
            for transport in args.transports.split(","):
                sync = WeightSync(targets, int(args.buffer_mb * 2**20), transport)

                async def measure(sync: WeightSync = sync, transport: str = transport) -> tuple[list, dict]:
                    try:
                        pairs = await paired_seconds(sync, weights, args.repeats, transport, engine.process.pid)
                        per_rollout = {n: [await per_rollout_seconds(sync, weights, n, args.rollouts)
                                           for _ in range(args.repeats)] for n in ((1, 4) if args.rollouts else ())}
                        return pairs, per_rollout
                    finally:
                        await sync.aclose()

                pairs, per_rollout = asyncio.run(measure())
                copies, pushes = [row[0] for row in pairs], [row[1] for row in pairs]
                ratios = [c / p for c, p, *_ in pairs]
                cpu_ratios = [c / p for _, _, c, p, _ in pairs]
                trainer_cpu = statistics.median(row[4] for row in pairs)
                copy_cpu, push_cpu = (statistics.median(row[k] for row in pairs) for k in (2, 3))
                print(f"{transport}: median {statistics.median(pushes):.4f} s per update "
                      f"({nbytes / statistics.median(pushes) / 2**30:.2f} GiB/s; spread {spread(pushes)}) against "
                      f"memcpy {statistics.median(copies):.4f} s ({nbytes / statistics.median(copies) / 2**30:.2f} "
                      f"GiB/s; spread {spread(copies)}): {statistics.median(ratios):.2f}x memcpy (spread "
                      f"{min(ratios):.2f}-{max(ratios):.2f}); CPU time: memcpy {copy_cpu:.4f} s, push "
                      f"{push_cpu:.4f} s (trainer {trainer_cpu:.4f} + engine), {statistics.median(cpu_ratios):.2f}x (spread {min(cpu_ratios):.2f}-"
                      f"{max(cpu_ratios):.2f})" + ("" if not per_rollout else
                      f"; weight sync per rollout over "
                      f"{args.rollouts} rollouts: interval 1 {statistics.median(per_rollout[1]):.4f} s "
                      f"(spread {spread(per_rollout[1])}), interval 4 {statistics.median(per_rollout[4]):.4f} s "
                      f"(spread {spread(per_rollout[4])})"))
    print("load after:", os.getloadavg())


if __name__ == "__main__":
    main()
