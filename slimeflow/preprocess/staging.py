"""The preprocess stage's local staging directory, and the removal of those that killed runs left behind.

A run stages its parquet files in `<workdir>/preprocess-XXXXXXXX` (tempfile's name) and holds an exclusive
flock on its `.lock` for as long as it lives; the kernel drops the lock when the process dies, however it dies.
Each run first removes the staging directories it can lock (their run is dead). A directory without a lock
file (an older version's, or one created a moment ago) is removed only once it is an hour old.
"""

from __future__ import annotations

import fcntl
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "preprocess-"
NAME = re.compile(r"^preprocess-[a-z0-9_]{8}$")
"""tempfile.mkdtemp's names for PREFIX: only these are ours to remove."""
LOCK = ".lock"
UNLOCKED_AGE_S = 3600


@contextmanager
def staging_dir(workdir: Path) -> Iterator[Path]:
    """A fresh staging directory under `workdir`, locked while the block runs and removed after it."""
    workdir.mkdir(parents=True, exist_ok=True)
    remove_dead(workdir)
    staging = Path(tempfile.mkdtemp(prefix=PREFIX, dir=workdir))
    try:
        with (staging / LOCK).open("wb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_dead(workdir: Path) -> list[Path]:
    """Remove the staging directories under `workdir` whose runs are dead; returns them."""
    removed = []
    for candidate in sorted(workdir.iterdir()):
        if NAME.match(candidate.name) and candidate.is_dir() and not candidate.is_symlink() and _dead(candidate):
            shutil.rmtree(candidate, ignore_errors=True)
            logger.info("removed %s, the staging directory of a preprocess run that did not finish", candidate)
            removed.append(candidate)
    return removed


def _dead(staging: Path) -> bool:
    """True when no live run holds `staging`'s lock (or, lockless, when it is older than UNLOCKED_AGE_S)."""
    try:
        lock = (staging / LOCK).open("rb")
    except FileNotFoundError:
        try:
            return time.time() - staging.stat().st_mtime > UNLOCKED_AGE_S
        except FileNotFoundError:  # another run removed it meanwhile
            return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
