"""Which run may commit checkpoints under a root: a token claimed by the train stage's driver before its actors
start, and checked by rank 0 just before every commit. Kept apart from checkpoint.py (torch, the convert stage)
so that the driver, which only claims, imports neither."""

from __future__ import annotations

import uuid
from pathlib import Path

from slimeflow.checkpoint.staging import remove_abandoned
from slimeflow.io.storage import Storage, is_local, local_path

OWNER_FILENAME = ".slimeflow-run"
"""The token of the run that may commit checkpoints under a root (claim_root / check_owner)."""


def local_root(root: str | Path) -> Path:
    """`root` as a local path; ValueError for object-store roots, which the torch backend does not save to."""
    if not is_local(str(root)):
        raise ValueError(f"checkpoint root {root}: the torch backend saves and loads local paths only; save to a "
                         "local directory and copy it with slimeflow.io.storage.Storage.copy_tree")
    return local_path(str(root))


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
