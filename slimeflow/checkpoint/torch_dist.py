"""Megatron's torch_dist checkpoint: written as megatron-core's `dist_checkpointing` writes it, read back as tensors.

Writing is collective: every rank of the default process group calls `save_torch_dist` with its own share of
the Megatron-named tensors (mapping.py's names: `decoder.layers.<i>.<name>` per layer, plus globals), and each
layer tensor becomes the chunk [i] of the layer-stacked global tensor `decoder.layers.<name>`, exactly as
megatron-core's GPTModel.sharded_state_dict() declares it. Linear layers also get their (empty) `_extra_state`
objects, as GPTModel has them, so that Megatron-LM loads the checkpoint with its default strictness. The files
are written directly (dcp_format), without importing megatron-core or torch.distributed.checkpoint: their
imports were most of a conversion rank's start-up, and the format needs neither; megatron-core loads the result
(tests/integration/test_convert.py loads it into its GPTModel).

Reading needs no process group: the checkpoint is a PyTorch Distributed Checkpoint, loaded key by key.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from slimeflow.checkpoint import safe_pickle
from slimeflow.checkpoint.dcp_format import (
    ByteItem,
    Source,
    TensorChunk,
    Written,
    object_bytes,
    write_items,
    write_metadata,
    write_synced,
)
from slimeflow.supervise import periodically

if TYPE_CHECKING:  # integrity imports slimeflow.io: a conversion worker's start-up need not
    from slimeflow.checkpoint.integrity import Ledger

CHECKPOINT_VERSION = 3.0
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_LINEARS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
"""Linear layers of each expert (dim 0 of the per-layer tensor), whose `_extra_state` is sharded over experts."""


def _has_extra_state(module: str, leaf: str) -> bool:
    """megatron-core checkpoints an (empty) `_extra_state` next to the weight of every linear layer
    (`...linear_<x>.weight`: linear_qkv, linear_proj, linear_fc1/2, MLA's linear_q/kv_*_proj)."""
    return leaf == "weight" and module.rsplit(".", 1)[-1].startswith("linear_")


@dataclass(frozen=True)
class ExpertRows:
    """A routed-expert tensor [experts, rows, ...] given by its rows and never assembled: `parts[i]`, concatenated on
    dim 0, is the row of expert `first + i` of `total` (fc1: gate, up; fc2: down), each part an equal block. Each
    part is written as a shard of its own, as it is: a memory-mapped HF tensor goes from the page cache to the
    checkpoint in the forked writer, and nothing copies the experts' bytes in the converting process."""

    first: int
    total: int
    parts: list[list[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for parts in self.parts for part in parts)


@dataclass(frozen=True)
class RowBlocks:
    """A fused tensor given by its row blocks and never assembled: `parts`, concatenated on dim 0, is the tensor
    (QKV: each query group's query, key and value rows; gate/up: the gate's rows, then the up projection's). Each
    part is written as a shard of its own at its row offset, as ExpertRows are: a memory-mapped HF tensor's rows go
    from the page cache to the checkpoint in the forked writer. The parts may differ in rows (a query group's query
    rows against its key's), so the shards form an irregular grid, which torch's checkpoint validates."""

    parts: list[torch.Tensor]

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(part.shape[0] for part in self.parts), *self.parts[0].shape[1:])

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts)


