"""What both backends' training checkpoints share: slimeflow's side folder next to Megatron's files, the error a
damaged file becomes, and slime's rule for where a run starts.

    <root>/iter_XXXXXXX/slimeflow/extra_state.json   the caller's JSON state (data source, rollout id, ...), both
    <root>/iter_XXXXXXX/slimeflow/training_state.pt  the torch backend's optimizer and scheduler state

Each backend's own module (torch/checkpoint.py, megatron/checkpoint.py) writes and reads the rest of its layout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from slimeflow.errors import CheckpointError
from slimeflow.io import checkpoints
from slimeflow.io.checkpoints import CheckpointRef, local_root
from slimeflow.io.storage import Storage

logger = logging.getLogger(__name__)

SIDE_DIR = "slimeflow"
"""slimeflow's resume state inside a checkpoint directory (Megatron ignores the folder)."""
EXTRA_STATE = "extra_state.json"
TRAINING_STATE = "training_state.pt"
"""The torch backend's optimizer and scheduler state; the Megatron backend names it to refuse a torch save."""


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Turn a failure to read `path` (EOFError, a bad zip record, ...) into a CheckpointError that names it."""
    try:
        yield
    except (CheckpointError, KeyError):
        raise
    except Exception as err:
        raise CheckpointError(f"reading {path} failed: {type(err).__name__}: {err}. The checkpoint is damaged "
                              "or was not written by Megatron or slimeflow; restore it from a copy") from err


def read_extra_state(directory: Path) -> dict[str, Any]:
    """The extra_state a checkpoint `directory` was saved with (CheckpointError when it cannot be read)."""
    path = directory / SIDE_DIR / EXTRA_STATE
    with reading(path):
        return json.loads(path.read_text(encoding="utf-8"))


class BackgroundCommit:
    """--async-save: at most one checkpoint's write, hash, fsync and commit running in a thread of its own while
    training goes on (the trainer blocked only while the save took its snapshot).

    The thread is not a daemon: an interpreter that exits normally finishes the commit first. A process killed
    before the commit ends leaves the previous checkpoint the latest, as a killed synchronous save does (the commit
    keeps the synchronous save's order: files fsynced, checksums, rename, then the tracker). A failed commit is
    raised by the next `wait`, with its cause, never dropped."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit")
        self._pending: tuple[str, Future[object]] | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def start(self, what: str, commit: Callable[[], object]) -> None:
        """Run `commit` (the rest of the save of `what`, e.g. "checkpoint 3 under /root") in the thread; the caller
        has waited for the previous one."""
        if self._pending is not None:
            raise RuntimeError(f"{what}: the commit of {self._pending[0]} is still pending; wait for it first")
        self._pending = (what, self._pool.submit(commit))

    def wait(self) -> None:
        """Until the pending commit (if any) has ended; CheckpointError, from its cause, when it failed: the
        checkpoint was not committed and the previous one stays the latest."""
        if self._pending is None:
            return
        what, future = self._pending
        self._pending = None
        try:
            future.result()
        except BaseException as err:
            raise CheckpointError(
                f"the asynchronous save (--async-save) of {what} failed in the background and was not committed "
                f"(the previous checkpoint stays the latest): {type(err).__name__}: {err}") from err
        logger.info("%s is committed (--async-save)", what)


@dataclass(frozen=True)
class StartPoint:
    """Where training starts: `ref` to load (None: the HF checkpoint's own weights) and whether weights only."""

    source: Literal["load", "ref_load", "hf_checkpoint"]
    ref: CheckpointRef | None
    weights_only: bool


def resolve_start(load: str | None, ref_load: str | None) -> StartPoint:
    """slime's rule: --load holding a valid checkpoint resumes from its latest (everything); otherwise --ref-load
    (weights only; CheckpointError if it holds no checkpoint); otherwise the HF checkpoint's weights.

    Then: `backend.load_checkpoint(start.ref, start.weights_only)` when start.ref is not None.
    """
    storage = Storage()
    if load is not None:
        latest = checkpoints.find_latest(storage, str(local_root(load)))
        if latest is not None:
            return StartPoint("load", latest, weights_only=False)
    if ref_load is not None:
        return StartPoint("ref_load", checkpoints.resolve(storage, str(local_root(ref_load))), weights_only=True)
    return StartPoint("hf_checkpoint", None, weights_only=True)
