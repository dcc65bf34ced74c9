"""SGLang's own body of POST /update_weights_from_tensor, both ways: what slime's colocated trainer sends, and what
the embedded engine reads back.

The body is {"serialized_named_tensors": [one entry per SGLang TP rank], "load_format", "flush_cache",
"weight_version"}. An entry is SGLang's MultiprocessingSerializer text: base64 of a pickle made by
multiprocessing's ForkingPickler with torch.multiprocessing's reductions, so that a tensor travels as a handle to
its memory, never as its bytes. With load_format "flattened_bucket" (slime's, newer SGLang) an entry holds
{"flattened_tensor": one uint8 tensor, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx,
numel), ...]}, byte offsets into it; with load_format None, a list of (name, tensor) pairs.

Handles are node-local: a CUDA tensor goes as a CUDA IPC handle (the device named by its UUID, as SGLang's patched
reductions do, since the two processes number their visible GPUs differently), a CPU tensor as a /dev/shm file
shared through torch's file_system strategy (chosen per pickler here, never by changing torch's global strategy: the
default file-descriptor strategy only reaches processes that share the sender's multiprocessing authkey).

The reader never runs an arbitrary pickle: `_Unpickler` resolves only the torch rebuild functions, storage and
tensor classes, dtypes and the metadata class, so a crafted body fails as a bad request.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import io
import logging
import os
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

import torch
import torch.multiprocessing.reductions as reductions

from slimeflow.engine.sampling import BadRequestError

log = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"
LOAD_FORMATS = (None, FLATTENED_BUCKET)
_SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "sglang.srt.model_executor.model_runner")
"""Where SGLang keeps FlattenedTensorMetadata (newer, older): the class a pickle names for SGLang to rebuild."""
_SGLANG_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch")
_ALIGN = 16
_DEVICE_ARG = 6
"""The position of the device index in the arguments of torch's rebuild_cuda_tensor."""
T = TypeVar("T")


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket (SGLang's fields): bytes start_idx:end_idx of the flat uint8 tensor hold it."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _sglang_attr(modules: tuple[str, ...], name: str) -> Any:
    """SGLang's own object where SGLang is installed (so that its server can rebuild what names it), else None."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def metadata_class() -> type:
    """SGLang's FlattenedTensorMetadata where SGLang is installed, else ours (the embedded engine reads both)."""
    found = _sglang_attr(_SGLANG_METADATA[:1], "FlattenedTensorMetadata")
    if found is not None:
        bucket = _sglang_attr(_SGLANG_METADATA[:1], "FlattenedTensorBucket")
        if not getattr(bucket, "supports_multi_dtypes", False):
            raise RuntimeError("the installed SGLang's FlattenedTensorBucket takes one dtype per bucket; slimeflow "
                               "sends slime's multi-dtype buckets (uint8 bytes): install a newer SGLang or use "
                               "--update-weight-transport nccl")
    return found or FlattenedTensorMetadata


# --- the sender's side ---------------------------------------------------------------------------------------------


MANAGER_PATIENCE_S = 60.0
"""How long a call into torch's shared memory manager is made again before its error stands. libshm gives the
torch_shm_manager one second to answer (a poll in its socket's recv), which a busy machine missed: at load 14-24, on
the sender's side moving a buffer into /dev/shm and on the engine's opening it, for five seconds in a row once (the
manager's process not scheduled, or its pages read back in). A manager stopped for 3 s and then continued answers
the next call at once (its late reply is read then), so waiting is what helps, not giving up."""
TIMED_OUT = "Shared memory manager connection has timed out"


def patiently(call: Callable[..., T], *args: Any) -> T:
    """`call(*args)`, made again while the shared memory manager does not answer within libshm's second, for up to
    MANAGER_PATIENCE_S: that failure happens while connecting, before anything is allocated or moved, so the same
    call is safe to repeat. Any other error stands at once."""
    deadline, warned = time.monotonic() + MANAGER_PATIENCE_S, False
    while True:
        try:
            return call(*args)
        except RuntimeError as err:
            if TIMED_OUT not in str(err):
                raise
            if time.monotonic() >= deadline:
                raise RuntimeError(f"torch's shared memory manager (torch_shm_manager, a child of process "
                                   f"{os.getpid()}) did not answer for {MANAGER_PATIENCE_S:.0f} s: is the machine "
                                   f"overloaded, or the manager stopped? ({TIMED_OUT})") from err
            if not warned:
                log.warning("torch's shared memory manager did not answer within a second (a busy machine?); "
                            "asking again for up to %.0f s", MANAGER_PATIENCE_S)
                warned = True


def _reduce_cpu_storage(storage: torch.UntypedStorage) -> tuple:
    """torch's file_system reduction of a CPU storage, for this pickler only: it moves the storage into a /dev/shm
    file (hence senders pass fresh buffers, never live weights) and keeps it alive for the receiver."""
    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)  # raises torch's own message
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    metadata = patiently(storage._share_filename_cpu_)
    storage._shared_incref()  # the receiver's rebuild gives it back
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return (reductions.rebuild_storage_filename, (type(storage), *metadata))


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    """torch's tensor reduction; for a CUDA tensor the device goes by UUID, rebuilt by SGLang's function where SGLang
    is installed (its server allows that one), else by ours."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = (*args[:_DEVICE_ARG], str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid),
                *args[_DEVICE_ARG + 1:])
        rebuild = _sglang_attr(_SGLANG_CUDA_REBUILD, "_rebuild_cuda_tensor_modified") or rebuild_cuda_tensor_by_uuid
    return rebuild, args


class _Pickler(ForkingPickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage
        for kind in (torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[kind] = _reduce_tensor


def serialize(obj: Any) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True): tensors as handles, base64 text."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class SendBuffer:
    """Where a sender flattens its buckets. On a CPU one /dev/shm buffer, grown as needed and reused bucket after
    bucket: the embedded engine has copied a bucket when it answers, and the pages are faulted in once, not per push.
    On a GPU a fresh buffer per bucket, as slime does: SGLang may still be copying from it after its answer."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # the old one goes before the new one is allocated
            fresh = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            patiently(fresh.untyped_storage()._share_filename_cpu_)  # into /dev/shm once; then only named
            self.buffer = fresh
        return self.buffer[:nbytes]


