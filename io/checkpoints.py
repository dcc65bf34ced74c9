"""Megatron's torch_dist checkpoint layout, read and committed through `Storage` (local paths and s3 alike).

    <root>/latest_checkpointed_iteration.txt   "20" or "release": the checkpoint to resume from
    <root>/iter_0000020/                       one checkpoint (7-digit zero-padded iteration)
    <root>/release/                            a checkpoint outside training (e.g. converted from HF)

A checkpoint directory is complete when it holds every file in COMPLETE_MARKERS (torch.distributed.checkpoint's
`.metadata`, Megatron's `common.pt` and `metadata.json`) next to its `*.distcp` shards. The tracker is written
last, and only for a complete directory, so a reader that trusts it never resumes from a half-written save.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slimeflow.errors import CheckpointError, NotFoundError
from slimeflow.io.storage import Storage, is_local, join, local_path, split

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMPLETE_MARKERS = (".metadata", "common.pt", "metadata.json")
RELEASE: Literal["release"] = "release"

Iteration = int | Literal["release"]

_ITER_DIR = re.compile(r"iter_([0-9]{7,})")
_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint: its `root`, its `iteration` and `uri`, the checkpoint directory itself."""

    root: str
    iteration: Iteration
    uri: str


def local_root(root: str | Path) -> Path:
    """`root` as a local path; ValueError for object-store roots, which the training backends do not save to."""
    if not is_local(str(root)):
        raise ValueError(f"checkpoint root {root}: the torch backend saves and loads local paths only; save to a "
                         "local directory and copy it with slimeflow.io.storage.Storage.copy_tree")
    return local_path(str(root))


def iteration_dirname(it: Iteration) -> str:
    """'iter_0000020' for 20, 'release' for 'release'; ValueError for a negative or non-integer iteration."""
    if it == RELEASE:
        return RELEASE
    if isinstance(it, bool) or not isinstance(it, int) or it < 0:
        raise ValueError(f"iteration must be a non-negative int or 'release', got {it!r}")
    return f"iter_{it:07d}"


def parse_iteration_dirname(name: str) -> Iteration | None:
    """The iteration a checkpoint directory name stands for, or None if it is not one (e.g. 'iter_20')."""
    if name == RELEASE:
        return RELEASE
    match = _ITER_DIR.fullmatch(name)
    if match is None or iteration_dirname(int(match.group(1))) != name:
        return None
    return int(match.group(1))


def _ref(root: str, iteration: Iteration) -> CheckpointRef:
    return CheckpointRef(root=root, iteration=iteration, uri=join(root, iteration_dirname(iteration)))


def _order(ref: CheckpointRef) -> int:
    return ref.iteration if isinstance(ref.iteration, int) else -1


def read_tracker(storage: Storage, root: str) -> Iteration | None:
    """The iteration the tracker under `root` names; None when there is no tracker."""
    uri = join(root, TRACKER_FILENAME)
    try:
        text = storage.read_text(uri).strip()
    except NotFoundError:
        return None
    if text == RELEASE:
        return RELEASE
    if not _DIGITS.fullmatch(text):
        raise CheckpointError(
            f"{uri} holds {text!r}; expected an iteration number or 'release'. "
            "Fix the file, or delete it to fall back to the newest complete checkpoint"
        )
    return int(text)


def missing_markers(storage: Storage, ckpt_uri: str) -> list[str]:
    """The files of COMPLETE_MARKERS absent from the checkpoint directory `ckpt_uri` (all of them if it is absent)."""
    try:
        present = {split(uri)[1] for uri in storage.list(ckpt_uri)}
    except NotFoundError:
        present = set()
    return [marker for marker in COMPLETE_MARKERS if marker not in present]


def is_complete(storage: Storage, ckpt_uri: str) -> bool:
    return not missing_markers(storage, ckpt_uri)


def list_checkpoints(storage: Storage, root: str, include_incomplete: bool = False) -> list[CheckpointRef]:
    """Checkpoint directories under `root`, oldest first: `release` sorts before every iteration.

    Only complete ones unless `include_incomplete`; an absent root has none. One recursive listing, so on s3
    this costs a request per thousand files rather than several per checkpoint.
    """
    if not storage.isdir(root):
        return []
    prefix_len = len(join(root, "x")) - 1  # where the relative part starts in the URIs list() returns
    files: dict[str, set[str]] = defaultdict(set)
    for entry in storage.list(root, recursive=True):
        dirname, _, filename = entry[prefix_len:].partition("/")
        if filename:  # a file directly under the root (the tracker) is no checkpoint
            files[dirname].add(filename)
    refs = [
        _ref(root, iteration)
        for dirname, names in files.items()
        if (iteration := parse_iteration_dirname(dirname)) is not None
        and (include_incomplete or names.issuperset(COMPLETE_MARKERS))
    ]
    return sorted(refs, key=_order)


def commit(storage: Storage, root: str, iteration: Iteration) -> CheckpointRef:
    """Point the tracker at `iteration` after checking its directory is complete; returns that checkpoint.

    The tracker is replaced atomically; if the directory is incomplete, CheckpointError names the missing
    files and the old tracker is left as it was.
    """
    ref = _ref(root, iteration)
    missing = missing_markers(storage, ref.uri)
    if missing:
        raise CheckpointError(
            f"cannot commit {ref.uri}: missing {', '.join(missing)}. The save has not finished (wait for every "
            f"rank) or failed (save again); {join(root, TRACKER_FILENAME)} was left unchanged"
        )
    storage.write_text(join(root, TRACKER_FILENAME), str(iteration))
    return ref


def find_latest(storage: Storage, root: str) -> CheckpointRef | None:
    """The checkpoint to resume from: the tracker's if complete, else the newest complete one; None if none.

    Falling back (no tracker, or one naming an incomplete or missing directory) logs a warning. A tracker
    holding garbage raises CheckpointError rather than being skipped.
    """
    tracked = read_tracker(storage, root)
    if tracked is not None:
        ref = _ref(root, tracked)
        missing = missing_markers(storage, ref.uri)
        if not missing:
            return ref
        reason = f"{join(root, TRACKER_FILENAME)} names {ref.uri}, which lacks {', '.join(missing)}"
    else:
        reason = f"{root} has no {TRACKER_FILENAME}"
    complete = list_checkpoints(storage, root)
    if not complete:
        return None
    logger.warning("%s; falling back to the newest complete checkpoint, %s", reason, complete[-1].uri)
    return complete[-1]


def resolve(storage: Storage, uri: str) -> CheckpointRef:
    """The checkpoint `uri` names: a checkpoint root (its latest), or an `iter_XXXXXXX/` or `release/` directory.

    CheckpointError when `uri` is none of these, or names an incomplete checkpoint.
    """
    uri = uri.rstrip("/") or "/"
    parent, name = split(uri)
    iteration = parse_iteration_dirname(name)
    if iteration is not None:
        ref = _ref(parent, iteration)
        missing = missing_markers(storage, ref.uri)
        if missing:
            raise CheckpointError(f"{uri} is not a complete checkpoint: missing {', '.join(missing)}")
        return ref
    latest = find_latest(storage, uri)
    if latest is None:
        raise CheckpointError(
            f"{uri} is not a checkpoint: expected a checkpoint directory (iter_XXXXXXX/ or release/ holding "
            f"{', '.join(COMPLETE_MARKERS)}) or a checkpoint root holding {TRACKER_FILENAME} or such directories"
        )
    return latest
