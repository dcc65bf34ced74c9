"""slime.rollout.data_source: the base class of a data source (--data-source-path), slime's default classes
(RolloutDataSource, RolloutDataSourceWithBuffer) and the default buffer filter, with slime's signatures.

The default classes are slimeflow's data source and buffer (slimeflow.rollout.data_source) behind slime's API, for a
--data-source-path class that subclasses them: --prompt-data is read as slimeflow reads it (its prompt parquet
as it is; raw JSONL/JSON/CSV/parquet through slimeflow's preprocess mapping of --input-key, --label-key, ...,
cached by content under the temporary directory), groups are handed out in order, wrapping into the next epoch
(reshuffled with --rollout-shuffle: slimeflow's order, seeded by --rollout-seed + epoch, not slime's). The saved
state is slime's file (args.save/rollout/global_dataset_state_dict_ID.pt, slime's keys).
"""

from __future__ import annotations

import abc
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from slimeflow.config.train import DataConfig
from slimeflow.io.storage import Storage
from slimeflow.preprocess.inline import TRAIN, is_raw, prepare_raw
from slimeflow.rollout import data_source as ours
from slimeflow.rollout.raw_data import preprocess_config
from slimeflow.slime_compat.utils.misc import load_function
from slimeflow.slime_compat.utils.types import Sample

logger = logging.getLogger(__name__)
PREPARED_ROOT = Path(tempfile.gettempdir()) / "slimeflow-slime-data-source"
"""Where raw --prompt-data is preprocessed (keyed by its content and mapping, so a rerun reuses it)."""
STATE_KEYS = {"sample_offset": "offset", "epoch_id": "epoch", "sample_group_index": "group_index",
              "sample_index": "sample_index"}
"""slime's saved state keys -> slimeflow's data-source state keys."""


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


def _data_config(args: Any) -> DataConfig:
    """The data flags of `args`: the run's own (slimeflow's args carry its config), else slime's attributes."""
    config = getattr(args, "config", None)
    if config is not None and hasattr(config, "data"):
        return config.data
    return DataConfig(**{name: getattr(args, name) for name in DataConfig.model_fields
                         if getattr(args, name, None) is not None and name != "data_source_path"})


def _prompt_source(args: Any) -> ours.DataSource | None:
    """slimeflow's data source over args.prompt_data (None without a global dataset or prompt data, as slime)."""
    if not getattr(args, "rollout_global_dataset", True) or getattr(args, "prompt_data", None) is None:
        return None
    storage, uri = Storage(), args.prompt_data
    if is_raw(uri, storage):
        data = _data_config(args)
        uri = prepare_raw(TRAIN, uri, preprocess_config(data, getattr(args, "hf_checkpoint", None)), storage,
                          PREPARED_ROOT).prompt_data
    return ours.DataSource.from_prompt_data(uri, storage, n_samples_per_prompt=args.n_samples_per_prompt,
                                            shuffle=bool(getattr(args, "rollout_shuffle", False)),
                                            seed=int(getattr(args, "rollout_seed", 42)))


class RolloutDataSource(DataSource):
    """slime's read-only default data source: --prompt-data's groups in order (slimeflow's DataSource); without a
    global dataset or prompt data, groups of empty samples, numbered."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.metadata: dict[str, Any] = {}
        self.source = _prompt_source(args)
        self._empty = {"epoch": 0, "offset": 0, "group_index": 0, "sample_index": 0}
        """The position when there is no prompt data (only the counters move)."""

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        if self.source is not None:
            return self.source.get_groups(num_samples)
        groups = []
        for _ in range(num_samples):
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                group.append(Sample(group_index=self._empty["group_index"], index=self._empty["sample_index"]))
                self._empty["sample_index"] += 1
            self._empty["group_index"] += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError(f"Cannot add samples to {type(self).__name__}: it is read-only (use "
                           "RolloutDataSourceWithBuffer to take groups back)")

    def _state(self) -> dict[str, int]:
        return self.source.state_dict() if self.source is not None else dict(self._empty)

    def save(self, rollout_id: int) -> None:
        """slime's state file under args.save (nothing without a global dataset)."""
        if not getattr(self.args, "rollout_global_dataset", True):
            return
        state = self._state()
        path = os.path.join(self.args.save, f"rollout/global_dataset_state_dict_{rollout_id}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({**{slime: state[key] for slime, key in STATE_KEYS.items()}, "metadata": self.metadata}, path)

    def load(self, rollout_id: int | None = None) -> None:
        """The state saved after `rollout_id` under args.load, when there is one (slime's file)."""
        if not getattr(self.args, "rollout_global_dataset", True) or getattr(self.args, "load", None) is None:
            return
        path = os.path.join(self.args.load, f"rollout/global_dataset_state_dict_{rollout_id}.pt")
        if not os.path.exists(path):
            logger.info("no data-source state at %s: starting from the beginning of --prompt-data", path)
            return
        saved = torch.load(path)
        state = {key: int(saved.get(slime, 0)) for slime, key in STATE_KEYS.items()}
        self.metadata = saved.get("metadata", {})
        if self.source is None:
            self._empty = state
        else:
            self.source.load_state_dict(state)

    def __len__(self) -> int:
        return 0 if self.source is None else len(self.source.prompts)


class _Unbuffered:
    """RolloutDataSource.get_samples as slimeflow's `get_groups`, the source behind the buffer."""

    def __init__(self, owner: RolloutDataSource) -> None:
        self.owner = owner

    def get_groups(self, num_groups: int) -> list[list[Sample]]:
        return RolloutDataSource.get_samples(self.owner, num_groups) if num_groups else []


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """slime's default data source: RolloutDataSource with a buffer in front (slimeflow's BufferedDataSource),
    taken first through --buffer-filter-path (default pop_first)."""

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        path = getattr(args, "buffer_filter_path", None)
        self.buffer_filter = pop_first if path is None else load_function(path)
        self._buffered = ours.BufferedDataSource(
            _Unbuffered(self), lambda buffer, num: self.buffer_filter(self.args, None, buffer, num))

    @property
    def buffer(self) -> list[list[Sample]]:
        return self._buffered.buffer

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return self._buffered.get_groups(num_samples)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Put groups into the buffer; each must be a list of --n-samples-per-prompt samples."""
        if not samples:
            return
        if not isinstance(samples, list) or any(not isinstance(group, list) for group in samples):
            raise TypeError(f"add_samples takes a list of groups (lists of Samples), got {type(samples).__name__}")
        wrong = [len(group) for group in samples if len(group) != self.args.n_samples_per_prompt]
        if wrong:
            raise ValueError(f"add_samples: a group of {wrong[0]} samples; each group holds --n-samples-per-prompt "
                             f"{self.args.n_samples_per_prompt}")
        self.buffer.extend(samples)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict[str, Any]:
        return self.metadata

    def get_buffer_length(self) -> int:
        return len(self.buffer)
