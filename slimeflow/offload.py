"""Moving a trainer's state off its device and back, bit for bit (slime's --offload-train, colocated mode).

`StateOffload.offload(tensors)` frees the storage of every tensor given (each storage once: tied weights and views
into one buffer, such as Megatron's gradient buffer, stay tied) after copying its bytes out: on a GPU to pinned
host memory, on a CPU to a file in a directory of the run's scratch (unlinked at once, so a crash leaves nothing),
and hands the freed pages back (the CUDA cache, or glibc's heap), so the device memory, or the process's resident
memory, drops by about the bytes moved. `onload()` allocates each storage again and copies its bytes back; every
tensor object stays the one its owner (a module, an optimizer's state) holds, so nothing needs re-wiring.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch


def trim_heap() -> None:
    """glibc keeps freed heap pages for reuse; malloc_trim hands them back, so the process's resident memory drops."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident memory (RSS), in bytes."""
    return int(psutil.Process().memory_info().rss)


def module_tensors(module: torch.nn.Module | None) -> Iterator[torch.Tensor]:
    """A module's parameters, their gradients (`.grad`, and Megatron's `.main_grad` views into its gradient
    buffer) and its buffers."""
    if module is None:
        return
    for param in module.parameters():
        yield param
        for grad in (param.grad, getattr(param, "main_grad", None)):
            if isinstance(grad, torch.Tensor):
                yield grad
    yield from torch.nn.Module.buffers(module)  # Megatron's DDP wrapper shadows `buffers` with its grad buffers


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """The tensors a torch optimizer holds (its parameters, e.g. fp32 master copies, and their state: Adam's
    moments and step), unwrapping Megatron's optimizer (`.optimizer`) and chained optimizers."""
    if optimizer is None:
        return
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(inner, "optimizer", inner)
        for group in torch_optimizer.param_groups:
            yield from group["params"]
        for state in torch_optimizer.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int  # where its bytes start in the offload file (CPU storages)
    host: torch.Tensor | None = None


@dataclass
class OffloadReport:
    """What one offload did: bytes moved off the device, the process's resident memory before and after (on a GPU
    it grows by the pinned copies instead), and the GPU memory PyTorch gave back to the device (None on a CPU)."""

    moved_bytes: int
    rss_before: int
    rss_after: int
    device_freed_bytes: int | None = None

    def metrics(self, prefix: str) -> dict[str, float]:
        """The bytes moved and the memory they freed: the process's (rss_drop) on a CPU, the GPU's on a GPU."""
        freed = ({f"{prefix}/rss_drop_bytes": float(self.rss_before - self.rss_after)} if self.device_freed_bytes is None
                 else {f"{prefix}/device_freed_bytes": float(self.device_freed_bytes)})
        return {f"{prefix}/offloaded_bytes": float(self.moved_bytes), **freed}


@dataclass
class StateOffload:
    """Offloads a set of tensors' storages and restores them exactly. `directory`: where a CPU offload writes its
    file (the run's scratch); a GPU offload keeps the bytes in pinned host memory instead."""

    directory: Path
    _moved: list[_Moved] = field(default_factory=list)
    _file: Any = None

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    def offload(self, tensors: Iterable[torch.Tensor]) -> OffloadReport:
        """Copy out and free every distinct storage of `tensors`."""
        if self._moved:
            raise RuntimeError("the state is offloaded already: onload() it first")
        trim_heap()  # what was freed before is not this offload's to report
        rss_before = resident_bytes()
        storages = _distinct_storages(tensors)
        on_gpu = any(s.device.type == "cuda" for s in storages)
        reserved = torch.cuda.memory_reserved() if on_gpu else 0
        on_cpu = any(s.device.type == "cpu" for s in storages)
        if on_cpu:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f"offload-{os.getpid()}-", dir=self.directory)
            os.unlink(name)  # the open file keeps the bytes; nothing is left behind if this process dies
            self._file = os.fdopen(fd, "w+b", buffering=0)
        offset = 0
        for storage in storages:
            nbytes = storage.nbytes()
            if storage.device.type == "cpu":
                _write_all(self._file, _memory_of(storage))
                self._moved.append(_Moved(storage, nbytes, offset))
                offset += nbytes
            else:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                host.copy_(_bytes_of(storage))
                self._moved.append(_Moved(storage, nbytes, 0, host))
            storage.resize_(0)
        if on_gpu:
            torch.cuda.empty_cache()
        trim_heap()
        freed = reserved - torch.cuda.memory_reserved() if on_gpu else None
        return OffloadReport(sum(m.nbytes for m in self._moved), rss_before, resident_bytes(), freed)

    def onload(self) -> None:
        """Allocate every offloaded storage again and copy its bytes back (a no-op when nothing is offloaded)."""
        for moved in self._moved:
            moved.storage.resize_(moved.nbytes)
            if moved.host is not None:
                _bytes_of(moved.storage).copy_(moved.host)
            else:
                _read_all(self._file, moved.offset, _memory_of(moved.storage))
        self._moved = []
        if self._file is not None:
            self._file.close()
            self._file = None


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each storage behind `tensors` once (by device and address), every one resizable (see `_adopt`)."""
    users: dict[tuple[str, int], list[torch.Tensor]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            users.setdefault((str(storage.device), storage.data_ptr()), []).append(tensor)
    return [group[0].untyped_storage() if group[0].untyped_storage().resizable() else _adopt(group)
            for group in users.values()]


def _adopt(tensors: list[torch.Tensor]) -> torch.UntypedStorage:
    """Move `tensors`, which share a storage that cannot be resized (memory it does not own: transformers loads
    weights as views of the memory-mapped checkpoint), onto a copy of it that can; same offsets, sizes, strides."""
    shared = tensors[0].untyped_storage()
    own = torch.UntypedStorage(shared.nbytes(), device=shared.device)
    _bytes_of(own).copy_(_bytes_of(shared))
    with torch.no_grad():
        for tensor in dict.fromkeys(tensors):  # each tensor object once
            tensor.set_(own, tensor.storage_offset(), tensor.size(), tensor.stride())
    return own


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _memory_of(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage as a writable memoryview. Through ctypes, not numpy: a storage that has been
    exported to numpy is marked not resizable for good, and could not be freed again."""
    return memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


def _write_all(file: Any, data: memoryview) -> None:
    view = data
    while view:
        view = view[file.write(view):]


def _read_all(file: Any, offset: int, into: memoryview) -> None:
    view = into
    while view:
        got = os.preadv(file.fileno(), [view], offset)
        if got <= 0:
            raise RuntimeError(f"the offload file ended early: {len(view)} bytes missing at offset {offset}")
        view, offset = view[got:], offset + got
