"""Integrity of a torch_dist checkpoint directory: sha256 of every file, written at save and checked on load.

    <dir>/slimeflow/checksums.json   {"algorithm": "sha256", "files": [ArtifactRecord (path relative to <dir>), ...]}

Megatron and slime ignore the file (it sits in our side folder). A checkpoint without it (Megatron's, slime's, a
converted release/ or an older slimeflow save) is checked for structure only: every data file `.metadata` names
exists and is long enough for the byte ranges it names; its contents are unverified, and the log says so.

Cost: hashing reads every byte once, at save (right after the write, in the writer's process, while the pages are
still cached) and again at load. sha256 runs at ~1-2 GB/s per core and the files are hashed in parallel, so a
multi-GB checkpoint adds seconds to a save and a resume (the write and the read themselves take longer).
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from slimeflow.config.base import replace
from slimeflow.errors import CheckpointError
from slimeflow.io.checkpoints import COMPLETE_MARKERS
from slimeflow.io.storage import ArtifactRecord, Storage

logger = logging.getLogger(__name__)

CHECKSUMS = "slimeflow/checksums.json"
"""Where a checkpoint directory keeps the sha256 of its other files (relative to the directory)."""
_HASH_THREADS = 4


def write_checksums(directory: Path) -> list[ArtifactRecord]:
    """Hash every file under `directory` (but the checksums file) into CHECKSUMS; call it once the directory is
    written and before it is committed. Returns the records."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() != CHECKSUMS)
    records = _hash(directory, [p.relative_to(directory).as_posix() for p in files])
    target = directory / CHECKSUMS
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.tmp")
    staged.write_text(json.dumps({"algorithm": "sha256", "files": [r.model_dump() for r in records]}, indent=1),
                      encoding="utf-8")
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


def _hash(directory: Path, names: list[str]) -> list[ArtifactRecord]:
    """Records of `names` (relative to `directory`), hashed in parallel (hashlib releases the GIL)."""
    storage = Storage()

    def one(name: str) -> ArtifactRecord:
        return replace(storage.sha256(str(directory / name)), path=name)

    with ThreadPoolExecutor(min(_HASH_THREADS, max(len(names), 1))) as pool:
        return list(pool.map(one, names))
