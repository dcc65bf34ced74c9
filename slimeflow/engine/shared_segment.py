"""Weight updates through shared memory, for engines on the trainer's host: the CPU counterpart of the CUDA-IPC
handles SGLang's /update_weights_from_tensor takes from colocated trainers.

The trainer writes each tensor of a weight version once into a file under /dev/shm (`SegmentWriter`) and sends
each bucket's description as the one entry of SGLang's `serialized_named_tensors`, with `load_format`
LOAD_FORMAT; the engine maps the file (`read_segment`), checks the names and shapes and makes its parameters views
of them: no serialisation, no socket, no copy on the engine's side. The description is JSON (never a pickle):
{"path", "size", "tensors": [[name, dtype, shape, offset], ...], "finite": true}.

The trainer checks that every value is finite while it copies it in (finite_copy.py: one pass over the bytes) and
refuses a version that holds NaN or Inf, naming the tensors, before any engine sees it; "finite": true tells the
engine that this check was made, so it does not read every byte again (a description without it is checked there).

Because engines serve from the segment, the trainer keeps two (slots) and writes a version into the one no engine
serves from: version k goes to slot k % 2 only once every engine has taken version k - 1 from the other slot
(`commit`). After a failed push no slot is known to be free (an engine may have taken part of it), so both are
dropped (`abandon`) and the next push writes fresh files; engines keep their mappings of the old ones for as long
as they serve from them. The engine maps only files named PREFIX* directly under /dev/shm, once, and keeps the
mappings of the last two; once every engine has mapped a file, the trainer removes its name (`mapped`), so that a
killed run leaves nothing in /dev/shm.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimeflow.engine.finite_copy import copy_checked
from slimeflow.engine.sampling import BadRequestError
from slimeflow.engine.weight_group import parse_dtype

SEGMENT_DIR = Path("/dev/shm")
PREFIX = "slimeflow-weights-"
LOAD_FORMAT = "slimeflow_shared_memory"
MAPPINGS_KEPT = 2
"""Segments an engine keeps mapped: the trainer's two slots."""
_ALIGN = 64


class NonFiniteWeightsError(ValueError):
    """A weight version holds NaN or Inf values: refused by the trainer before any engine read it."""


@dataclass(frozen=True)
class SegmentUpdate:
    """The tensors a description names, as views of the mapped segment, and whether the trainer checked that
    every value is finite (then the engine need not)."""

    tensors: dict[str, torch.Tensor]
    finite: bool


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Segment:
    """One /dev/shm file mapped into this process; its name is removed by `unlink` (or at exit)."""

    def __init__(self, size: int) -> None:
        self.path = SEGMENT_DIR / f"{PREFIX}{uuid.uuid4().hex}"
        with open(self.path, "wb") as file:
            try:  # reserve the pages now: a full tmpfs would otherwise kill the first write into them (SIGBUS)
                os.posix_fallocate(file.fileno(), 0, size)
            except OSError as err:
                _unlink(self.path)
                raise OSError(err.errno, f"{SEGMENT_DIR} has no room for a {size}-byte weight segment ({err.strerror}"
                              f"; {shutil.disk_usage(SEGMENT_DIR).free} bytes free): enlarge it (docker "
                              "--shm-size) or use --update-weight-transport nccl") from None
        self.buffer = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
        self.unlink = weakref.finalize(self, _unlink, self.path)


