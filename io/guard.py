"""Guards on directories, one mechanism for every writer: an flock(2), which the kernel drops when its holder exits
however it exits (killed, out of memory, its Ray node gone). So a guard never outlives its process, a crashed run's
is free at once, and there is no stale lock to take over by pid or host.

- exclusive(directory, purpose): one run per work directory, a lock on `<directory>/.slimeflow.lock` recording its
  holder; a second run is refused naming it, or, with `wait`, takes its turn (creating an MLflow store).
- claimed_dir(root, prefix): a new staging directory `<root>/<prefix><8 hex digits>`, locked through a descriptor of
  its own (nothing is written into it, so it can be renamed into place as it is) while in use; claimed_scratch
  removes it afterwards, held claims one again. remove_abandoned removes what dead writers left (ours by name, and
  nobody holds it). Where the filesystem cannot lock (NFS without locks), nothing is claimed or removed.
- claim_root / check_owner: a token naming the run that may commit checkpoints under a root (the train stage's
  claim on --save), checked before every commit, for writers on other machines, whose locks this one cannot see.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from slimeflow.io.checkpoints import local_root
from slimeflow.io.storage import Storage

logger = logging.getLogger(__name__)

LOCK_FILENAME = ".slimeflow.lock"
OWNER_FILENAME = ".slimeflow-run"
"""The token of the run that may commit checkpoints under a root (claim_root / check_owner)."""
CONVERT_JOB_PREFIX = ".convert-job-"
HF_WEIGHTS_PREFIX = ".hf-weights-"
ABANDONED = re.compile(r"^(\.release\.tmp-|\.iter_\d{7}\.tmp-|\.convert-job-|\.hf-weights-)[0-9a-f]{8}$")
"""The staging directories under a checkpoint root: a conversion's, or a training save's (its HF weights and its
iter_XXXXXXX); remove_abandoned removes only these, and those of the prefix it is given."""
_NO_LOCKS = (errno.ENOLCK, errno.EBADF, errno.EOPNOTSUPP, errno.EINVAL)
"""flock's errors where the filesystem cannot lock (NFS without lock support, say)."""


class DirectoryBusy(RuntimeError):
    """Another live run holds the work directory."""


_held: dict[Path, int] = {}
"""The exclusive locks this process holds, by lock file, with how many holders nest in it (an flock belongs to an
open file: a second open of the same file in this process would find it locked by itself)."""
_turns: dict[Path, threading.RLock] = {}
_turns_lock = threading.Lock()


@contextmanager
def exclusive(directory: str | Path, purpose: str, *, lock_name: str = LOCK_FILENAME,
              wait: bool = False) -> Iterator[None]:
    """Hold `directory` for this process while the block runs (an flock on `<directory>/<lock_name>`).

    Another process holding it: DirectoryBusy at once, naming it; with `wait`, wait until it lets go, and this
    process's threads take turns too. Within this process the hold nests: the pipeline holds its work directory and
    each of its stages, run in the same process, takes it again. `purpose` (e.g. "pipeline demo") is written into
    the lock file, so that a refusal says which run holds the directory."""
    directory = Path(directory).resolve()
    path = directory / lock_name
    with _turn(path) if wait else nullcontext():
        if path in _held:
            _held[path] += 1
            try:
                yield
            finally:
                _held[path] -= 1
            return
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock_file(fd, path, wait)
            holder = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": purpose,
                      "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            _held[path] = 1
            try:
                yield
            finally:
                del _held[path]
        finally:
            os.close(fd)  # closing the only descriptor of the open file releases the flock


def _turn(path: Path) -> threading.RLock:
    """The lock by which this process's threads take turns on `path` (re-entrant: a thread may nest its holds)."""
    with _turns_lock:
        return _turns.setdefault(path, threading.RLock())


