"""Progress bars for long work (copies, hashing), shown only when asked for (the CLI on a terminal)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
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
