"""The prompt parquet, the contract between the preprocess stage (which writes it: its writer.py) and its readers
(train, evaluate): the schema, and reading it back as slime-style prompt dicts.

`PromptDataset(uri)` is a Sequence over a parquet file or a directory of them (the files in name order): it
holds only the row-group layout and decodes one row group at a time on access (a small cache makes sequential
and nearby reads cheap), so a dataset of any size costs about one row group of memory. `iter_prompts` streams.
Items: {"prompt": str | list[dict], "label": str | dict | list | number | None, "metadata": dict, "tools": list |
None, "row_id": str}; the prompt is a messages list when the file says `slimeflow.prompt_format = messages`, the
label the JSON value it holds when `slimeflow.label_format = json` (else its text).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from slimeflow.io.storage import Storage, is_local, local_path

PROMPT_FORMAT_KEY = b"slimeflow.prompt_format"
LABEL_FORMAT_KEY = b"slimeflow.label_format"
"""'json' when the label column holds JSON (object labels); absent: labels are plain text."""
SCHEMA = pa.schema([
    pa.field("row_id", pa.string(), nullable=False),
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("label", pa.string()),
    pa.field("metadata", pa.string(), nullable=False),
    pa.field("tools", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
])
"""The prompt-parquet contract shared with the RL core's data source."""
COLUMNS = [f.name for f in SCHEMA]
CACHED_ROW_GROUPS = 4


def parquet_files(uri: str, storage: Storage) -> list[str]:
    """The parquet files of `uri` (itself, or every .parquet below a directory, in name order)."""
    if not storage.isdir(uri):
        return [uri]
    files = [u for u in storage.list(uri, recursive=True)
             if u.endswith(".parquet") and not u.rsplit("/", 1)[-1].startswith((".", "_"))]
    if not files:
        raise FileNotFoundError(f"{uri}: no .parquet files under it; point at the preprocess stage's output set")
    return files


def _open(uri: str, storage: Storage) -> pq.ParquetFile:
    if is_local(uri):
        return pq.ParquetFile(str(local_path(uri)), memory_map=True)
    return pq.ParquetFile(storage.open_read(uri))


Formats = tuple[str, str]
"""(prompt format, label format) of a file."""


def _check_schema(uri: str, schema: pa.Schema) -> Formats:
    missing = [name for name in COLUMNS if name not in schema.names]
    if missing:
        raise ValueError(f"{uri}: not a prompt parquet, it lacks {missing}; write it with the preprocess stage, or "
                         "give the raw file to the train stage, which preprocesses it")
    metadata = schema.metadata or {}
    return metadata.get(PROMPT_FORMAT_KEY, b"text").decode(), metadata.get(LABEL_FORMAT_KEY, b"text").decode()


def to_prompt(row: dict[str, Any], formats: Formats) -> dict[str, Any]:
    """One stored row -> the prompt dict the data source takes."""
    prompt = orjson.loads(row["prompt"]) if formats[0] == "messages" else row["prompt"]
    label = row["label"]
    if label is not None and formats[1] == "json":
        label = orjson.loads(label)
    tools = row["tools"]
    return {"prompt": prompt, "label": label, "metadata": orjson.loads(row["metadata"]),
            "tools": None if tools is None else orjson.loads(tools), "row_id": row["row_id"]}


class PromptDataset(Sequence):
    """Random access to a prompt parquet; see the module docstring."""

    def __init__(self, uri: str, storage: Storage | None = None):
        self.uri = uri
        self._storage = storage or Storage()
        uris = parquet_files(uri, self._storage)
        self._files = [_open(u, self._storage) for u in uris]
        self._formats = [_check_schema(u, f.schema_arrow) for u, f in zip(uris, self._files, strict=True)]
        self._starts: list[int] = []  # first global row of each (file, row group)
        self._groups: list[tuple[int, int]] = []
        total = 0
        for index, file in enumerate(self._files):
            for group in range(file.metadata.num_row_groups):
                self._starts.append(total)
                self._groups.append((index, group))
                total += file.metadata.row_group(group).num_rows
        self._len = total
        self._cache: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"prompt index {index} out of range for {self._len} rows")
        slot = bisect.bisect_right(self._starts, index) - 1
        return to_prompt(self._rows(slot)[index - self._starts[slot]], self._formats[self._groups[slot][0]])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for slot, (file, _) in enumerate(self._groups):
            for row in self._read(slot):
                yield to_prompt(row, self._formats[file])

    def _rows(self, slot: int) -> list[dict[str, Any]]:
        if slot in self._cache:
            self._cache.move_to_end(slot)
            return self._cache[slot]
        rows = self._read(slot)
        self._cache[slot] = rows
        if len(self._cache) > CACHED_ROW_GROUPS:
            self._cache.popitem(last=False)
        return rows

    def _read(self, slot: int) -> list[dict[str, Any]]:
        file, group = self._groups[slot]
        return self._files[file].read_row_group(group, columns=COLUMNS).to_pylist()


def open_prompt_sets(sets: Mapping[str, str], storage: Storage) -> tuple[dict[str, PromptDataset], list[str]]:
    """Each named prompt parquet opened (schema checked, rows counted), and a problem for every one that is missing,
    unreadable, not prompt parquet or empty: `"NAME: URI: what is wrong"`. Rows are not decoded."""
    datasets, problems = {}, []
    for name, uri in sets.items():
        try:
            if not storage.exists(uri):
                problems.append(f"{name}: {uri}: no such file, directory or object")
                continue
            dataset = PromptDataset(uri, storage)
        except Exception as exc:  # every unreadable set is reported, not just the first
            problems.append(f"{name}: {uri}: {type(exc).__name__}: {exc}")
            continue
        if len(dataset) == 0:
            problems.append(f"{name}: {uri}: has no rows (a set needs at least one prompt)")
        else:
            datasets[name] = dataset
    return datasets, problems


def iter_prompts(uri: str, batch_size: int = 1024, storage: Storage | None = None) -> Iterator[dict[str, Any]]:
    """Every prompt dict of `uri` in order, decoding `batch_size` rows at a time."""
    storage = storage or Storage()
    for file_uri in parquet_files(uri, storage):
        file = _open(file_uri, storage)
        formats = _check_schema(file_uri, file.schema_arrow)
        for batch in file.iter_batches(batch_size=batch_size, columns=COLUMNS):
            for row in batch.to_pylist():
                yield to_prompt(row, formats)
