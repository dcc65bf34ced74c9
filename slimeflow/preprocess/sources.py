"""Raw inputs -> batches of (position, row dict), with every unreadable row or file reported, never dropped.

An input spec is a file, a directory (every supported file below it) or a glob (`data/*.jsonl`; `*` may cross
'/'), as a local path or an s3:// URI. Formats go by suffix: .jsonl/.ndjson, .json (an array of objects), .csv
(each optionally .gz) and .parquet. Positions are 1-based: lines for JSONL and CSV, rows for JSON arrays and
parquet; a problem with a whole file (empty, header-only, unreadable) has position 0 and counts as one row.

Reading streams: JSONL and CSV line by line, parquet by record batch; a JSON array is read whole (use JSONL for
large data). CSV cells are strings; an empty cell is null.
"""

from __future__ import annotations

import base64
import csv
import datetime as dt
import decimal
import fnmatch
import gzip
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import orjson
import pyarrow.parquet as pq

from slimeflow.errors import StageInputError, StorageError
from slimeflow.io.storage import Storage, is_local, local_path

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
RAW_LIMIT = 2000
"""Characters of a bad row kept in the quarantine."""
READ_CHUNK = 1 << 20
"""Bytes read at a time from a plain JSONL file."""


@dataclass(frozen=True)
class Problem:
    """A row (or file) that cannot be used: where it is, why, and what it held (truncated)."""

    file: str
    position: int
    unit: str
    """'line' or 'row': what `position` counts."""
    reason: str
    detail: str
    raw: str = ""

    def where(self) -> str:
        return f"{self.file}" + (f" {self.unit} {self.position}" if self.position else "")

    def record(self, dataset: str) -> dict[str, Any]:
        return {"dataset": dataset, "file": self.file, self.unit: self.position, "reason": self.reason,
                "detail": self.detail, "raw": self.raw}


@dataclass
class SourceBatch:
    """Rows read from one file, in order, with the problems met among them."""

    file: str
    unit: str
    rows: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows) + len(self.problems)


def file_format(uri: str) -> str | None:
    """'jsonl', 'json', 'csv' or 'parquet' by suffix (a .gz suffix is looked through); None if unsupported."""
    name = uri.rsplit("/", 1)[-1].lower().removesuffix(".gz")
    return next((fmt for suffix, fmt in FORMATS.items() if name.endswith(suffix)), None)


def resolve(spec: str, storage: Storage) -> tuple[list[str], list[str]]:
    """(supported files, skipped files) named by a file, directory or glob spec; StageInputError if none."""
    if any(ch in spec for ch in "*?["):
        base = spec[: min(spec.index(ch) for ch in "*?[" if ch in spec)].rsplit("/", 1)[0]
        candidates = [u for u in _list_files(base, storage) if fnmatch.fnmatchcase(u, spec)]
    elif storage.isdir(spec):
        candidates = _list_files(spec, storage)
    elif storage.exists(spec):
        if file_format(spec) is None:
            raise StageInputError(f"input {spec}", [f"unsupported file type; supported: {_supported()}"],
                                  "Rename the file with the suffix of its format.")
        return [spec], []
    else:
        raise StageInputError(f"input {spec}", ["no such file, directory or object"],
                              "Check the path (and the bucket and S3 endpoint for s3://).")
    hidden = [u for u in candidates if u.rsplit("/", 1)[-1].startswith((".", "_"))]  # _SUCCESS, .crc, ...
    files = [u for u in candidates if u not in hidden and file_format(u) is not None]
    if not files:
        raise StageInputError(f"input {spec}", [f"matches no data file ({len(candidates)} other files)"],
                              f"Point it at files of a supported type: {_supported()}.")
    return files, sorted(set(candidates) - set(files))


def _list_files(base: str, storage: Storage) -> list[str]:
    try:
        return storage.list(base or ".", recursive=True)
    except StorageError:
        return []


def _supported() -> str:
    return ", ".join([*FORMATS, *(s + ".gz" for s in FORMATS if s != ".parquet")])


