"""One raw row -> the fields of the prompt parquet, or the reason it cannot be used.

slime's keys pick the prompt, label, metadata and tools; every other column is packed into the metadata JSON,
merged with the row's own metadata (a dict or a JSON object string). A packed column whose name is already a
metadata key with a different value is a collision: the row is quarantined, never overwritten.

A label is a string, a number or (as slime passes Search-R1's `reward_model` to reward functions) a JSON object or
array. A set's first label fixes its format: "text" (strings, numbers as their JSON text) or "json" (every label
stored as JSON and read back as the value); a structured label in a text set is quarantined as mixed_label_format.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.preprocess.sources import json_default

Prompt = str | list[dict[str, Any]]
MAX_PLANS = 4096
"""Column tuples whose packing plan is kept (rows with ever new columns are planned one by one)."""


class RowError(ValueError):
    """A row the stage cannot use: `reason` is the quarantine's reason code, the message the detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class Prepared(NamedTuple):
    """A row mapped onto the output schema, before rendering and tokenisation (a tuple: cheap per row)."""

    prompt: Prompt
    label: str | None
    """The label as stored: its text, or its JSON in a set whose label format is json."""
    metadata: str
    tools: list[Any] | None
    row_id: str


@dataclass
class RowMapper:
    """Maps rows with one config's keys; counts the extra columns it packs and drops.

    Rows of one file mostly share their columns, so what to do with each column is worked out once per column
    tuple (a plan). A row whose packing meets a collision is mapped again column by column, so its error and the
    counts of the columns before it are what a one-by-one loop gives.
    """

    config: PreprocessConfig
    packed: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    label_format: str | None = None
    """'text' or 'json', fixed by the first label (None until one is seen)."""

    def __post_init__(self) -> None:
        c = self.config
        self._own = {c.input_key, c.label_key, c.metadata_key, c.tool_key} - {None}
        self._keep = None if c.keep_columns is None else set(c.keep_columns)
        self._drop = set(c.drop_columns)
        self._plans: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}

    def map(self, row: dict[str, Any]) -> Prepared:
        c = self.config
        value = row.get(c.input_key, _MISSING)
        if type(value) is not str:
            if value is _MISSING:
                raise RowError("missing_key", f"no {c.input_key!r} (--input-key); the row has {sorted(row)[:10]}")
            value = _prompt(value, c.input_key)
        label = None if c.label_key is None else row.get(c.label_key)
        if type(label) is not str or self.label_format != "text":
            label = self._label(row)
        metadata = self._metadata(row)
        tools = _tools(row.get(c.tool_key)) if c.tool_key else None
        try:
            metadata_json = orjson.dumps(metadata, default=json_default).decode()
            identity = orjson.dumps(row, default=json_default, option=orjson.OPT_SORT_KEYS)
        except TypeError as err:
            raise RowError("wrong_type", f"a value cannot be written as JSON: {err}") from None
        return Prepared(value, label, metadata_json, tools, hashlib.sha256(identity).hexdigest()[:32])

    def _label(self, row: dict[str, Any]) -> str | None:
        key = self.config.label_key
        if key is None:
            return None
        value = row.get(key)
        if value is None:
            if self.config.missing_label == "keep":
                return None
            raise RowError("missing_label", f"no value for {key!r} (--label-key); --missing-label keep keeps such rows")
        structured = isinstance(value, dict | list)
        if not structured and not isinstance(value, str | bool | int | float):
            raise RowError("wrong_type", f"{key!r} (--label-key) must be a string, a number or a JSON object, got "
                           f"{type(value).__name__}")
        if self.label_format is None:
            self.label_format = "json" if structured else "text"
        if self.label_format == "json":
            try:
                return orjson.dumps(value, default=json_default).decode()
            except TypeError as err:
                raise RowError("wrong_type", f"{key!r} (--label-key) cannot be written as JSON: {err}") from None
        if structured:
            raise RowError("mixed_label_format", f"{key!r} (--label-key) is a {type(value).__name__} in a set whose "
                           "first labels are strings; give one kind of label per set (or put this one in the metadata)")
        return value if isinstance(value, str) else orjson.dumps(value).decode()

    def _metadata(self, row: dict[str, Any]) -> dict[str, Any]:
        key = self.config.metadata_key
        metadata = _existing_metadata(row.get(key), key)
        columns = tuple(row)
        plan = self._plans.get(columns)
        if plan is None:
            plan = self._plan(columns)
            if len(self._plans) < MAX_PLANS:
                self._plans[columns] = plan
        pack, drop = plan
        for name in pack:
            value = row[name]
            if name in metadata and metadata[name] != value:
                return self._metadata_by_column(row)  # raises, counting as a column-by-column loop does
            metadata[name] = value
        for name in pack:
            self.packed[name] += 1
        for name in drop:
            self.dropped[name] += 1
        return metadata

    def _plan(self, columns: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(columns to pack, columns to drop) among a row's columns, in row order."""
        extra = [name for name in columns if name not in self._own]
        dropped = tuple(n for n in extra if n in self._drop or (self._keep is not None and n not in self._keep))
        return tuple(n for n in extra if n not in dropped), dropped

    def _metadata_by_column(self, row: dict[str, Any]) -> dict[str, Any]:
        key = self.config.metadata_key
        metadata = _existing_metadata(row.get(key), key)
        for name, value in row.items():
            if name in self._own:
                continue
            if name in self._drop or (self._keep is not None and name not in self._keep):
                self.dropped[name] += 1
                continue
            if name in metadata and metadata[name] != value:
                raise RowError("metadata_collision", f"column {name!r} is also a key of {key!r} with another value "
                               f"({_short(value)} vs {_short(metadata[name])}); rename one, or --drop-columns {name}")
            metadata[name] = value
            self.packed[name] += 1
        return metadata


_MISSING = object()


def _prompt(value: Any, key: str) -> Prompt:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        return value
    if value is None:
        raise RowError("missing_key", f"{key!r} (--input-key) is null")
    raise RowError("wrong_type", f"{key!r} (--input-key) must be a string or a list of messages "
                   f"({{'role': ..., 'content': ...}}), got {_short(value)}")


def _existing_metadata(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str):
        try:
            parsed = orjson.loads(value) if value.strip() else {}
        except orjson.JSONDecodeError as err:
            raise RowError("wrong_type", f"{key!r} (--metadata-key) is a string but not JSON: {err}") from None
        if isinstance(parsed, dict):
            return parsed
    raise RowError("wrong_type", f"{key!r} (--metadata-key) must be an object or a JSON object string, got {_short(value)}")


def _tools(value: Any) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as err:
            raise RowError("wrong_type", f"tools (--tool-key) is a string but not JSON: {err}") from None
    if not isinstance(value, list):
        raise RowError("wrong_type", f"tools (--tool-key) must be a list of tool schemas, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_empty(prompt: Prompt) -> bool:
    """An empty or blank string, or a messages list with no message or only empty contents."""
    if isinstance(prompt, str):
        return not prompt.strip()
    return not any(str(m.get("content") or "").strip() for m in prompt)
