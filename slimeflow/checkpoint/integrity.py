"""Integrity of a torch_dist checkpoint directory: sha256 of every file, written at save and checked on load.

    <dir>/slimeflow/checksums.json   {"algorithm": "sha256", "files": [ArtifactRecord (path relative to <dir>), ...]}

Megatron and slime ignore the file (it sits in our side folder). A checkpoint without it (Megatron's, slime's, a
converted release/ or an older slimeflow save) is checked for structure only: every data file `.metadata` names
exists and is long enough for the byte ranges it names; its contents are unverified, and the log says so.

Cost: a save's big files are hashed while they are written, from the bytes in memory (a Ledger of HashingFiles,
the hash in a thread beside the write): no file is read back; files written without one are hashed from disk by
write_checksums. A load reads every byte once more. sha256 runs at ~1-2 GB/s per core.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from slimeflow.config.base import replace
from slimeflow.errors import CheckpointError
from slimeflow.io.checkpoints import COMPLETE_MARKERS
from slimeflow.io.storage import ArtifactRecord, Storage

logger = logging.getLogger(__name__)

CHECKSUMS = "slimeflow/checksums.json"
"""Where a checkpoint directory keeps the sha256 of its other files (relative to the directory)."""
_HASH_THREADS = 4


_CONCURRENT_HASH_BYTES = 1 << 20
"""A write at least this big is hashed in a thread while it is written (hashlib and the write both release the GIL);
a smaller one inline (a thread hand-off costs more than hashing it)."""


class HashingFile:
    """A binary file being written that hashes (sha256) what goes through it: `record` once it is complete.

    Only for files written front to back through `write`: bytes put into the file any other way (a copy into a
    hole, a seek back) are not hashed, and the record would be wrong."""

    def __init__(self, file: BinaryIO) -> None:
        self._file, self._hash, self._size = file, hashlib.sha256(), 0
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256")

    def write(self, data) -> int:
        view = memoryview(data)
        if view.nbytes < _CONCURRENT_HASH_BYTES:
            self._hash.update(view)
            self._file.write(view)
        else:  # the view is valid only during this call: the hash finishes before it returns
            hashed = self._hasher.submit(self._hash.update, view)
            try:
                self._file.write(view)
            finally:
                hashed.result()
        self._size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._hasher.shutdown()

    @property
    def record(self) -> ArtifactRecord:
        """What has been written: its sha256 and size (the record's path is the caller's to set)."""
        return ArtifactRecord(path="", sha256=self._hash.hexdigest(), size=self._size)


class Ledger:
    """The records of a save's files, hashed while they were written (HashingFile), for write_checksums: the
    bytes are in memory then, so hashing them costs no read of the file. Shared by a save's writer threads."""

    def __init__(self) -> None:
        self._records: dict[Path, ArtifactRecord] = {}
        self._lock = threading.Lock()

    @contextmanager
    def open(self, path: Path) -> Iterator[HashingFile]:
        """`path` created and written through a HashingFile; when the block ends without an error, the file is
        fsynced (a checkpoint must survive a crash) and its record kept."""
        with open(path, "wb") as file:
            hashing = HashingFile(file)
            try:
                yield hashing
                file.flush()
                os.fsync(file.fileno())
            finally:
                hashing.close()
        self.add(path, hashing.record)

    def add(self, path: Path, record: ArtifactRecord) -> None:
        with self._lock:
            self._records[Path(path).resolve()] = record

    def get(self, path: Path) -> ArtifactRecord | None:
        with self._lock:
            return self._records.get(Path(path).resolve())