def flatten(named_tensors: Mapping[str, torch.Tensor], buffers: SendBuffer | None = None) -> dict[str, Any]:
    """SGLang's flattened bucket of these tensors (any dtypes, one device): every tensor's bytes in one uint8 tensor
    (from `buffers`, else new) on the tensors' device, and their metadata."""
    cls = metadata_class()
    metadata, spans, start = [], [], 0
    for name, tensor in named_tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(cls(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=start, end_idx=start + nbytes,
                            numel=nbytes))
        spans.append((tensor, start, nbytes))
        # Each tensor starts _ALIGN-aligned (the reader's slices name their bytes, so the gaps are never read): a
        # float32 after a bfloat16 of odd length would otherwise not view in place.
        start += nbytes + (-nbytes % _ALIGN)
    devices = {t.device for t in named_tensors.values()} or {torch.device("cpu")}
    if len(devices) > 1:
        raise ValueError(f"a flattened bucket's tensors lie on one device; these lie on {sorted(map(str, devices))}")
    flat = (buffers or SendBuffer()).take(start, devices.pop())
    for tensor, offset, nbytes in spans:
        flat[offset:offset + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return {"flattened_tensor": flat, "metadata": metadata}


def update_body(named_tensors: Mapping[str, torch.Tensor], *, tp_size: int = 1, version: str | None = None,
                load_format: str | None = FLATTENED_BUCKET, flush_cache: bool = False,
                buffers: SendBuffer | None = None) -> tuple[dict, Any]:
    """The body of one bucket for an engine of `tp_size` ranks (each rank reads its own entry: the same full
    tensors, which SGLang shards), and what it points at, to keep alive until the engine has answered. `buffers`:
    the sender's SendBuffer (flattened buckets)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")
    if load_format == FLATTENED_BUCKET:
        payload: Any = flatten(named_tensors, buffers)
    else:  # fresh buffers: a shared CPU storage moves into /dev/shm, which the trainer's weights must not
        payload = [(name, t.detach().clone(memory_format=torch.contiguous_format)) for name, t in named_tensors.items()]
    entry = serialize(payload)
    body = {"serialized_named_tensors": [entry] * tp_size, "load_format": load_format, "flush_cache": flush_cache}
    if version is not None:
        body["weight_version"] = version
    return body, payload


# --- the engine's side ---------------------------------------------------------------------------------------------


def rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """torch's rebuild_cuda_tensor with the device given by UUID (as SGLang's patched reductions send it)."""
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        found = [i for i in range(torch.cuda.device_count())
                 if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not found:
            raise BadRequestError(f"the CUDA tensor's device {device} is not visible to this engine; CUDA IPC handles "
                                  "reach engines on the sender's node and GPUs only")
        args = (*args[:_DEVICE_ARG], found[0], *args[_DEVICE_ARG + 1:])
    return reductions.rebuild_cuda_tensor(*args)


def rebuild_storage_filename_patiently(*args: Any) -> torch.UntypedStorage:
    """torch's rebuild_storage_filename, asked again when the sender's shared memory manager is slow (patiently)."""
    return patiently(reductions.rebuild_storage_filename, *args)


_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): rebuild_storage_filename_patiently,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): rebuild_cuda_tensor_by_uuid,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("slimeflow.engine.tensor_ipc", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("slimeflow.engine.tensor_ipc", "rebuild_cuda_tensor_by_uuid"): rebuild_cuda_tensor_by_uuid,
    **{(module, "FlattenedTensorMetadata"): FlattenedTensorMetadata for module in _SGLANG_METADATA},
    **{(module, "_rebuild_cuda_tensor_modified"): rebuild_cuda_tensor_by_uuid for module in _SGLANG_CUDA_REBUILD},
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name == "rebuild_storage_fd":
            raise BadRequestError("a CPU tensor was shared by file descriptor (torch's default strategy), which only "
                                  "a child process can open; share it through /dev/shm (the file_system strategy: "
                                  "slimeflow.engine.tensor_ipc.serialize does)")
        raise BadRequestError(f"serialized_named_tensors names {module}.{name}, which is not a tensor handle, a dtype "
                              "or FlattenedTensorMetadata; send SGLang's MultiprocessingSerializer text of tensors")


def deserialize(entry: Any) -> Any:
    """SGLang's MultiprocessingSerializer.deserialize of one entry, through the restricted unpickler."""
    if not isinstance(entry, str):
        raise BadRequestError(f"a serialized_named_tensors entry is a {type(entry).__name__}; send the base64 text "
                              "of MultiprocessingSerializer.serialize(..., output_str=True)")
    try:
        return _Unpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()
    except BadRequestError:
        raise
    except (binascii.Error, pickle.UnpicklingError, EOFError, ValueError, TypeError, RuntimeError) as err:
        raise BadRequestError(f"a serialized_named_tensors entry does not decode ({type(err).__name__}: {err}); "
                              "the handles reach engines on the sender's node only, while it keeps them alive") from None


