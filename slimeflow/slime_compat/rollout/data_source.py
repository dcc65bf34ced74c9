"""slime.rollout.data_source: the default buffer filter, with slime's signature."""

from __future__ import annotations

from typing import Any

from slimeflow.slime_compat.utils.types import Sample


def pop_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """The oldest `num_samples` groups of `buffer` (FIFO), removed from it."""
    taken = buffer[:min(len(buffer), num_samples)]
    del buffer[:len(taken)]
    return taken