def write_checksums(directory: Path, ledger: Ledger | None = None) -> list[ArtifactRecord]:
    """Write CHECKSUMS for every file under `directory` (but the checksums file); call it once the directory is
    written and before it is committed. A file that `ledger` hashed while it was written, and that still has the
    size it had then, takes the ledger's record; the others are hashed from disk. Returns the records."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() != CHECKSUMS)
    records = _hash(directory, [p.relative_to(directory).as_posix() for p in files], ledger)
    target = directory / CHECKSUMS
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.tmp")
    with staged.open("wb") as file:  # fsynced, as the files it covers: the tracker may name it after a crash
        file.write(json.dumps({"algorithm": "sha256", "files": [r.model_dump() for r in records]}, indent=1).encode())
        file.flush()
        os.fsync(file.fileno())
    os.replace(staged, target)
    return records


def verify_checkpoint(directory: str | Path) -> bool:
    """Check the checkpoint directory before anything reads it: True when its contents match CHECKSUMS, False when
    it has none (structure checked only; a warning says so). CheckpointError names each damaged file, what is
    wrong with it and what to do."""
    directory = Path(directory)
    problems = _missing_markers(directory)
    if not problems:
        problems = _checksum_problems(directory) or _structure_problems(directory)
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} is damaged:\n  - " + "\n  - ".join(problems) + "\n"
            "Nothing was loaded from it. Restore it from a copy, or move it aside: a checkpoint root's tracker then "
            "falls back to the previous complete checkpoint (delete latest_checkpointed_iteration.txt if it names "
            "this one)")
    if (directory / CHECKSUMS).is_file():
        return True
    logger.warning("%s has no %s (written by Megatron, slime or an older slimeflow): checked that the files its "
                   ".metadata names exist and are long enough; their contents are unverified", directory, CHECKSUMS)
    return False


def quick_problems(directory: Path) -> list[str]:
    """What verify_checkpoint would find without reading the files' bytes: markers missing, files missing or of
    another size than CHECKSUMS records (without it, than .metadata needs). For a check in a second, before a run
    starts; the contents are hashed when the checkpoint is loaded."""
    problems = _missing_markers(directory)
    if problems:
        return problems
    if (directory / CHECKSUMS).is_file():
        return _size_problems(directory)[1]
    return _structure_problems(directory)


def _missing_markers(directory: Path) -> list[str]:
    return [f"{directory / m}: missing" for m in COMPLETE_MARKERS if not (directory / m).is_file()]


def _size_problems(directory: Path) -> tuple[list[ArtifactRecord], list[str]]:
    """(CHECKSUMS' records, how the files' presence and sizes differ from them); ([], []) without CHECKSUMS."""
    path = directory / CHECKSUMS
    if not path.is_file():
        return [], []
    try:
        expected = [ArtifactRecord.model_validate(r) for r in json.loads(path.read_text(encoding="utf-8"))["files"]]
    except (ValueError, KeyError, TypeError) as err:
        return [], [f"{path}: unreadable ({type(err).__name__}: {err})"]
    problems = []
    for record in expected:
        file = directory / record.path
        if not file.is_file():
            problems.append(f"{file}: missing (listed in {CHECKSUMS})")
        elif file.stat().st_size != record.size:
            problems.append(f"{file}: {file.stat().st_size} bytes, {record.size} when saved (truncated or rewritten)")
    return expected, problems


def _checksum_problems(directory: Path) -> list[str]:
    """How the files differ from CHECKSUMS (sizes first: a truncated file costs no hashing); [] without it."""
    expected, problems = _size_problems(directory)
    if problems or not expected:
        return problems
    actual = _hash(directory, [r.path for r in expected])
    return [f"{directory / want.path}: sha256 {got.sha256}, {want.sha256} when saved (its bytes changed)"
            for want, got in zip(expected, actual, strict=True) if want.sha256 != got.sha256]


def _structure_problems(directory: Path) -> list[str]:
    """Data files that `.metadata` names but that are missing or shorter than the byte ranges it records."""
    from slimeflow.checkpoint.torch_dist import read_dcp_metadata

    try:
        metadata = read_dcp_metadata(directory)
    except Exception as err:  # noqa: BLE001 - any failure to parse it is what we report
        return [f"{directory / '.metadata'}: unreadable ({type(err).__name__}: {err})"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            problems.append(f"{file}: missing (named in .metadata)")
        elif file.stat().st_size < size:
            problems.append(f"{file}: {file.stat().st_size} bytes, .metadata needs at least {size} (truncated)")
    return problems


def _hash(directory: Path, names: list[str], ledger: Ledger | None = None) -> list[ArtifactRecord]:
    """Records of `names` (relative to `directory`): `ledger`'s where it has one of the file's current size, the
    others hashed from disk, in parallel (hashlib releases the GIL)."""
    storage = Storage()

    def one(name: str) -> ArtifactRecord:
        known = ledger.get(directory / name) if ledger is not None else None
        if known is not None and known.size == (directory / name).stat().st_size:
            return replace(known, path=name)
        return replace(storage.sha256(str(directory / name)), path=name)

    with ThreadPoolExecutor(min(_HASH_THREADS, max(len(names), 1))) as pool:
        return list(pool.map(one, names))
