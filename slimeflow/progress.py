"""Progress bars for long work (copies, hashing, training rollouts), shown only when asked for (the CLI on a
terminal)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@contextlib.contextmanager
def byte_progress(description: str, total: int | None, enabled: bool) -> Iterator[Callable[[int], None]]:
    """Yield `advance(nbytes)`; draws a transfer bar when `enabled` (total None: size unknown), else does nothing."""
    if not enabled:
        yield lambda _n: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


@contextlib.contextmanager
def step_progress(description: str, total: int, enabled: bool) -> Iterator[Callable[[int, str], None]]:
    """Yield `update(done, note)`: `done` of `total` steps, and a short note (the latest figures) beside the bar,
    drawn when `enabled`, else nothing. The bar stays on screen when the work ends."""
    if not enabled:
        yield lambda _done, _note: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[note]}"))
    with Progress(*columns) as progress:
        task = progress.add_task(description, total=total, note="")
        yield lambda done, note: progress.update(task, completed=done, note=note)
