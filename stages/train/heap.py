"""Start-up memory that the actors keep for their whole life."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Exempt what start-up allocated (modules, the model, the tokenizer: ~200k objects) from garbage collection
    for the life of the process. Otherwise every full collection walks all of it: in the RolloutManager one came
    every ~50 rollouts and stalled that rollout 250 ms (a 256-sample rollout takes ~15 ms)."""
    gc.freeze()
