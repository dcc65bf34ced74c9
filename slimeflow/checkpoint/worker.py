"""One rank of an HF -> torch_dist conversion: `python -m slimeflow.checkpoint.worker JOB.json RANK`.

Every rank joins a process group (gloo; NCCL when it has a GPU) through the job's `init_method`, reads only the
HF tensors of its share (lazily, one tensor at a time from memory-mapped safetensors): its layers, and of a MoE
model its slice of every MoE layer's routed experts, as expert parallelism splits them. It maps them to Megatron's
names and fusions, and writes them in megatron-core's torch_dist format (torch_dist.save_torch_dist), its experts
as its slice of the expert axis; rank 0's common.pt carries the args. Each rank leaves `rank-<r>.json` next to the
job file: what it read (tensors, bytes, which experts), what it held and wrote, and its peak RSS. Run as its own
process (never imported into a caller's process): a process group is process-global. A rank dies with its
launcher (slimeflow/supervise.py).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import struct
import sys
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch

from slimeflow.checkpoint.diskspace import no_space_left, ran_out_of_space
from slimeflow.checkpoint.mapping import (
    ModelShape,
    dense_rules,
    expert_hf_tensors,
    expert_rows,
    hf_to_megatron,
    megatron_args,
)
from slimeflow.checkpoint.torch_dist import ExpertRows, RowBlocks, save_torch_dist
from slimeflow.supervise import die_with_parent

JOB_TIMEOUT = timedelta(minutes=60)


@dataclass(frozen=True)
class Share:
    """What one rank converts: its layers (their tensors other than the routed experts), its global (non-layer)
    Megatron tensors, and its slice [start, stop) of the routed experts, in every MoE layer."""

    layers: tuple[int, ...]
    globals_: tuple[str, ...]
    experts: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Job:
    """Everything a rank needs, written as JSON by the stage (see stage.py `_launch`)."""

    hf_dir: str
    weight_map: dict[str, str]
    """HF tensor name -> safetensors file name inside hf_dir."""
    shape: dict[str, Any]
    dtype: str
    make_vocab_size_divisible_by: int
    tensor_model_parallel_size: int
    checkpoint_dir: str
    iteration: int
    init_method: str
    shares: list[Share]

    def write(self, path: Path) -> None:
        data = {**self.__dict__, "shares": [s.__dict__ for s in self.shares]}
        path.write_text(json.dumps(data, indent=1), encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> Job:
        data = json.loads(path.read_text(encoding="utf-8"))
        shares = [Share(tuple(s["layers"]), tuple(s["globals_"]), tuple(s["experts"])) for s in data.pop("shares")]
        return cls(**data, shares=shares)


class LazySafetensors(Mapping[str, torch.Tensor]):
    """HF tensors by name, each a zero-copy view of its own memory map of its bytes in its safetensors file.

    A tensor's pages become resident only when they are read, and are unmapped when the tensor is freed. So a
    tensor that only feeds a fusion leaves nothing resident once the fused tensor is made, and one passed on
    unchanged is never read here: the writer has the kernel copy its bytes file to file (`source`). (safetensors'
    `get_tensor` maps the whole file for as long as its handle lives, so every page this process reads stays
    resident.)
    """

    def __init__(self, directory: str | Path, weight_map: Mapping[str, str]):
        self._directory = Path(directory)
        self._weight_map = dict(weight_map)
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}
        self.read: dict[str, int] = {}
        """Bytes of each tensor handed out so far, by name: what this rank loaded."""
        self._sources: dict[int, tuple[weakref.ref, Path, int, int]] = {}
        """Address of each map's tensor -> (the map, its file, offset and bytes there): see `source`."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.rows(name, 0, None)

    def rows(self, name: str, start: int, stop: int | None) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (stop None: to the end), mapped on their own: the tensor's storage
        is exactly these rows, so torch.save writes them without copying them out first."""
        path = self._directory / self._weight_map[name]
        data_start, header = self._header(path)
        entry = header[name]
        dtype, shape = _DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = (data_start + offset for offset in entry["data_offsets"])
        if shape:
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            stop = shape[0] if stop is None else stop
            if not 0 <= start <= stop <= shape[0]:
                raise IndexError(f"{name}: rows [{start}, {stop}) of a tensor of {shape[0]} rows")
            shape[0] = stop - start
            begin, end = begin + start * row_bytes, begin + stop * row_bytes
        self.read[name] = self.read.get(name, 0) + end - begin
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        aligned = begin - begin % mmap.ALLOCATIONGRANULARITY  # a map starts on a page boundary
        with path.open("rb") as file:  # the map outlives the descriptor; ACCESS_COPY: writable, never written back
            mapped = mmap.mmap(file.fileno(), end - aligned, offset=aligned, access=mmap.ACCESS_COPY)
        tensor = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin - aligned)
        self._sources[tensor.data_ptr()] = (weakref.ref(mapped), path, begin, end - begin)
        return tensor.view(shape)

    def source(self, tensor: torch.Tensor) -> tuple[Path, int] | None:
        """(file, offset) of the bytes of `tensor` when it is the whole of one of the maps handed out here (or a view
        of all of one), else None: the writer then copies them file to file (dcp_format.write_items). Only while
        the map lives (its tensors hold it), so that its address is not another's; the conversion never writes
        into these tensors (mapping.py makes new ones), so their bytes are the file's."""
        entry = self._sources.get(tensor.data_ptr())
        if entry is None or entry[0]() is None or not tensor.is_contiguous():
            return None
        _, path, offset, nbytes = entry
        return (path, offset) if tensor.numel() * tensor.element_size() == nbytes else None

    def _header(self, path: Path) -> tuple[int, dict[str, Any]]:
        """(offset of the data, the header's JSON) of a safetensors file: 8-byte length, JSON, data."""
        if path.name not in self._headers:
            with path.open("rb") as file:
                (length,) = struct.unpack("<Q", file.read(8))
                self._headers[path.name] = (8 + length, json.loads(file.read(length)))
        return self._headers[path.name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
"""safetensors dtypes the stage accepts (stage.py validates this before any rank starts)."""


def peak_rss_bytes() -> dict[str, int]:
    """Peak resident memory of this process (VmHWM).

    Not getrusage(RUSAGE_SELF): Linux carries a forking parent's high-water mark across fork and exec into it,
    so a rank started by a large process would report that process's peak. VmHWM belongs to this process's own
    address space.
    """
    status = Path("/proc/self/status")
    own = next((int(line.split()[1]) * 1024 for line in status.read_text().splitlines()
                if line.startswith("VmHWM:")), 0) if status.is_file() else 0
    return {"peak_rss": own}


def share_tensors(hf: Mapping[str, torch.Tensor], shape: ModelShape, share: Share
                  ) -> dict[str, torch.Tensor | ExpertRows | RowBlocks]:
    """The Megatron tensors of `share`, from HF-named ones: fused tensors (QKV, gate/up) as their HF rows and
    routed experts as theirs, written unassembled (no copy of the model in memory)."""
    tensors: dict[str, torch.Tensor | ExpertRows | RowBlocks] = dict(
        hf_to_megatron(hf, shape, share.layers, share.globals_, dense_rules(shape), row_blocks=True))
    if share.experts[1] > share.experts[0]:  # its slice of every MoE layer's routed experts
        tensors.update(expert_rows(hf, shape, range(*share.experts)))
    return tensors


def convert_share(job: Job, rank: int) -> dict[str, Any]:
    """Convert and save rank `rank`'s share; returns the count and bytes of the tensors it held and wrote, its
    expert slice, what it read (HF tensors, bytes, the experts among them), and when (Unix time) its tensors
    were read and saved."""
    shape = ModelShape(**job.shape)
    dtype = getattr(torch, job.dtype)
    share = job.shares[rank]
    hf = LazySafetensors(job.hf_dir, job.weight_map)
    tensors = share_tensors(hf, shape, share)
    args = megatron_args(shape, dtype, job.make_vocab_size_divisible_by, job.tensor_model_parallel_size)
    counts = {"tensors": len(tensors), "bytes": sum(t.nbytes if isinstance(t, (ExpertRows, RowBlocks)) else
                                                    t.numel() * t.element_size() for t in tensors.values()),
              "experts": list(share.experts), "read_tensors": len(hf.read), "read_bytes": sum(hf.read.values()),
              "read_experts": [e for e in range(shape.num_experts) if any(
                  name in hf.read for layer in range(shape.num_layers) for name in expert_hf_tensors(shape, layer, [e]))]}
    read = time.time()
    try:
        save_torch_dist(tensors, args, job.checkpoint_dir, job.iteration, hf.source)
    except Exception as err:
        if ran_out_of_space(err, Path(job.checkpoint_dir), counts["bytes"]):
            raise no_space_left(Path(job.checkpoint_dir), f"rank {rank}'s share", counts["bytes"]) from err
        raise
    return {**counts, "read_at": read, "saved_at": time.time()}


def _backend(rank: int) -> str:
    """NCCL when this rank sees a GPU (a rank then takes one, round robin; its tensors stay on the CPU and only
    the gathering of the checkpoint's index runs on it), gloo otherwise."""
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return "nccl"
    return "gloo"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimeflow.checkpoint.worker")
    parser.add_argument("job", type=Path)
    parser.add_argument("rank", type=int)
    parser.add_argument("--parent-pid", type=int, help="end this rank when that process (the launcher) ends")
    options = parser.parse_args(argv)
    started = time.time()
    if options.parent_pid is not None:
        die_with_parent(options.parent_pid)
    job = Job.read(options.job)
    torch.distributed.init_process_group(_backend(options.rank), init_method=job.init_method, rank=options.rank,
                                         world_size=len(job.shares), timeout=JOB_TIMEOUT)
    try:
        written = convert_share(job, options.rank)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    result = {"rank": options.rank, "started_at": started, **written, **peak_rss_bytes()}
    (options.job.parent / f"rank-{options.rank}.json").write_text(json.dumps(result), encoding="utf-8")
    return 0


def process_main() -> NoReturn:
    """A rank process's entry (launch.py starts it with the collector disabled: the imports and the conversion
    make no garbage worth 0.1 s of collections). After a successful `main` its checkpoint files are fsynced,
    its report written and its process group destroyed, so the process ends at once: the interpreter's
    teardown of torch and gigabytes of tensors took 0.37-0.41 s and did nothing for anyone.
    A failure raises as usual, and the interpreter prints it and exits 1."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
