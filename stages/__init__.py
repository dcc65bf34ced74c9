"""The work of each pipeline stage, as plain Python (no Prefect here).

A stage is `run(config, context) -> Manifest`. RUNNERS lists the stages that have landed; the pipeline and the
CLI refuse, by name, a stage that is configured but not yet available.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from slimeflow.config.pipeline import PIPELINE_ORDER

RUNNERS: dict[str, str] = {
    "model": "slimeflow.stages.model.stage:run",
    "convert": "slimeflow.stages.convert.stage:run",
    "preprocess": "slimeflow.stages.preprocess.stage:run",
    "train": "slimeflow.stages.train.stage:run",
    "evaluate": "slimeflow.stages.evaluate.stage:run",
    "export": "slimeflow.stages.export.stage:run",
}


def available() -> tuple[str, ...]:
    """The stages that can run, in pipeline order."""
    return tuple(name for name in PIPELINE_ORDER if name in RUNNERS)


def runner(name: str) -> Callable[..., Any]:
    """The `run` function of stage `name`; a clear error for a stage that is not available."""
    if name not in RUNNERS:
        raise KeyError(f"stage {name!r} is not available in this version (available: {', '.join(available())})")
    module, function = RUNNERS[name].split(":")
    return getattr(importlib.import_module(module), function)


PREFLIGHTS: dict[str, str] = {
    "train": "slimeflow.stages.train.preflight:preflight",
}
"""Each stage's check of its config alone, in a module of its own that starts nothing heavy (no Ray)."""


def preflight(name: str, config: Any) -> list[str]:
    """What is wrong with stage `name`'s config that can be seen from the config alone (PREFLIGHTS; none for a
    stage without one): the CLI asks before Prefect, Ray or an engine starts."""
    if name not in PREFLIGHTS:
        return []
    module, function = PREFLIGHTS[name].split(":")
    return getattr(importlib.import_module(module), function)(config)
