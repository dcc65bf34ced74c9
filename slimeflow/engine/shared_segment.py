"""Weight updates through a shared-memory file, for engines on the trainer's host: the CPU counterpart of the CUDA-IPC
handles SGLang's /update_weights_from_tensor takes from colocated trainers.

The trainer copies a bucket into a file under /dev/shm once (`SegmentWriter`) and sends its description as the one
entry of SGLang's `serialized_named_tensors`, with `load_format` LOAD_FORMAT; the engine maps the file and copies
straight from it into its parameters (`read_segment`), so the bytes cross no socket and are parsed by nobody. The
description is JSON (never a pickle): {"path", "size", "tensors": [[name, dtype, shape, offset], ...]}. The engine
maps only files named PREFIX* directly under /dev/shm, once, and keeps the mapping; once every engine has mapped it,
the trainer removes the file's name (`SegmentWriter.mapped`), so that a killed run leaves nothing in /dev/shm.
"""

from __future__ import annotations

import json
import os
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch

from slimeflow.engine.sampling import BadRequestError
from slimeflow.engine.weight_group import parse_dtype

SEGMENT_DIR = Path("/dev/shm")
PREFIX = "slimeflow-weights-"
LOAD_FORMAT = "slimeflow_shared_memory"
_ALIGN = 64


class SegmentWriter:
    """The trainer's segment: one file, grown when a bucket needs more, removed by `close` (or at exit)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.buffer: torch.Tensor | None = None
        self._finalizer: Any = None

    def write(self, part: dict[str, torch.Tensor]) -> str:
        """Copy `part` into the segment; its description, for the engine."""
        layout, offset = [], 0
        for name, tensor in part.items():
            layout.append((name, tensor, offset))
            offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        buffer = self._segment(max(offset, _ALIGN))
        for _, tensor, start in layout:
            nbytes = tensor.numel() * tensor.element_size()
            buffer[start:start + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        return json.dumps({"path": str(self.path), "size": buffer.numel(), "tensors": [
            [name, str(t.dtype).removeprefix("torch."), list(t.shape), start] for name, t, start in layout]})

    def _segment(self, size: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < size:
            self.close()
            self.path = SEGMENT_DIR / f"{PREFIX}{uuid.uuid4().hex}"
            with open(self.path, "wb") as file:
                file.truncate(size)
            self.buffer = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
            self._finalizer = weakref.finalize(self, _unlink, self.path)
        return self.buffer

    def mapped(self) -> None:
        """Every engine has mapped the segment: remove its name (the mappings, and so the memory, stay)."""
        if self._finalizer is not None:
            self._finalizer()

    def close(self) -> None:
        self.buffer = None
        if self._finalizer is not None:
            self._finalizer()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def read_segment(description: str, cache: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a SegmentWriter described, as views of the mapped file (`cache`: mappings by path, kept between
    updates); BadRequestError when the description is malformed or names another file."""
    try:
        spec = json.loads(description)
        path, size, entries = str(spec["path"]), int(spec["size"]), spec["tensors"]
    except (ValueError, KeyError, TypeError) as err:
        raise BadRequestError(f"{LOAD_FORMAT}: the description is not the trainer's segment JSON ({err})") from None
    buffer = cache.get(path)
    if buffer is None or buffer.numel() != size:
        buffer = _map(path, size)
        cache.clear()  # the trainer keeps one segment: an older mapping is of a file it replaced
        cache[path] = buffer
    tensors = {}
    try:
        for name, dtype, shape, offset in entries:
            kind = parse_dtype(dtype)
            count = 1
            for dim in shape:
                count *= int(dim)
            nbytes = count * kind.itemsize
            if not 0 <= int(offset) <= size - nbytes:
                raise ValueError(f"{name} at offset {offset} ({nbytes} bytes) is outside the {size}-byte segment")
            tensors[str(name)] = buffer[int(offset):int(offset) + nbytes].view(kind).view([int(d) for d in shape])
    except (ValueError, TypeError, RuntimeError) as err:
        raise BadRequestError(f"{LOAD_FORMAT}: {err}") from None
    return tensors


def _map(path: str, size: int) -> torch.Tensor:
    real = Path(os.path.realpath(path))
    if real.parent != SEGMENT_DIR or not real.name.startswith(PREFIX) or not real.is_file():
        raise BadRequestError(f"{LOAD_FORMAT}: {path!r} is not a {SEGMENT_DIR}/{PREFIX}* file")
    if real.stat().st_size < size:
        raise BadRequestError(f"{LOAD_FORMAT}: {path} holds {real.stat().st_size} bytes, fewer than {size}")
    return torch.from_file(str(real), shared=True, size=size, dtype=torch.uint8)