def checkpoint_items(tensors: Mapping[str, torch.Tensor | ExpertRows | RowBlocks], num_layers: int,
                     stacked: bool = True) -> list[TensorChunk | ByteItem]:
    """This rank's items of the checkpoint, keyed as megatron-core's GPTModel.sharded_state_dict() declares them:
    each tensor as chunks of its global tensor, and the (empty) `_extra_state` of each linear layer as a byte item
    (a ShardedObject, keyed `<key>/shard_<offsets>_<shape>`).

    `stacked`: layer i's tensor is chunk [i] of `decoder.layers.<name>` [num_layers, ...]; else (layers that differ,
    megatron-core's non-homogeneous layers) it is the whole of `decoder.layers.<i>.<name>`. A routed-expert tensor
    may be given as ExpertRows (a rank's experts, or all of them), and a fused one as RowBlocks, whose parts become
    the chunks."""
    out: list[TensorChunk | ByteItem] = []
    empty = object_bytes(None)
    for name, tensor in tensors.items():
        match = _LAYER.match(name)
        if match is None:
            out.append(TensorChunk(name, tuple(tensor.shape), (0,) * tensor.dim(), tensor))
            continue
        layer, inner = int(match.group(1)), match.group(2)
        prefix, outer, offsets = ("decoder.layers.", (num_layers,), (layer,)) if stacked else \
            (f"decoder.layers.{layer}.", (), ())
        module, leaf = inner.rsplit(".", 1)
        if isinstance(tensor, ExpertRows):
            out.extend(_expert_chunks(prefix + inner, tensor, outer, offsets))
            experts, total = range(tensor.first, tensor.first + len(tensor.parts)), tensor.total
        elif isinstance(tensor, RowBlocks):
            out.extend(_row_chunks(prefix + inner, tensor, outer, offsets))
            experts, total = range(tensor.shape[0]), tensor.shape[0]
        else:
            data = tensor.view(*[1] * len(outer), *tensor.shape)
            out.append(TensorChunk(prefix + inner, (*outer, *tensor.shape), (*offsets, *[0] * tensor.dim()), data))
            experts, total = range(tensor.shape[0]), tensor.shape[0]
        extra = f"{prefix}{module}._extra_state"
        if module in _EXPERT_LINEARS:
            if leaf == "weight":
                out.extend(ByteItem(_object_key(extra, (*offsets, expert), (*outer, total)), empty)
                           for expert in experts)
        elif _has_extra_state(module, leaf):
            # megatron-core gives an object with no sharded axis the shape (1,)
            out.append(ByteItem(_object_key(extra, offsets or (0,), outer or (1,)), empty))
    return out


