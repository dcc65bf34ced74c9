"""Prompt groups for the rollout: a positioned data source over the prompt dataset, and a buffer taken first.

The data source hands out groups of `n_samples_per_prompt` samples of one prompt. Its position (epoch, offset in
the epoch's order, group and sample counters) is all of its state: `state_dict()` after k rollouts, loaded into a
fresh source over the same prompts, hands out exactly the groups an uninterrupted run would, across epoch
boundaries and with or without shuffling (the order of epoch e is a permutation seeded by rollout_seed + e).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from slimeflow.io.prompts import PromptDataset
from slimeflow.io.storage import Storage
from slimeflow.rollout.types import Sample, Status

Group = list[Sample]
BufferFilter = Callable[[list[Group], int], list[Group]]
"""(buffer, num_groups) -> the groups taken; it removes them from `buffer` (a list it may mutate)."""

START_ROLLOUT_ID = "start_rollout_id"
"""metadata key of a partial sample: the rollout in which its generation started."""


class DataSource:
    """Groups of samples over a `Sequence` of prompt dicts (the prompt-parquet reader's items, or plain dicts).

    An item is `{"prompt": str | list[dict], "label": str | dict | None, "metadata": dict | JSON str, "tools": list | None,
    "row_id": str}`; only "prompt" is required. Tools go to metadata["tools"], the row id to metadata["row_id"].
    """

    def __init__(self, prompts: Sequence[Mapping[str, Any]], *, n_samples_per_prompt: int = 1,
                 shuffle: bool = False, seed: int = 42):
        if len(prompts) == 0:
            raise ValueError("the prompt dataset is empty; point --prompt-data at a dataset with at least one row")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.prompts = prompts
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self.group_index = 0
        self.sample_index = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_prompt_data(cls, uri: str, storage: Storage | None = None, **options: Any) -> DataSource:
        """A data source over the preprocess stage's prompt parquet at `uri` (a file or a set's directory).

        The rows stay in the parquet (memory-mapped locally), decoded a row group at a time as groups are handed
        out; `options` are __init__'s (n_samples_per_prompt, shuffle, seed).
        """
        return cls(PromptDataset(uri, storage), **options)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def get_groups(self, num_groups: int) -> list[Group]:
        """The next `num_groups` groups, wrapping into the next epoch (reshuffled) when this one runs out."""
        groups = []
        for _ in range(num_groups):
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            row = self._order[self.offset]
            self.offset += 1
            groups.append(self._group(row))
        return groups

    def _group(self, row: int) -> Group:
        item = self.prompts[row]
        prompt, label, metadata = _parse_item(item, row)
        group = []
        for _ in range(self.n_samples_per_prompt):
            group.append(Sample(group_index=self.group_index, index=self.sample_index, prompt=json_copy(prompt),
                                label=json_copy(label), metadata=json_copy(metadata)))
            self.sample_index += 1
        self.group_index += 1
        return group

    def state_dict(self) -> dict[str, int]:
        """Everything that positions the source (JSON-serialisable; saved beside each checkpoint)."""
        return {"epoch": self.epoch, "offset": self.offset, "group_index": self.group_index,
                "sample_index": self.sample_index, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from `state`; refuses a state saved over a dataset of a different size."""
        if state.get("num_prompts", len(self.prompts)) != len(self.prompts):
            raise ValueError(
                f"data-source state was saved over {state['num_prompts']} prompts but this dataset has "
                f"{len(self.prompts)}; resume with the same --prompt-data, or start without --load"
            )
        if not 0 <= state["offset"] <= len(self.prompts):
            raise ValueError(f"data-source state offset {state['offset']} is outside 0..{len(self.prompts)}")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.group_index = int(state["group_index"])
        self.sample_index = int(state["sample_index"])
        self._order = self._epoch_order(self.epoch)


_IMMUTABLE = (str, int, float)