def named_tensors(body: Mapping[str, Any], tp_rank: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of `body` for SGLang TP rank `tp_rank`, as SGLang's tensor path rebuilds them; BadRequestError
    naming what is wrong."""
    entries, load_format = body.get("serialized_named_tensors"), body.get("load_format")
    if load_format not in LOAD_FORMATS:
        raise BadRequestError(f"load_format {load_format!r} is not one this engine reads: {LOAD_FORMATS}")
    if not isinstance(entries, list) or len(entries) <= tp_rank:
        raise BadRequestError(f"serialized_named_tensors must be a list with an entry per TP rank (rank {tp_rank} "
                              f"reads entry {tp_rank}); got {type(entries).__name__} of "
                              f"{len(entries) if isinstance(entries, list) else 0}")
    payload = deserialize(entries[tp_rank])
    pairs = _unflatten(payload) if load_format == FLATTENED_BUCKET else payload
    if not (isinstance(pairs, list) and all(isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[0], str)
                                            and isinstance(p[1], torch.Tensor) for p in pairs)):
        raise BadRequestError("with load_format null an entry holds a list of (name, tensor) pairs; with "
                              f"{FLATTENED_BUCKET!r}, {{'flattened_tensor', 'metadata'}}")
    return dict(pairs)


def _unflatten(payload: Any) -> list[tuple[str, torch.Tensor]]:
    """SGLang's FlattenedTensorBucket.reconstruct_tensors, each slice checked against the flat tensor first."""
    flat = payload.get("flattened_tensor") if isinstance(payload, dict) else None
    metadata = payload.get("metadata") if isinstance(payload, dict) else None
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, list):
        raise BadRequestError(f"a {FLATTENED_BUCKET} entry holds {{'flattened_tensor': a 1-d tensor, 'metadata': "
                              "[FlattenedTensorMetadata, ...]}")
    pairs = []
    for meta in metadata:
        if not isinstance(meta, FlattenedTensorMetadata) or not isinstance(meta.dtype, torch.dtype):
            raise BadRequestError(f"{FLATTENED_BUCKET} metadata must be FlattenedTensorMetadata; got {meta!r:.200}")
        count = 1
        for dim in meta.shape:
            count *= int(dim)
        width = meta.dtype.itemsize if flat.dtype == torch.uint8 else 1  # newer SGLang: bytes; older: elements
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel() or meta.end_idx - meta.start_idx != count * width:
            raise BadRequestError(f"{meta.name}: [{meta.start_idx}:{meta.end_idx}] of the {flat.numel()}-element flat "
                                  f"tensor does not hold a {meta.dtype} tensor of shape {list(meta.shape)}")
        piece = flat[meta.start_idx:meta.end_idx]
        if flat.dtype != torch.uint8:
            piece = piece.to(meta.dtype)
        elif meta.start_idx % meta.dtype.itemsize == 0:
            piece = piece.view(meta.dtype)
        else:  # another sender's unaligned bytes: copied, then viewed
            piece = piece.clone().view(meta.dtype)
        pairs.append((meta.name, piece.reshape(meta.shape)))
    return pairs
