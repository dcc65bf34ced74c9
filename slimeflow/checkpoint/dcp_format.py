"""torch's Distributed Checkpoint (DCP) files, written without importing torch.distributed.checkpoint.

A DCP checkpoint is data files plus one index. A data file holds its items back to back: for a tensor chunk,
what `torch.save` writes for it; for a byte item, its bytes. The index, `.metadata`, is a pickled
`torch.distributed.checkpoint.metadata.Metadata`: each tensor's global size, dtype and chunks (offsets, sizes),
each byte item's key, and where every item lies (file, offset, length). That is what torch's FileSystemWriter
writes, and what torch's reader and megatron-core's dist_checkpointing load.

Importing torch's package took 0.6-0.7 s of a conversion rank's start-up, for a format this small; so the
records below mirror torch's classes field for field and pickle under torch's own names (`_TorchNamesPickler`),
and unpickle as torch's classes. tests/unit/test_dcp_format.py compares them with torch's, field by field, and loads
what this writes with torch's reader; the convert tests load it into megatron-core's GPTModel.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import struct
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

if TYPE_CHECKING:  # integrity imports slimeflow.io: a conversion worker's start-up need not
    from slimeflow.checkpoint.integrity import HashingFile, Ledger

DCP_VERSION = "1.0.0"
"""torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION, which torch's writer stamps on `.metadata`."""
METADATA_FILE = ".metadata"
_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


@dataclass(frozen=True)
class TensorChunk:
    """Chunk `offsets` of the global tensor `key` of size `size`; `tensor` is its data (its shape: the chunk's)."""

    key: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclass(frozen=True)
class ByteItem:
    """An opaque item (megatron-core's ShardedObject: a torch.save of a list of its data) under `key`."""

    key: str
    data: bytes


@dataclass(frozen=True)
class Written:
    """Where one item went: file (relative to the checkpoint), offset and length; for a chunk, its tensor's
    global size and dtype and the chunk's offsets and sizes (None for a byte item)."""

    key: str
    file: str
    offset: int
    length: int
    size: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    chunk_offsets: tuple[int, ...] | None = None
    chunk_sizes: tuple[int, ...] | None = None


Source = Callable[[torch.Tensor], "tuple[Path, int] | None"]
"""A tensor -> (file, offset) where its bytes lie as they are (a whole memory-mapped span of that file), or None."""


def write_items(path: Path, items: list[TensorChunk | ByteItem | None], source: Source | None = None,
                ledger: Ledger | None = None) -> list[Written]:
    """Write `items` into the data file `path` (created), as torch's FileSystemWriter does, and fsync it.
    With `ledger` (and no `source`), the file is hashed while it is written (integrity.Ledger), for its checksum.

    A tensor whose bytes lie as they are in a file (`source`, worker.LazySafetensors.source) is copied from there
    by the kernel (copy_file_range): torch.save writes its record around a hole (skip_data), which the copy
    fills. Reading its bytes through their memory map instead cost a page fault per 4 KiB and a copy through this
    process: twice the copy's time.

    Consumes `items`: each is dropped from the list once written, so that a tensor memory-mapped from an HF file
    is unmapped once it is in the checkpoint, if nothing else holds it (its pages count in this process's
    resident memory while they are mapped)."""
    if ledger is not None and source is None:  # a copy into a hole (source) would bypass the hash
        with ledger.open(path) as hashing:
            return _write_items(hashing, path, items, None)
    with open(path, "wb") as stream:
        written = _write_items(stream, path, items, source)
        stream.flush()
        os.fsync(stream.fileno())
    return written


def _write_items(stream: BinaryIO | HashingFile, path: Path, items: list[TensorChunk | ByteItem | None],
                 source: Source | None) -> list[Written]:
    written = []
    reader = None  # `path` to read back, opened once needed (opening `stream` "w+b" would not block on a FIFO)
    try:
        for index, item in enumerate(items):
            items[index] = None
            start = stream.tell()
            if isinstance(item, ByteItem):
                stream.write(item.data)
                written.append(Written(item.key, path.name, start, stream.tell() - start))
                continue
            tensor = item.tensor
            if not tensor.dim() == len(item.offsets) == len(item.size):
                raise ValueError(f"chunk of {item.key!r}: data {list(tensor.shape)} at {list(item.offsets)} has "
                                 f"not the dimensions of its tensor, of size {list(item.size)}")
            origin = source(tensor) if source is not None else None
            if origin is None:
                torch.save(_own_storage(tensor), stream)  # type: ignore[arg-type]  # HashingFile: write and flush
            else:
                reader = reader if reader is not None else os.open(path, os.O_RDONLY)
                _save_around_hole(tensor, stream, reader, origin)  # type: ignore[arg-type]  # never a HashingFile
            written.append(Written(item.key, path.name, start, stream.tell() - start, tuple(item.size),
                                   tensor.dtype, tuple(item.offsets), tuple(tensor.shape)))
            del item, tensor
    finally:
        if reader is not None:
            os.close(reader)
    return written


