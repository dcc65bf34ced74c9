"""--data-source-path: a data source class written against slime's API, in place of slimeflow's buffered one.

slime instantiates the class with `args` and calls `get_samples(num_samples)` for groups, `add_samples(groups)` for
the groups a rollout aborts, `save(rollout_id)` at each checkpoint and `load(start_rollout_id - 1)` before the first
rollout (so -1 on a fresh run). `PluginDataSource` gives the rollout the interface of BufferedDataSource over such a
class (its Samples are slimeflow's: one class). Its checkpoint state is the rollout id it saved at;
what the class saves is its own (slime's writes under args.save and reads from args.load).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from slimeflow.rollout.data_source import START_ROLLOUT_ID, Group
from slimeflow.rollout.slime_plugins import plugin_name, returned_sample
from slimeflow.rollout.types import Sample, Status


class PluginDataSource:
    """A slime data source object, seen as slimeflow's BufferedDataSource (get_groups, add_groups, len, state)."""

    def __init__(self, cls: Callable[..., Any], args: Any, n_samples_per_prompt: int):
        self.source = cls(args)
        self.n_samples_per_prompt = n_samples_per_prompt
        self.where = f"--data-source-path {plugin_name(cls)}"
        self._next_group = 0  # for samples the class hands out without a group_index / index
        self._next_sample = 0
        self.loaded = False

    def get_groups(self, num_groups: int) -> list[Group]:
        """`num_groups` groups from the class's get_samples, checked for shape and their samples checked."""
        if num_groups == 0:
            return []
        groups = self.source.get_samples(num_groups)
        if not isinstance(groups, list) or any(not isinstance(group, list) for group in groups):
            raise TypeError(f"{self.where}: get_samples({num_groups}) returned {type(groups).__name__}; it must return "
                            "a list of groups, each a list of Samples (list[list[Sample]])")
        if len(groups) != num_groups:
            raise ValueError(f"{self.where}: get_samples({num_groups}) returned {len(groups)} groups; a data source "
                             f"hands out exactly the number asked for (slime's wraps into the next epoch)")
        wrong = [len(group) for group in groups if len(group) != self.n_samples_per_prompt]
        if wrong:
            raise ValueError(f"{self.where}: get_samples returned a group of {wrong[0]} samples; each group holds "
                             f"--n-samples-per-prompt {self.n_samples_per_prompt}")
        return [self._checked(group) for group in groups]

    def _checked(self, group: list[Any]) -> Group:
        samples = []
        for sample in group:
            numbered = Sample(group_index=self._next_group, index=self._next_sample)
            self._next_sample += 1
            samples.append(returned_sample(sample, f"{self.where} get_samples", numbered))
        self._next_group += 1
        return samples

    def add_groups(self, groups: Sequence[Group], rollout_id: int) -> None:
        """Give groups back to the class (aborted ones); each sample keeps the rollout id it started in, as
        BufferedDataSource does."""
        for group in groups:
            for sample in group:
                if sample.status is Status.FAILED:
                    raise ValueError(f"sample {sample.index} failed ({sample.failure_reason}); it cannot be resumed")
                sample.metadata.setdefault(START_ROLLOUT_ID, rollout_id)
        if groups:
            self.source.add_samples([list(group) for group in groups])

    def __len__(self) -> int:
        return len(self.source)

    def save(self, rollout_id: int) -> dict[str, int]:
        """The class's save(rollout_id); the state to keep with the checkpoint (which rollout id to load)."""
        self.source.save(rollout_id)
        return {"data_source_rollout_id": rollout_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The class's load(rollout_id) of the checkpoint's state (slime loads start_rollout_id - 1, the same id)."""
        if "data_source_rollout_id" not in state:
            raise ValueError(f"{self.where}: the checkpoint holds slimeflow's own data-source state, not a "
                             "--data-source-path class's; resume with the data source it was saved with, or start "
                             "without --load")
        self.source.load(int(state["data_source_rollout_id"]))
        self.loaded = True

    def start(self, start_rollout_id: int) -> None:
        """Before the run's first rollout: as slime, the class's load(start_rollout_id - 1) (-1 on a fresh run), unless
        a slimeflow checkpoint's state loaded it already; so a run over a slime checkpoint continues the class's own
        saved state too."""
        if not self.loaded:
            self.source.load(start_rollout_id - 1)
            self.loaded = True
