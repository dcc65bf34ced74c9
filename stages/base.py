"""What every stage receives besides its config: storage, its directories, and whether to show progress."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slimeflow.io.storage import Storage


@dataclass(frozen=True)
class StageContext:
    """Storage for URIs, a local work directory, the artifact root URI, whether progress bars are shown, where
    a long stage reports metrics as it goes (`log_metrics(metrics, step)`; MLflow under Prefect) and the Ray
    cluster to join (None: a local one)."""

    storage: Storage
    workdir: Path
    output: str
    show_progress: bool = False
    log_metrics: Callable[[dict[str, float], int], None] | None = None
    ray_address: str | None = None