def json_copy(value: Any) -> Any:
    """A deep copy of a JSON-like value: dicts and lists are copied, strings, numbers and None shared (they are
    immutable), anything else deep-copied. Each sample needs its own prompt and metadata; copy.deepcopy's
    bookkeeping made them ~3 ms of a 256-sample rollout."""
    if isinstance(value, dict):
        if all(item is None or isinstance(item, _IMMUTABLE) for item in value.values()):
            return dict(value)  # flat (most metadata): a shallow copy is a deep one
        return {key: json_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_copy(item) for item in value]
    if value is None or isinstance(value, _IMMUTABLE):
        return value
    return copy.deepcopy(value)


def _parse_item(item: Mapping[str, Any], row: int) -> tuple[Any, Any, dict[str, Any]]:
    if "prompt" not in item:
        raise ValueError(f"prompt row {row} has no 'prompt' field (fields: {sorted(item)}); "
                         "the prompt dataset must have a 'prompt' column")
    metadata = item.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as exc:
            raise ValueError(f"prompt row {row}: metadata is not valid JSON ({exc}): {metadata[:80]!r}") from exc
    if not isinstance(metadata, dict):
        raise ValueError(f"prompt row {row}: metadata must be a JSON object, got {type(metadata).__name__}")
    metadata = dict(metadata)
    tools = item.get("tools")
    if tools is not None:
        if metadata.get("tools", tools) != tools:
            raise ValueError(f"prompt row {row}: its metadata already has a 'tools' entry that differs from its tools "
                             "column; slime reads tools from metadata['tools']: rename the metadata entry")
        metadata["tools"] = tools
    if item.get("row_id") is not None:
        metadata.setdefault("row_id", item["row_id"])  # a source column of that name (packed) keeps its value
    return item["prompt"], item.get("label"), metadata


def pop_first(buffer: list[Group], num_groups: int) -> list[Group]:
    """The default buffer filter: the oldest `num_groups` groups (FIFO), removed from the buffer."""
    taken = buffer[:num_groups]
    del buffer[:num_groups]
    return taken


class BufferedDataSource:
    """A data source with a buffer in front: groups put back (partial rollouts) are handed out first.

    `buffer_filter` chooses which buffered groups are taken (default pop_first); new groups come from the data
    source only for what the buffer does not cover.
    """

    def __init__(self, source: DataSource, buffer_filter: BufferFilter = pop_first):
        self.source = source
        self.buffer_filter = buffer_filter
        self.buffer: list[Group] = []

    def get_groups(self, num_groups: int) -> list[Group]:
        """Up to `num_groups` groups from the buffer (by the filter), the rest fresh from the data source."""
        taken = self.buffer_filter(self.buffer, num_groups) if self.buffer else []
        if len(taken) > num_groups:
            raise ValueError(f"buffer filter {self.buffer_filter!r} returned {len(taken)} groups; "
                             f"at most {num_groups} were asked for")
        return taken + self.source.get_groups(num_groups - len(taken))

    def add_groups(self, groups: Sequence[Group], rollout_id: int) -> None:
        """Put groups back (aborted half-generated samples); each sample keeps the rollout id it started in."""
        for group in groups:
            for sample in group:
                if sample.status is Status.FAILED:
                    raise ValueError(f"sample {sample.index} failed ({sample.failure_reason}); it cannot be resumed")
                sample.metadata.setdefault(START_ROLLOUT_ID, rollout_id)
            self.buffer.append(list(group))

    def __len__(self) -> int:
        return len(self.buffer)

    def state_dict(self) -> dict[str, Any]:
        """The source's position and the buffered samples."""
        return {"source": self.source.state_dict(),
                "buffer": [[sample.to_dict() for sample in group] for group in self.buffer]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`."""
        if "source" not in state:
            raise ValueError("the checkpoint's data-source state was saved by a --data-source-path class; resume with "
                             "the same --data-source-path, or start without --load")
        self.source.load_state_dict(state["source"])
        self.buffer = [[Sample.from_dict(s) for s in group] for group in state["buffer"]]
