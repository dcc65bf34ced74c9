"""A training save of the torch backend, synchronous and with --async-save, against `cp -r` of the same bytes.

    .venv/bin/python benchmarks/save_bench.py [--model gguf:smollm2-135m-instruct | HF_DIR | tiny:...]
        [--repeats 5] [--dir DIR] [--cache-dir ~/.cache/slimeflow/bench-models]

The backend (torch, CPU, AdamW with its state made by one step) saves rollout i with torch/checkpoint.py's
save_checkpoint, the path the loop's save takes: weights, optimizer and scheduler state, RNG states, extra state,
checksums, the rename into place and the tracker. Right after each save, `cp -r` copies a fresh tree of the same
files (a copy of that checkpoint made before the timer starts, so its pages are as cached as the backend's
in-memory tensors are) to a new directory beside it. The figure is the median over the pairs of save seconds over
cp seconds (goal <= 2x), in wall time and in CPU seconds (this process and its children: a save's subprocesses,
cp), with the spread and the load average before and after. A third figure times `cp -r` followed by an fsync of
every copied file: a save fsyncs its files (a checkpoint must survive a crash), a bare cp leaves them in the page
cache, so this is the like-for-like durable copy. The page cache cannot be dropped here, so every read comes from
it; all three write the same bytes.

An --async-save (`save_checkpoint(..., async_save=True)`) is timed twice: its blocking time (until the call
returns: what the training loop waits for, the snapshot of weights and optimizer state into reused host buffers)
and its time to durable (until `wait_for_save` returns: the checkpoint written, hashed, fsynced, renamed and
committed). The blocking time is compared with bare `cp -r`, the time to durable with cp + fsync. Here nothing
runs beside the background commit; in a run, training shares the cores with it.

`--model gguf:...` dequantizes the GGUF file once into `--cache-dir` (about a minute) and reuses it after.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from slimeflow.checkpoint.hf_source import materialise
from slimeflow.config.model import ModelConfig
from slimeflow.config.train import TrainConfig
from slimeflow.io.storage import Storage
from slimeflow.train.backends.torch.backend import TorchBackend
from slimeflow.train.backends.torch.checkpoint import save_checkpoint

DEFAULT_CACHE = Path.home() / ".cache" / "slimeflow" / "bench-models"


def model_dir(spec: str, cache_dir: Path) -> Path:
    """An HF directory for `spec` (a GGUF source or a tiny: URI is materialised once under `cache_dir`)."""
    return materialise(ModelConfig(hf_checkpoint=spec, cache_dir=str(cache_dir)), Storage(), cache_dir)


def cpu_seconds() -> float:
    """User + system seconds of this process and of its waited-for children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(work) -> tuple[float, float]:
    start, cpu = time.perf_counter(), cpu_seconds()
    work()
    return time.perf_counter() - start, cpu_seconds() - cpu