def _object_key(key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """megatron-core's ShardedObject.unique_key."""
    return f"{key}/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def _expert_chunks(key: str, rows: ExpertRows, outer: tuple[int, ...], offsets: tuple[int, ...]) -> list[TensorChunk]:
    """One chunk per part of each expert's row of `key` [*outer, experts, parts * part rows, ...]: block j of the
    rows of expert e (the parts are equal blocks)."""
    out = []
    for i, parts in enumerate(rows.parts):
        for j, part in enumerate(parts):
            size = (*outer, rows.total, part.shape[0] * len(parts), *part.shape[1:])
            at = (*offsets, rows.first + i, j * part.shape[0], *[0] * (part.dim() - 1))
            out.append(TensorChunk(key, size, at, part.view(*[1] * (len(outer) + 1), *part.shape)))
    return out


def _row_chunks(key: str, rows: RowBlocks, outer: tuple[int, ...], offsets: tuple[int, ...]) -> list[TensorChunk]:
    """One chunk per row block of `key` [*outer, rows, ...], at its row offset (blocks may differ in rows)."""
    out, row = [], 0
    for part in rows.parts:
        out.append(TensorChunk(key, (*outer, *rows.shape), (*offsets, row, *[0] * (part.dim() - 1)),
                               part.view(*[1] * len(outer), *part.shape)))
        row += part.shape[0]
    return out


def save_torch_dist(tensors: MutableMapping[str, torch.Tensor | ExpertRows | RowBlocks], args: argparse.Namespace,
                    checkpoint_dir: str | Path, iteration: int = 1, source: Source | None = None,
                    collective: bool = True, ledger: Ledger | None = None) -> None:
    """Write this rank's share of a torch_dist checkpoint into `checkpoint_dir` (collective over all ranks of the
    default process group, if there is one); its routed experts may be ExpertRows and its fused tensors RowBlocks
    (checkpoint_items). Rank r writes its items into `__<r>_<n>.distcp` (dcp_format, WRITERS files); rank 0 gathers where every
    rank's went and writes `.metadata`, then common.pt (`args`, `checkpoint_version`, `iteration`) and
    metadata.json, as megatron-core's dist_checkpointing.save does with its torch_dist strategy.

    `source`: where a tensor's bytes lie as they are in a file (worker.LazySafetensors.source), to copy them from
    there (dcp_format.write_items). Empties `tensors`, and writes each item once it holds the only reference to
    its data (write_items): a tensor memory-mapped from an HF file is unmapped once written, so that the rank's
    peak resident memory is about its largest tensor, not its share (mapped pages count while mapped).

    `checkpoint_dir` is the checkpoint directory itself (e.g. <root>/iter_0000001); committing it (the tracker)
    is the caller's job, after every rank has returned: slimeflow.io.checkpoints.commit. `collective=False`: this
    process writes every tensor alone, whatever process group it is in (a training rank saving the whole model).
    `ledger`: the data files are hashed while they are written, for integrity.write_checksums (dcp_format.write_items).
    """
    # megatron-core keys each layer on its own when MoE and dense layers alternate (moe_layer_freq a list).
    items = checkpoint_items(tensors, args.num_layers, not isinstance(getattr(args, "moe_layer_freq", 1), list))
    tensors.clear()
    directory = Path(checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    distributed = collective and torch.distributed.is_initialized()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)
    files = _split_by_bytes(items, WRITERS)
    del items
    with without_crc32(), write_behind(directory, f"__{rank}_*.distcp"), \
            ThreadPoolExecutor(len(files), thread_name_prefix="write") as pool:
        writes = [pool.submit(write_items, directory / f"__{rank}_{n}.distcp", share, source, ledger)
                  for n, share in enumerate(files)]
        written = [item for write in writes for item in write.result()]
    gathered: list[list[Written]] | None = [[] for _ in range(world)] if rank == 0 else None
    if distributed:
        torch.distributed.gather_object(written, gathered, dst=0)
    else:
        gathered = [written]
    if rank == 0:
        write_metadata(directory, [item for share in gathered for item in share])
        write_synced(directory / "common.pt", lambda file: torch.save(
            {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}, file))
        write_synced(directory / MEGATRON_CONFIG, lambda file: file.write(json.dumps(_MEGATRON_BACKENDS).encode()))


def without_crc32() -> AbstractContextManager:
    """torch.save without the CRC32 of its zip records: it costs more CPU than the write (~0.5 GB/s against ~2 GB/s)
    and no reader checks it (torch.load does not; our checkpoints' checksums.json covers every file)."""
    from torch.utils.serialization import config as serialization

    return serialization.patch({"save.compute_crc32": False})


WRITERS = 2
"""Data files per rank, each written by a thread of its own: the kernel's copies (copy_file_range, which releases
the GIL) of one run beside the other's. Their bytes balanced (_split_by_bytes)."""


def _split_by_bytes(items: list[TensorChunk | ByteItem], parts: int) -> list[list[TensorChunk | ByteItem | None]]:
    """`items` in `parts` lists (none empty), in order, each item to the list with the fewest bytes so far."""
    out: list[list[TensorChunk | ByteItem | None]] = [[] for _ in range(min(parts, len(items)) or 1)]
    loads = [0] * len(out)
    for item in items:
        smallest = loads.index(min(loads))
        out[smallest].append(item)
        loads[smallest] += len(item.data) if isinstance(item, ByteItem) else item.tensor.numel() * item.tensor.element_size()
    return out


MEGATRON_CONFIG = "metadata.json"
_MEGATRON_BACKENDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                      "common_backend_version": 1}
"""metadata.json: how megatron-core's dist_checkpointing wrote the checkpoint (its CheckpointingConfig)."""


WRITE_BEHIND_INTERVAL_S = 0.05
_SYNC_FILE_RANGE_WRITE = 2
"""sync_file_range(2) flag: start writing the range's dirty pages out, without waiting for them."""


@functools.cache
def _start_writeback_syscall() -> Callable[[int], object] | None:
    """`fd -> sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)` from the C library (Python has no binding);
    None off Linux, where `write_behind` then does nothing."""
    if not sys.platform.startswith("linux"):
        return None
    call = ctypes.CDLL(None, use_errno=True).sync_file_range
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return lambda fd: call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