def _save_around_hole(tensor: torch.Tensor, stream: BinaryIO, reader: int, origin: tuple[Path, int]) -> None:
    """torch.save `tensor` into `stream` without its bytes (skip_data leaves a hole), then copy them into the hole
    from `origin` (file, offset). `reader`: the same file, open for reading."""
    start = stream.tell()
    with torch.serialization.skip_data():
        torch.save(tensor, stream)
    stream.flush()
    nbytes = tensor.numel() * tensor.element_size()
    copy_range(*origin, stream.fileno(), _data_offset(reader, start, stream.tell(), nbytes), nbytes)


def _data_offset(fd: int, start: int, end: int, nbytes: int) -> int:
    """Where the bytes of the one storage of the torch.save record [start, end) of `fd` go (its `data/0`)."""
    with zipfile.ZipFile(_Window(fd, start, end)) as archive:
        info = next((i for i in archive.infolist() if i.filename.endswith("/data/0")), None)
    if info is None or info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
        raise ValueError(f"torch.save wrote no stored record of {nbytes} bytes for the tensor at {start}")
    name, extra = struct.unpack("<HH", os.pread(fd, 30, start + info.header_offset)[26:30])
    return start + info.header_offset + 30 + name + extra


class _Window(io.RawIOBase):
    """Bytes [start, end) of the file `fd`, as a read-only, seekable file (read with pread)."""

    def __init__(self, fd: int, start: int, end: int):
        super().__init__()
        self._fd, self._start, self._size, self._at = fd, start, end - start, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._at = offset + {os.SEEK_SET: 0, os.SEEK_CUR: self._at, os.SEEK_END: self._size}[whence]
        return self._at

    def tell(self) -> int:
        return self._at

    def readinto(self, buffer) -> int:
        data = os.pread(self._fd, max(0, min(len(buffer), self._size - self._at)), self._start + self._at)
        buffer[:len(data)] = data
        self._at += len(data)
        return len(data)


def copy_range(path: Path, offset: int, out_fd: int, out_offset: int, count: int) -> None:
    """Copy bytes [offset, offset + count) of `path` to `out_offset` of `out_fd`, by the kernel (copy_file_range),
    or through this process where the kernel cannot copy between these two files."""
    with open(path, "rb") as source:
        done = 0
        try:
            while done < count:
                copied = os.copy_file_range(source.fileno(), out_fd, count - done, offset + done, out_offset + done)
                if copied == 0:
                    raise EOFError(f"{path} ends before byte {offset + count}")
                done += copied
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            while done < count:
                block = os.pread(source.fileno(), min(count - done, _BLOCK), offset + done)
                if not block:
                    raise EOFError(f"{path} ends before byte {offset + count}") from err
                done += os.pwrite(out_fd, block, out_offset + done)


_BLOCK = 8 << 20


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when its storage is exactly its bytes (torch.save writes the whole storage), else a copy."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def object_bytes(data: Any) -> bytes:
    """A megatron-core ShardedObject's item: torch.save of the list of its data (one object here)."""
    buffer = io.BytesIO()
    torch.save([data], buffer)
    return buffer.getvalue()