Item = tuple[int, dict[str, Any]] | tuple[int, str, str, str | bytes]
"""What a format reader yields: (position, row), or (position, reason, detail, raw) for a problem."""


def read_batches(uri: str, storage: Storage, batch_size: int) -> Iterator[SourceBatch]:
    """Batches of at most `batch_size` rows and problems from one file; a file with no rows yields a problem."""
    fmt = file_format(uri)
    reader = {"jsonl": _read_jsonl, "json": _read_json_array, "csv": _read_csv, "parquet": _read_parquet}[fmt]
    unit = "row" if fmt in ("json", "parquet") else "line"
    batch, size, empty = SourceBatch(uri, unit), 0, True
    try:
        for item in reader(uri, storage):
            if len(item) == 2:
                batch.rows.append(item)  # type: ignore[arg-type]
            else:
                _add_problem(batch, item)  # type: ignore[arg-type]
            size += 1
            if size >= batch_size:
                yield batch
                batch, size, empty = SourceBatch(uri, unit), 0, False
    except (OSError, EOFError, ValueError) as err:  # corrupt gzip or parquet, truncated stream
        empty = False
        _add_problem(batch, (0, "unreadable_file", f"{type(err).__name__}: {err}", ""))
    if empty and not len(batch):
        _add_problem(batch, (0, "empty_file", "the file holds no rows", ""))
    if len(batch):
        yield batch


def unreadable(uri: str, err: Exception) -> SourceBatch:
    """The batch of a file that cannot be opened at all (a dangling symlink, no permission): one problem."""
    batch = SourceBatch(uri, "line" if file_format(uri) in ("jsonl", "csv") else "row")
    path = local_path(uri) if is_local(uri) else None
    if path is not None and path.is_symlink() and not path.exists():
        detail = f"a dangling symlink to {path.readlink()}; point it at the file or remove it"
    else:
        detail = f"{type(err).__name__}: {err}"
    _add_problem(batch, (0, "unreadable_file", detail, ""))
    return batch


def _add_problem(batch: SourceBatch, item: tuple[int, str, str, str | bytes]) -> None:
    position, reason, detail, raw = item
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    batch.problems.append(Problem(batch.file, position, batch.unit, reason, detail, text[:RAW_LIMIT]))


@contextmanager
def _open(uri: str, storage: Storage) -> Iterator[BinaryIO]:
    with storage.open_read(uri) as raw:
        if uri.lower().endswith(".gz"):
            with gzip.GzipFile(fileobj=raw) as unzipped:
                yield unzipped  # type: ignore[misc]
        else:
            yield raw


def _read_jsonl(uri: str, storage: Storage) -> Iterator[Item]:
    """Blank lines are not rows. A line that does not parse to an object is classified by _parse_json_line, as
    read (with its newline)."""
    loads, malformed = orjson.loads, orjson.JSONDecodeError
    with _open(uri, storage) as stream:
        number = 0
        for lines, terminated in _line_blocks(stream, uri.lower().endswith(".gz")):
            for line in lines:
                number += 1
                try:
                    value = loads(line)
                except malformed:
                    if line.strip():
                        yield _parse_json_line(number, line + b"\n" if terminated else line)
                    continue
                if type(value) is dict:
                    yield number, value
                else:
                    yield _parse_json_line(number, line + b"\n" if terminated else line)


def _line_blocks(stream: BinaryIO, compressed: bool) -> Iterator[tuple[list[bytes], bool]]:
    """The stream's lines without their newline, in blocks, each with whether its lines had one (only the last
    line may not). Plain files are split a chunk at a time (a file object's readline is a Python call per line);
    a compressed stream line by line, so a corrupt one still gives every line before the damage."""
    if compressed:
        for line in stream:
            yield ([line[:-1]], True) if line.endswith(b"\n") else ([line], False)
        return
    pending: list[bytes] = []  # the start of a line that runs past the chunks read so far
    while chunk := stream.read(READ_CHUNK):
        lines = chunk.split(b"\n")
        if len(lines) == 1:
            pending.append(chunk)
            continue
        if pending:
            lines[0] = b"".join([*pending, lines[0]])
        pending = [lines.pop()]
        yield lines, True
    tail = b"".join(pending)
    if tail:
        yield [tail], False