@contextmanager
def write_behind(directory: Path, pattern: str, interval: float = WRITE_BEHIND_INTERVAL_S,
                 start_writeback: Callable[[int], object] | None = None) -> Iterator[None]:
    """While the body runs, every `interval` seconds, ask the kernel to start writing out the dirty pages of
    each file in `directory` that matches `pattern` (a glob), so that the writers' closing fsync finds most of
    them on disk already.

    dist_checkpointing's forked writers write their whole share into the page cache and only then fsync it: the
    disk idles while they write, and the writers idle while it flushes. Overlapping the two took 0.35-0.4 s off
    a 2 GB conversion here (2.84 -> 2.44-2.48 s). Only a hint: a file that vanishes or a call that fails is
    skipped, and the body's own fsyncs are what make the data durable. `start_writeback(fd)` defaults to
    sync_file_range(2) with SYNC_FILE_RANGE_WRITE; off Linux there is none and this does nothing.
    """
    start_writeback = start_writeback or _start_writeback_syscall()
    if start_writeback is None:
        yield
        return
    opened: dict[Path, int] = {}

    def tick() -> None:
        for path in directory.glob(pattern):
            try:
                fd = opened.get(path)
                if fd is None:
                    if not path.is_file():  # a FIFO, say: opening it would wait for a writer, forever
                        continue
                    fd = opened[path] = os.open(path, os.O_RDONLY)
                start_writeback(fd)
            except OSError:
                continue

    try:
        with periodically(interval, tick, "write-behind"):
            yield
    finally:
        for fd in opened.values():
            os.close(fd)


def read_common(checkpoint_dir: str | Path) -> dict:
    """common.pt: `args`, `checkpoint_version`, `iteration`. Unpickled without running code from it (safe_pickle:
    classes off its allow-list become inert placeholders), so an untrusted checkpoint can be read."""
    return safe_pickle.torch_load(Path(checkpoint_dir) / "common.pt")


def read_dcp_metadata(checkpoint_dir: str | Path):
    """`.metadata`, torch.distributed.checkpoint's index of the checkpoint, unpickled as read_common does."""
    path = Path(checkpoint_dir) / ".metadata"
    return safe_pickle.loads(path.read_bytes(), path)


def _reader(checkpoint_dir: str | Path):
    """torch's FileSystemReader, except that it reads `.metadata` with read_dcp_metadata (torch unpickles it)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_dcp_metadata(checkpoint_dir)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(checkpoint_dir))


def tensor_metadata(checkpoint_dir: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every tensor in the checkpoint (from `.metadata`; objects left out)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(checkpoint_dir)
    return {key: (tuple(meta.size), meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}


def load_torch_dist(checkpoint_dir: str | Path, keys: Iterable[str] | None = None
                    ) -> tuple[dict[str, torch.Tensor], argparse.Namespace]:
    """The global tensors of a torch_dist checkpoint directory (only `keys` if given) and its Megatron args.

    Optimizer state (keys containing 'optimizer') is skipped unless asked for by key.
    """
    import torch.distributed.checkpoint as dcp

    available = tensor_metadata(checkpoint_dir)
    wanted = [k for k in available if "optimizer" not in k] if keys is None else list(keys)
    missing = [k for k in wanted if k not in available]
    if missing:
        raise KeyError(f"{checkpoint_dir} has no tensor {missing[0]!r} ({len(missing)} missing)")
    state = {k: torch.empty(available[k][0], dtype=available[k][1]) for k in wanted}
    dcp.load(state, storage_reader=_reader(checkpoint_dir), no_dist=True)
    return state, read_common(checkpoint_dir)["args"]


def unstack_layers(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Global tensors -> mapping.py's names: `decoder.layers.<name>` [L, ...] becomes L tensors
    `decoder.layers.<i>.<name>` (views, no copy); other tensors (a layer's own, `decoder.layers.<i>.<name>`, too)
    pass through."""
    out = {}
    for key, tensor in tensors.items():
        if key.startswith("decoder.layers.") and not _LAYER.match(key):
            inner = key.removeprefix("decoder.layers.")
            out.update({f"decoder.layers.{i}.{inner}": tensor[i] for i in range(tensor.shape[0])})
        else:
            out[key] = tensor
    return out