class SegmentWriter:
    """The trainer's two slots. A push is `begin` (the bytes of the whole version), `write` per bucket (its
    description), then `commit` once every engine took every bucket, or `abandon` when any did not."""

    def __init__(self) -> None:
        self.slots: list[_Segment | None] = [None, None]
        self.serving = 1  # the slot of the last committed version; the next version goes to the other one
        self._writing: int | None = None
        self._offset = 0

    @property
    def current(self) -> _Segment | None:
        """The slot being written, or else the one served from (None before the first push)."""
        return self.slots[self.serving if self._writing is None else self._writing]

    @property
    def path(self) -> Path | None:
        return self.current.path if self.current is not None else None

    @property
    def buffer(self) -> torch.Tensor | None:
        return self.current.buffer if self.current is not None else None

    def begin(self, named_tensors: Any) -> None:
        """Start a version of these tensors in the slot no engine serves from (a new file when it is too small)."""
        size = max(_ALIGN, sum(_aligned(_nbytes(t)) for t in named_tensors.values()))
        target = 1 - self.serving
        slot = self.slots[target]
        if slot is None or slot.buffer.numel() < size:
            if slot is not None:
                slot.unlink()
            self.slots[target] = _Segment(size)
        self._writing, self._offset = target, 0

    def write(self, part: dict[str, torch.Tensor], version: str | None = None) -> str:
        """Copy `part` into the slot after the buckets written before it, checking every value; its description,
        for the engine. NonFiniteWeightsError (naming the tensors and `version`) when any holds NaN or Inf."""
        if self._writing is None:
            raise RuntimeError("SegmentWriter.write before begin: start each version with begin(all its tensors)")
        segment = self.slots[self._writing]
        assert segment is not None
        entries, bad = [], []
        for name, tensor in part.items():
            nbytes, start = _nbytes(tensor), self._offset
            if start + nbytes > segment.buffer.numel():
                raise ValueError(f"bucket tensor {name} ({nbytes} bytes) does not fit the version begun: pass "
                                 "every tensor of the version to begin")
            at = copy_checked(segment.buffer[start:start + nbytes].view(tensor.dtype).view(tensor.shape),
                              tensor.detach())
            if at is not None:
                bad.append(f"{name} (element {at} of {tensor.numel()})")
            entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), start])
            self._offset = start + _aligned(nbytes)
        if bad:
            raise NonFiniteWeightsError(
                f"weight version {version!r} refused before any engine read it: {len(bad)} of {len(part)} tensors "
                f"hold NaN or Inf values, first at {', '.join(bad[:5])}; the engines keep serving the version they "
                "had. The trainer's weights diverged: check its loss and grad norm (a lower --lr, --clip-grad) or "
                "the checkpoint the weights came from")
        return json.dumps({"path": str(segment.path), "size": segment.buffer.numel(), "tensors": entries,
                           "finite": True})

    def mapped(self) -> None:
        """Every engine has mapped the slot being written: remove its name (the mappings, and the memory, stay)."""
        if self._writing is not None and self.slots[self._writing] is not None:
            self.slots[self._writing].unlink()

    def commit(self) -> None:
        """Every engine serves the version just written: its slot is now the one not to write."""
        if self._writing is not None:
            self.serving, self._writing = self._writing, None

    def abandon(self) -> None:
        """A push failed: no slot is known to be unserved, so write the next version into new files."""
        self.close()

    def close(self) -> None:
        for slot in self.slots:
            if slot is not None:
                slot.unlink()
        self.slots, self.serving, self._writing = [None, None], 1, None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def read_segment(description: str, cache: dict[str, torch.Tensor]) -> SegmentUpdate:
    """The tensors a SegmentWriter described, as views of the mapped file (`cache`: mappings by path, in order of
    use, kept between updates; views outlive their mapping's entry); BadRequestError when the description is
    malformed or names another file."""
    try:
        spec = json.loads(description)
        path, size, entries = str(spec["path"]), int(spec["size"]), spec["tensors"]
        finite = spec.get("finite") is True
    except (ValueError, KeyError, TypeError) as err:
        raise BadRequestError(f"{LOAD_FORMAT}: the description is not the trainer's segment JSON ({err})") from None
    buffer = cache.pop(path, None)
    if buffer is None or buffer.numel() != size:
        buffer = _map(path, size)
    cache[path] = buffer  # the most recent last: the trainer's two slots stay, a file it replaced goes
    while len(cache) > MAPPINGS_KEPT:
        cache.pop(next(iter(cache)))
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
    return SegmentUpdate(tensors, finite)


def _map(path: str, size: int) -> torch.Tensor:
    real = Path(os.path.realpath(path))
    if real.parent != SEGMENT_DIR or not real.name.startswith(PREFIX) or not real.is_file():
        raise BadRequestError(f"{LOAD_FORMAT}: {path!r} is not a {SEGMENT_DIR}/{PREFIX}* file")
    if real.stat().st_size < size:
        raise BadRequestError(f"{LOAD_FORMAT}: {path} holds {real.stat().st_size} bytes, fewer than {size}")
    return torch.from_file(str(real), shared=True, size=size, dtype=torch.uint8)
