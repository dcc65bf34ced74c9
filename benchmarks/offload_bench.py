"""--offload-train's hand-over on this machine: StateOffload of a model's weights, gradients and Adam state against
a memcpy of the same bytes (the limit of any copy) and a plain write + read of them to the same directory (what a
file costs at all), in one run; plus the resident memory each offload gave back.

    .venv/bin/python benchmarks/offload_bench.py --mib 256 --rounds 5 [--dir /path/on/the/scratch/disk]

On a GPU the state goes to pinned host memory instead (the gpu-marked test in tests/unit/test_offload.py checks it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from slimeflow.offload import StateOffload, module_tensors, optimizer_tensors


def state(weight_mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers holding `weight_mib` MiB of weights, one Adam step taken: weights, grads and two moments."""
    side = 1024
    layers = max(1, weight_mib * 2**20 // (side * side * 4))
    model = torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(2, side)).sum().backward()
    optimizer.step()
    return model, optimizer


def plain_file(tensors: list[torch.Tensor], directory: Path) -> float:
    """Seconds to write every tensor's bytes to a file in `directory` and read them back into it (through ctypes,
    as StateOffload: a tensor once exported to numpy could not be freed by the next offload)."""
    views = [memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")
             for t in tensors]
    started = time.perf_counter()
    with tempfile.TemporaryFile(dir=directory, buffering=0) as file:
        for view in views:
            file.write(view)
        file.seek(0)
        for view in views:
            file.readinto(view)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes of state in all (weights + grads + Adam)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, optimizer = state(args.mib // 4)
    tensors = list(dict.fromkeys([*module_tensors(model), *optimizer_tensors(optimizer)]))
    offload = StateOffload(args.dir)
    rows = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        report = offload.offload(tensors)
        moved = time.perf_counter() - started
        started = time.perf_counter()
        offload.onload()
        back = time.perf_counter() - started
        copies = [t.detach().clone() for t in tensors]  # warm the destination once: a memcpy into fresh pages
        started = time.perf_counter()
        with torch.no_grad():
            for copy, t in zip(copies, tensors, strict=True):
                copy.copy_(t)
                t.copy_(copy)
        memcpy = time.perf_counter() - started
        del copies
        rows.append((moved + back, memcpy, plain_file(tensors, args.dir), report))
    total, memcpy, plain = (statistics.median(r[i] for r in rows) for i in range(3))
    report = rows[-1][3]
    print(f"command: {' '.join(sys.argv)}; load average {os.getloadavg()[0]:.1f}")
    print(f"state {report.moved_bytes / 2**20:.0f} MiB; offload + onload {total:.3f} s (median of {args.rounds}); "
          f"memcpy there and back {memcpy:.3f} s ({memcpy / total:.2f}x of it); plain file write + read "
          f"{plain:.3f} s ({plain / total:.2f}x); resident memory given back {(report.rss_before - report.rss_after) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
