"""A conversion that runs out of disk space says so, with the place, the sizes and the fix.

torch's zip writer (each tensor of a torch_dist checkpoint is a torch.save record) reports a full disk as
`[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598` or `file write failed`, with no errno;
plain writes say `[Errno 28] No space left on device`. Both reach the launcher through dist_checkpointing's
CheckpointException and a rank's log, as text, when they reach it at all.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

_SAYS_FULL = ("no space left on", "disk quota exceeded")
"""strerror of ENOSPC and EDQUOT (lower case), and the start of NoSpaceLeft's own message."""


class NoSpaceLeft(OSError):
    """Writing a checkpoint ran out of disk space."""


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the filesystem of `path` (or of its nearest existing parent)."""
    return shutil.disk_usage(_existing(path)).free


def mount_point(path: Path) -> Path:
    path = _existing(path.resolve())
    while not path.is_mount():
        path = path.parent
    return path


def size_text(count: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def ran_out_of_space(err: BaseException, directory: Path, needed: int) -> bool:
    """Whether `err`, raised writing `needed` bytes into `directory`, means that its disk is full: an ENOSPC or
    EDQUOT in its chain or its text, or less than `needed` free there (torch's writer gives no errno, and a rank
    whose peer's writer failed learns only that the save failed)."""
    chain = _chain(err)
    if any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for e in chain):
        return True
    text = "\n".join(str(e) for e in chain).lower()
    return any(phrase in text for phrase in _SAYS_FULL) or free_bytes(directory) < needed


def no_space_left(directory: Path, what: str, needed: int) -> NoSpaceLeft:
    """The error to raise once ran_out_of_space: where, how much `what` needs, how much is free, what to do."""
    return NoSpaceLeft(f"no space left on {directory} (the filesystem mounted at {mount_point(directory)}): "
                       f"{what} needs about {size_text(needed)}, {size_text(free_bytes(directory))} is free there. "
                       f"Free space there, or convert into a --save directory on a larger disk (an s3:// --save is staged "
                       f"in the workdir first).")