def check_coverage(written: list[Written]) -> None:
    """ValueError unless every tensor's chunks agree on its size and dtype, lie inside it and add up to it, and no
    key or chunk is written twice (the check megatron-core's save made, less its overlap test)."""
    tensors: dict[str, list[Written]] = {}
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    for item in written:
        where = (item.key, item.chunk_offsets)
        if where in seen:
            raise ValueError(f"{item.key!r} (chunk {item.chunk_offsets}) is written twice")
        seen.add(where)
        if item.size is not None:
            tensors.setdefault(item.key, []).append(item)
    for key, chunks in tensors.items():
        first = chunks[0]
        if any(c.size != first.size or c.dtype != first.dtype for c in chunks):
            raise ValueError(f"the chunks of {key!r} disagree on its size or dtype")
        if any(o + s > n for c in chunks for o, s, n in zip(c.chunk_offsets, c.chunk_sizes, first.size, strict=True)):
            raise ValueError(f"a chunk of {key!r} lies outside its size {list(first.size)}")
        if sum(_numel(c.chunk_sizes) for c in chunks) != _numel(first.size):
            raise ValueError(f"the chunks of {key!r} do not add up to its size {list(first.size)}")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def write_metadata(checkpoint_dir: Path, written: list[Written]) -> None:
    """`.metadata` for the items of every rank (`written`, in rank order), as torch's writer pickles it; fsynced."""
    check_coverage(written)
    entries: dict[str, Any] = {}
    storage: dict[_MetadataIndex, _StorageInfo] = {}
    for item in written:
        info = _StorageInfo(item.file, item.offset, item.length)
        if item.size is None:
            entries[item.key] = _BytesStorageMetadata()
            storage[_MetadataIndex(item.key)] = info
            continue
        meta = entries.setdefault(item.key, _TensorStorageMetadata(
            _TensorProperties(item.dtype), torch.Size(item.size), []))
        storage[_MetadataIndex(item.key, torch.Size(item.chunk_offsets), len(meta.chunks))] = info
        meta.chunks.append(_ChunkStorageMetadata(torch.Size(item.chunk_offsets), torch.Size(item.chunk_sizes)))
    metadata = _Metadata(entries, None, storage, _StorageMeta(str(checkpoint_dir), str(uuid.uuid4())), DCP_VERSION)
    write_synced(checkpoint_dir / METADATA_FILE, lambda file: _TorchNamesPickler(file, protocol=4).dump(metadata))


def write_synced(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Create `path`, `write(file)` into it, and fsync it."""
    with open(path, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


# torch's records, field for field (tests/unit/test_dcp_format.py holds them to torch's), pickled under torch's names.


@dataclass
class _ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


class _MemFormatEncoding:
    """torch's _MEM_FORMAT_ENCODING member TORCH_CONTIGUOUS_FORMAT (value 0), pickled as an Enum member is."""

    def __reduce__(self):
        return _MemFormatEncoding, (0,)


@dataclass
class _TensorProperties:
    dtype: torch.dtype
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    def __getstate__(self):  # torch's: a tuple, with the memory format as its encoding (contiguous only here)
        return self.dtype, self.layout, self.requires_grad, _MemFormatEncoding(), self.pin_memory


@dataclass
class _TensorStorageMetadata:
    properties: _TensorProperties
    size: torch.Size
    chunks: list[_ChunkStorageMetadata]


@dataclass
class _BytesStorageMetadata:
    pass


@dataclass
class _StorageMeta:
    checkpoint_id: str | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class _Metadata:
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: _StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class _MetadataIndex:
    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: list[str] | None = None

    def __getstate__(self):  # torch's: None fields left out
        return {k: v for k, v in self.__dict__.items() if v is not None}


TORCH_NAMES: dict[type, tuple[str, str]] = {
    _ChunkStorageMetadata: (_METADATA, "ChunkStorageMetadata"),
    _MemFormatEncoding: (_METADATA, "_MEM_FORMAT_ENCODING"),
    _TensorProperties: (_METADATA, "TensorProperties"),
    _TensorStorageMetadata: (_METADATA, "TensorStorageMetadata"),
    _BytesStorageMetadata: (_METADATA, "BytesStorageMetadata"),
    _StorageMeta: (_METADATA, "StorageMeta"),
    _Metadata: (_METADATA, "Metadata"),
    _MetadataIndex: (_METADATA, "MetadataIndex"),
    _StorageInfo: (_FILESYSTEM, "_StorageInfo"),
}
"""Each record -> the (module, name) of the torch class it stands for."""


class _TorchNamesPickler(pickle._Pickler):
    """Python's own pickler (the C one insists that a class be importable under the name it pickles), writing each
    record class of TORCH_NAMES as the torch class it stands for: no import of torch's package needed."""

    def save_global(self, obj, name=None):
        where = TORCH_NAMES.get(obj) if isinstance(obj, type) else None
        if where is None:
            return super().save_global(obj, name)
        for part in where:
            self.save(part)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)
        return None