def _lock_file(fd: int, path: Path, wait: bool) -> None:
    if wait:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DirectoryBusy(
            f"work directory {path.parent} is in use by another slimeflow run ({_describe(path)}); two runs on one "
            "work directory would overwrite each other's outputs and checkpoints. Wait for that run to finish "
            "or cancel it, or give this run a --workdir of its own") from None


def _describe(path: Path) -> str:
    """Who holds the lock, as its holder wrote it (it may be mid-write: then only that it is held)."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return f"{holder['purpose']}, pid {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder not recorded yet"


def staging_prefix(name: str) -> str:
    """`.<name>.tmp-`: the prefix of the directory that becomes `<name>` (release, iter_0000003) when complete."""
    return f".{name}.tmp-"


@contextmanager
def claimed_dir(root: Path, prefix: str) -> Iterator[Path]:
    """A new, empty directory `<root>/<prefix><8 hex digits>`, locked while the block runs (renaming it into place,
    or removing it, is the caller's business)."""
    root.mkdir(parents=True, exist_ok=True)
    while True:
        path = root / f"{prefix}{uuid.uuid4().hex[:8]}"
        path.mkdir()
        try:
            fd = _lock_dir(path)
            break
        except (FileNotFoundError, BlockingIOError):  # a remove_abandoned elsewhere took it first: another name
            continue
    try:
        yield path
    finally:
        if fd is not None:
            os.close(fd)


@contextmanager
def claimed_scratch(root: Path, prefix: str) -> Iterator[Path]:
    """claimed_dir, removed (still claimed) when the block ends, however it ends."""
    with claimed_dir(root, prefix) as path:
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def held(path: Path) -> Iterator[Path]:
    """Claim the existing staging directory `path` for the duration of the block (while a save adds to it)."""
    fd = _lock_dir(path)
    try:
        yield path
    finally:
        if fd is not None:
            os.close(fd)


def remove_abandoned(root: Path, prefix: str | None = None) -> list[Path]:
    """Remove the staging directories in `root` whose writers are gone (ours by name: ABANDONED, or with `prefix`
    also `<prefix><8 hex digits>`, claimed_dir's names; and nobody holds their lock); returns them."""
    ours = re.compile(re.escape(prefix) + r"[0-9a-f]{8}$") if prefix else ABANDONED
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not ((ABANDONED.match(path.name) or ours.match(path.name)) and path.is_dir() and not path.is_symlink()):
            continue
        try:
            fd = _lock_dir(path)
        except (FileNotFoundError, BlockingIOError):  # in use, or removed by another writer first
            continue
        if fd is None:
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s, the staging directory of a writer that did not finish", path)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _lock_dir(path: Path) -> int | None:
    """A descriptor of the directory `path` holding an exclusive flock on it, or None where the filesystem cannot
    lock. BlockingIOError when another holds the lock, FileNotFoundError when the directory has gone."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in _NO_LOCKS:
            return None
        raise
    return fd


def claim_root(root: str | Path) -> str:
    """Make the calling run the one that commits checkpoints under `root`: a fresh token, written atomically to
    `<root>/.slimeflow-run`. A run that claimed the root before (a crashed one whose actors still finish a save, or
    one still running on the same root by mistake) then fails check_owner instead of committing. Staging that
    killed saves left under `root` is removed."""
    token = uuid.uuid4().hex
    path = local_root(root)
    path.mkdir(parents=True, exist_ok=True)
    Storage().write_text(str(path / OWNER_FILENAME), token)
    remove_abandoned(path)  # what killed saves staged (their owners are gone: a live one's stays claimed)
    return token


def check_owner(root: str | Path, token: str) -> None:
    """Raise unless the run holding `token` is still the one that claimed `root` (see claim_root)."""
    path = local_root(root) / OWNER_FILENAME
    current = path.read_text(encoding="utf-8").strip() if path.is_file() else None
    if current != token:
        raise RuntimeError(f"not committing the checkpoint: {root} was claimed by another run (its {OWNER_FILENAME} "
                           f"says {current!r}, this run's token is {token!r}); two runs must not save to one "
                           "checkpoint root: give this one its own --save")
