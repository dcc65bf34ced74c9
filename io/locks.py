"""One run per work directory at a time: an exclusive flock on `<workdir>/.slimeflow.lock`, held by the process
that runs the pipeline (or a stage alone) for as long as it runs.

The kernel drops a flock when its holder exits, however it exits, so a run that was killed (its worker lost, its
flow run cancelled) leaves no stale lock and a retry starts at once. The lock is re-entrant within a process: the
pipeline holds it and each of its stages, run in the same process, takes it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILENAME = ".slimeflow.lock"

_held: dict[Path, int] = {}
"""Locks this process holds, by lock file, with how many holders nest in it (flock locks belong to an open file:
a second open of the same file in this process would find it locked by itself)."""


class DirectoryBusy(RuntimeError):
    """Another live run holds the work directory."""


@contextlib.contextmanager
def exclusive(directory: str | Path, purpose: str) -> Iterator[None]:
    """Hold `directory` for this process while the block runs; DirectoryBusy at once if another process holds it.

    `purpose` (e.g. "pipeline demo") is written into the lock file, so that the refusal of a second run says which
    run holds the directory."""
    directory = Path(directory).resolve()
    path = directory / LOCK_FILENAME
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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryBusy(
                f"work directory {directory} is in use by another slimeflow run ({_describe(path)}); two runs on one "
                "work directory would overwrite each other's outputs and checkpoints. Wait for that run to finish "
                "or cancel it, or give this run a --workdir of its own") from None
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


def _describe(path: Path) -> str:
    """Who holds the lock, as its holder wrote it (it may be mid-write: then only that it is held)."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return f"{holder['purpose']}, pid {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder not recorded yet"
