"""slime.rollout.data_source: the base class of a data source (--data-source-path) and the default buffer filter,
with slime's signatures."""

from __future__ import annotations

import abc
from typing import Any

from slimeflow.slime_compat.utils.types import Sample


class DataSource(abc.ABC):
    """What --data-source-path names, as slime: instantiated as `cls(args)`; the rollout asks it for groups of
    samples and gives back the groups it aborts (partial rollouts); `save(rollout_id)` is called at each checkpoint
    and `load(rollout_id)` when a run resumes after checkpoint `rollout_id`."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """`num_samples` groups of --n-samples-per-prompt samples each."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Take groups back (to hand out again later)."""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Save the state after rollout `rollout_id` (slime's own writes under args.save)."""

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Load the state saved after rollout `rollout_id` (from args.load)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of prompts (groups) it holds; may change as groups are added and taken."""


def pop_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """The oldest `num_samples` groups of `buffer` (FIFO), removed from it."""
    taken = buffer[:min(len(buffer), num_samples)]
    del buffer[:len(taken)]
    return taken


def __getattr__(name: str) -> Any:
    # slime's default data source classes read --prompt-data through slime's own Dataset; slimeflow's data source
    # is their equivalent, and a class of your own subclasses DataSource.
    if name in ("RolloutDataSource", "RolloutDataSourceWithBuffer"):
        raise ImportError(f"slime.rollout.data_source.{name} is not provided by slimeflow's slime compatibility layer: "
                          "leave --data-source-path unset for slimeflow's data source (slime's default behaviour: "
                          "--prompt-data in order, a buffer in front, --buffer-filter-path), or subclass "
                          "slime.rollout.data_source.DataSource", name=name)
    raise AttributeError(f"module 'slime.rollout.data_source' has no attribute {name!r}")