def _parse_json_line(number: int, line: bytes) -> Item:
    try:  # orjson checks the UTF-8 itself; a failure is classified below
        value = orjson.loads(line)
        if isinstance(value, dict):
            return number, value
    except orjson.JSONDecodeError:
        pass
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return number, "invalid_utf8", f"byte {err.start}: {err.reason}", line
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        return number, "malformed_json", str(err), text
    if not isinstance(value, dict):
        return number, "wrong_type", f"a line must hold a JSON object, got {_kind(value)}", text
    return number, value


def _read_json_array(uri: str, storage: Storage) -> Iterator[Item]:
    with _open(uri, storage) as stream:
        data = stream.read()
    if not data.strip():
        return
    try:
        value = orjson.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        yield 0, "invalid_utf8", f"line {line}, byte {err.start}: {err.reason}; the file cannot be parsed", ""
        return
    except orjson.JSONDecodeError as err:
        yield 0, "malformed_json", f"{err}; the file cannot be parsed", data[:RAW_LIMIT]
        return
    if not isinstance(value, list):
        yield 0, "wrong_type", f"a .json input must hold an array of objects, got {_kind(value)}", ""
        return
    for number, item in enumerate(value, start=1):
        if isinstance(item, dict):
            yield number, item
        else:
            yield number, "wrong_type", f"an element must be a JSON object, got {_kind(item)}", _dump(item)


def _read_csv(uri: str, storage: Storage) -> Iterator[Item]:
    bad_lines: dict[int, str] = {}
    with _open(uri, storage) as stream:
        reader = csv.reader(_decoded_lines(stream, bad_lines))
        header = next(reader, None)
        if header is None:  # no line at all (or only undecodable ones)
            yield from _bad_lines(bad_lines)
            return
        start, any_rows = reader.line_num + 1, False
        for cells in reader:
            any_rows = any_rows or bool(bad_lines)
            yield from _bad_lines(bad_lines)
            number, start = start, reader.line_num + 1
            if not cells:
                continue
            any_rows = True
            if len(cells) != len(header):
                yield number, "bad_csv_row", f"{len(cells)} fields, the header has {len(header)}", ",".join(cells)
            else:
                yield number, {k: (v if v != "" else None) for k, v in zip(header, cells, strict=True)}
        any_rows = any_rows or bool(bad_lines)
        yield from _bad_lines(bad_lines)
    if not any_rows:
        yield 1, "header_only_csv", f"only a header ({', '.join(header)}), no rows", ""


def _decoded_lines(stream: Iterable[bytes], bad: dict[int, str]) -> Iterator[str]:
    """Lines as text; a line that is not UTF-8 is recorded in `bad` and replaced by an empty line."""
    for number, line in enumerate(stream, start=1):
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as err:
            bad[number] = f"byte {err.start}: {err.reason}"
            yield "\n"


def _bad_lines(bad: dict[int, str]) -> Iterator[Item]:
    for number, detail in sorted(bad.items()):
        yield number, "invalid_utf8", detail, ""
    bad.clear()


def _read_parquet(uri: str, storage: Storage) -> Iterator[Item]:
    with storage.open_read(uri) as stream:
        number = 0
        for record_batch in pq.ParquetFile(stream).iter_batches(batch_size=4096):
            for row in record_batch.to_pylist():
                number += 1
                yield number, row


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", type(None): "null"}.get(type(value), type(value).__name__)


def json_default(value: Any) -> Any:
    """JSON for the non-JSON values parquet can hold: dates as ISO text, decimals as text, bytes as UTF-8 or base64."""
    if isinstance(value, dt.date | dt.time | dt.timedelta):
        return str(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(value).decode()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _dump(value: Any) -> str:
    return orjson.dumps(value, default=json_default).decode()