def copy_and_fsync(source: Path, target: Path) -> None:
    """`cp -r`, then fsync every copied file: the same bytes made as durable as a save makes its own (its fsyncs)."""
    subprocess.run(["cp", "-r", str(source), str(target)], check=True)
    for path in target.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def make_backend(hf_dir: Path) -> TorchBackend:
    """The backend with AdamW's state allocated (one step on zero gradients), as after a rollout's training."""
    config = TrainConfig(batch={"rollout_batch_size": 1, "num_rollout": 10})
    backend = TorchBackend(hf_dir, config.optimizer, config.algorithm, config.batch, device="cpu", total_steps=10)
    for p in backend.model.parameters():
        p.grad = torch.zeros_like(p)
    backend.optimizer.step()
    backend.optimizer.zero_grad(set_to_none=True)
    return backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gguf:smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary directory under /tmp)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "| load before:", os.getloadavg())
    hf_dir = model_dir(args.model, args.cache_dir)
    backend = make_backend(hf_dir)
    params = sum(p.numel() for p in backend.model.parameters())
    print(f"model {hf_dir}: {params / 1e6:.1f}M parameters ({params * 4 / 1e6:.0f} MB float32)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root, async_root, rows, async_rows = Path(tmp) / "ckpt", Path(tmp) / "async-ckpt", [], []
        for i in range(args.repeats + 1):  # the first pair warms both paths up and is not counted
            if i % 2:  # the two saves take turns going first: the second writes behind the first's writeback
                blocking, to_durable = timed_async_save(backend, async_root, i)
            save = timed(lambda i=i: save_checkpoint(backend, root, i, {"rollout_id": i}))
            if not i % 2:
                blocking, to_durable = timed_async_save(backend, async_root, i)
            saved = root / f"iter_{i:07d}"
            source, target = Path(tmp) / f"src-{i}", Path(tmp) / f"dst-{i}"
            shutil.copytree(saved, source)
            copy = timed(lambda s=source, t=target: subprocess.run(["cp", "-r", str(s), str(t)], check=True))
            durable_target = Path(tmp) / f"dst-synced-{i}"
            durable = timed(lambda s=source, t=durable_target: copy_and_fsync(s, t))
            nbytes = tree_bytes(saved)
            for path in (saved, source, target, durable_target):
                shutil.rmtree(path)
            if i:
                rows.append((*save, *copy, *durable))
                async_rows.append((blocking, to_durable))
                print(f"  pair {i}: save {save[0]:.2f} s ({save[1]:.2f} CPU s), async save {blocking:.2f} s blocking "
                      f"/ {to_durable:.2f} s to durable, cp {copy[0]:.2f} s ({copy[1]:.2f} CPU s), cp + fsync "
                      f"{durable[0]:.2f} s, {nbytes / 1e6:.0f} MB", flush=True)
    wall = [r[0] / r[2] for r in rows]
    cpu = [r[1] / r[3] for r in rows]
    durable_wall = [r[0] / r[4] for r in rows]
    print(f"save: median {statistics.median(r[0] for r in rows):.2f} s wall, {statistics.median(r[1] for r in rows):.2f}"
          f" CPU s; cp -r: {statistics.median(r[2] for r in rows):.2f} s wall, "
          f"{statistics.median(r[3] for r in rows):.2f} CPU s ({nbytes / 1e6:.0f} MB); save / cp: wall "
          f"{statistics.median(wall):.2f}x (spread {min(wall):.2f}-{max(wall):.2f}), CPU {statistics.median(cpu):.2f}x "
          f"(spread {min(cpu):.2f}-{max(cpu):.2f}); goal <= 2x")
    print(f"cp -r then fsync of every copied file (a durable copy, as a save is): "
          f"{statistics.median(r[4] for r in rows):.2f} s wall; save / that: {statistics.median(durable_wall):.2f}x "
          f"(spread {min(durable_wall):.2f}-{max(durable_wall):.2f})")
    report_async(rows, async_rows)
    print("load after:", os.getloadavg())


def timed_async_save(backend: TorchBackend, root: Path, i: int) -> tuple[float, float]:
    """An --async-save of rollout `i` under `root`: (seconds until it returns, seconds until it is committed)."""
    start = time.perf_counter()
    save_checkpoint(backend, root, i, {"rollout_id": i}, async_save=True)
    blocking = time.perf_counter() - start
    backend.wait_for_save()
    to_durable = time.perf_counter() - start
    shutil.rmtree(root / f"iter_{i:07d}")
    return blocking, to_durable


def report_async(rows: list[tuple[float, ...]], async_rows: list[tuple[float, float]]) -> None:
    """--async-save: blocking time over bare cp (goal <= 2x), time to durable over cp + fsync, per pair."""
    blocking = [a[0] / r[2] for a, r in zip(async_rows, rows, strict=True)]
    durable = [a[1] / r[4] for a, r in zip(async_rows, rows, strict=True)]
    print(f"async save: blocking median {statistics.median(a[0] for a in async_rows):.2f} s, / cp -r "
          f"{statistics.median(blocking):.2f}x (spread {min(blocking):.2f}-{max(blocking):.2f}); goal <= 2x")
    print(f"async save: to durable median {statistics.median(a[1] for a in async_rows):.2f} s, / cp + fsync "
          f"{statistics.median(durable):.2f}x (spread {min(durable):.2f}-{max(durable):.2f})")


if __name__ == "__main__":
    main()
