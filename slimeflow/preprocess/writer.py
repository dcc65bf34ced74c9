"""Writing the prompt parquet: the fixed schema, full row groups, an optional seeded shuffle; and deduplication.

Rows arrive in batches and leave in row groups of exactly `row_group_size` rows (the last one shorter), so memory
holds one row group. A shuffled dataset is first staged as an uncompressed Arrow IPC file, then written in a
seeded permutation read back through a memory map: the permutation costs 8 bytes a row, the rows stay on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from slimeflow.io.prompts import LABEL_FORMAT_KEY, PROMPT_FORMAT_KEY, SCHEMA

PARQUET_OPTIONS: dict[str, Any] = {"compression": "zstd", "use_dictionary": ["label", "tools"]}
"""Dictionary-encode only the columns that repeat: ids, prompts (deduplicated) and metadata rarely do, and trying
costs time for no smaller file."""


def schema_for(prompt_format: str, label_format: str = "text") -> pa.Schema:
    formats = {PROMPT_FORMAT_KEY: prompt_format.encode()}
    if label_format != "text":
        formats[LABEL_FORMAT_KEY] = label_format.encode()
    return SCHEMA.with_metadata(formats)


class DatasetWriter:
    """One output dataset: a local parquet file written in full row groups (via an IPC staging file if shuffled)."""

    def __init__(self, path: Path, row_group_size: int, shuffle_seed: int | None = None):
        self.path = path
        self.row_group_size = row_group_size
        self.shuffle_seed = shuffle_seed
        self.rows = 0
        self.prompt_format: str | None = None
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._writer: Any = None
        self._sink: Any = None

    def write(self, columns: dict[str, list[Any]], prompt_format: str, label_format: str = "text") -> None:
        """Append rows given as columns of the schema (in any order)."""
        batch = pa.RecordBatch.from_pydict(columns, schema=schema_for(prompt_format, label_format))
        if not batch.num_rows:
            return
        if self._writer is None:
            self._open(batch.schema)
            self.prompt_format = prompt_format
        self.rows += batch.num_rows
        if self.shuffle_seed is not None:
            self._writer.write_batch(batch)
            return
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        if self._pending_rows >= self.row_group_size:
            self._flush(final=False)

    def _open(self, schema: pa.Schema) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.shuffle_seed is None:
            self._writer = pq.ParquetWriter(self.path, schema, **PARQUET_OPTIONS)
        else:
            self._sink = pa.OSFile(str(self._staging), "wb")
            self._writer = pa.ipc.new_file(self._sink, schema)

    @property
    def _staging(self) -> Path:
        return self.path.with_name(self.path.name + ".arrow")

    def _flush(self, final: bool) -> None:
        table = pa.Table.from_batches(self._pending)
        whole = table.num_rows if final else table.num_rows - table.num_rows % self.row_group_size
        if whole:
            self._writer.write_table(table.slice(0, whole), row_group_size=self.row_group_size)
        rest = table.slice(whole)
        self._pending = rest.to_batches() if rest.num_rows else []
        self._pending_rows = rest.num_rows

    def close(self) -> bool:
        """Finish the file; False (and no file) when no row was written."""
        if self._writer is None:
            return False
        if self.shuffle_seed is None:
            self._flush(final=True)
            self._writer.close()
            return True
        self._writer.close()
        self._sink.close()
        self._write_shuffled()
        self._staging.unlink()
        return True

    def _write_shuffled(self) -> None:
        with pa.memory_map(str(self._staging)) as source:
            table = pa.ipc.open_file(source).read_all()  # zero-copy over the map
            order = np.random.default_rng(self.shuffle_seed).permutation(table.num_rows)
            with pq.ParquetWriter(self.path, table.schema, **PARQUET_OPTIONS) as writer:
                for start in range(0, table.num_rows, self.row_group_size):
                    writer.write_table(table.take(order[start : start + self.row_group_size]))


class Deduper:
    """Exact-duplicate detection by a 64-bit content hash, in 8 bytes per distinct prompt.

    Seen hashes live in sorted numpy runs merged like a binary counter (a run is merged into the previous one
    when it has grown as large) up to MAX_RUN entries, so a lookup is a few binary searches, and memory stays
    near 8 bytes a prompt: merging never copies more than two runs of MAX_RUN.
    """

    MAX_RUN = 1 << 18

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def first_seen(self, hashes: np.ndarray) -> np.ndarray:
        """A mask of the hashes seen neither earlier in this batch nor in any earlier batch; records them."""
        _, first = np.unique(hashes, return_index=True)
        keep = np.zeros(len(hashes), dtype=bool)
        keep[first] = True
        for run in self._runs:
            positions = np.searchsorted(run, hashes).clip(max=len(run) - 1)
            keep &= run[positions] != hashes
        self._add(np.sort(hashes[keep]))
        return keep

    def _add(self, run: np.ndarray) -> None:
        if not len(run):
            return
        self._runs.append(run)
        while len(self._runs) > 1 and len(self._runs[-2]) <= len(self._runs[-1]) < self.MAX_RUN:
            newer = self._runs.pop()
            self._runs[-1] = np.union1d(self._runs[-1], newer)
