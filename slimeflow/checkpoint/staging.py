"""A conversion's staging directories, claimed while in use, and removed by the next conversion once abandoned.

A conversion writes its checkpoint into `<root>/.release.tmp-<id>` (renamed into place when complete) and keeps
its job file, rendezvous and rank logs in `<root>/.convert-job-<id>`; a crash leaves both behind, the first as
large as the model. Whoever uses such a directory holds an exclusive flock(2) on it, which the kernel drops when
that process ends, however it ends. So a directory with one of our names that can be locked has no owner left
and is removed; one that cannot belongs to a conversion still running (in this process or another). Where the
filesystem has no locks, nothing is claimed and nothing is removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

JOB_PREFIX = ".convert-job-"
ABANDONED = re.compile(r"^(\.release\.tmp-|\.iter_\d{7}\.tmp-|\.convert-job-|\.hf-weights-)[0-9a-f]{8}$")
"""The names of the directories a conversion, or a training save (its HF weights and its iter_XXXXXXX), stages in
(only ours, by name: nothing else is ever removed)."""


def staging_prefix(name: str) -> str:
    """`.<name>.tmp-`: the prefix of the directory that becomes `<name>` (release, iter_0000003) when complete."""
    return f".{name}.tmp-"


_NO_LOCKS = (errno.ENOLCK, errno.EBADF, errno.EOPNOTSUPP, errno.EINVAL)
"""flock's errors where the filesystem cannot lock a directory (NFS without lock support, say)."""


def _lock(path: Path) -> int | None:
    """An fd of the directory `path` holding an exclusive flock on it, or None where the filesystem cannot
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


@contextmanager
def claimed_dir(root: Path, prefix: str) -> Iterator[Path]:
    """A new, empty directory `<root>/<prefix><8 hex digits>`, locked for the duration of the block (removing it,
    or renaming it into place, is the caller's business)."""
    root.mkdir(parents=True, exist_ok=True)
    while True:
        path = root / f"{prefix}{uuid.uuid4().hex[:8]}"
        path.mkdir()
        try:
            fd = _lock(path)
            break
        except (FileNotFoundError, BlockingIOError):  # a remove_abandoned elsewhere took it first: another name
            continue
    try:
        yield path
    finally:
        if fd is not None:
            os.close(fd)


@contextmanager
def held(path: Path) -> Iterator[Path]:
    """Claim the existing staging directory `path` for the duration of the block (while a save adds to it)."""
    fd = _lock(path)
    try:
        yield path
    finally:
        if fd is not None:
            os.close(fd)


def remove_abandoned(root: Path, prefix: str | None = None) -> list[Path]:
    """Remove the staging directories in `root` that crashed conversions left (ours by name, owner gone);
    returns them. With `prefix`, also those named `<prefix><8 hex digits>` (claimed_dir's names)."""
    ours = re.compile(re.escape(prefix) + r"[0-9a-f]{8}$") if prefix else ABANDONED
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not ((ABANDONED.match(path.name) or ours.match(path.name)) and path.is_dir() and not path.is_symlink()):
            continue
        try:
            fd = _lock(path)
        except (FileNotFoundError, BlockingIOError):  # in use, or removed by another conversion first
            continue
        if fd is None:
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
