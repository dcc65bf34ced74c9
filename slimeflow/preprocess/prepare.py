"""The front half of preprocessing: source batches -> prepared batches (mapped, rendered, empty prompts dropped,
bad rows collected, deduplicated when nothing is filtered after counting), one input set's batches in order.

The stage's back half (stage.py) counts tokens, filters, quarantines and writes them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import numpy as np
import orjson

from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.preprocess.rows import Prepared, RowError, RowMapper, is_empty
from slimeflow.preprocess.sources import Problem, SourceBatch, json_default
from slimeflow.preprocess.tokens import PromptTokenizer
from slimeflow.preprocess.writer import Deduper


@dataclass
class Rows:
    """A batch's kept rows: mapped rows, their stored prompt texts and (once counted) token counts, in order."""

    prepared: list[Prepared] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    tokens: list[int] | None = None

    def __len__(self) -> int:
        return len(self.prepared)

    def where(self, mask: Iterable[bool] | None) -> Rows:
        """The rows where `mask` is true (all of them for None)."""
        if mask is None:
            return self
        tokens = None if self.tokens is None else list(compress(self.tokens, mask))
        return Rows(list(compress(self.prepared, mask)), list(compress(self.texts, mask)), tokens)

    def take(self, indices: list[int]) -> Rows:
        tokens = None if self.tokens is None else [self.tokens[i] for i in indices]
        return Rows([self.prepared[i] for i in indices], [self.texts[i] for i in indices], tokens)

    def columns(self) -> dict[str, list[Any]]:
        _, labels, metadata, tools, row_ids = (list(column) for column in zip(*self.prepared, strict=True))
        if tools.count(None) != len(tools):
            tools = [None if t is None else orjson.dumps(t).decode() for t in tools]
        return {"row_id": row_ids, "prompt": self.texts, "label": labels, "metadata": metadata, "tools": tools,
                "prompt_tokens": self.tokens if self.tokens is not None else [None] * len(self.texts)}


@dataclass
class PreparedBatch:
    """One source batch, prepared: its kept rows, its problems in file order, its rows in, empty prompts and
    duplicates (None: deduplicated after counting), and the set's prompt format so far."""

    rows: Rows
    problems: list[Problem]
    rows_in: int
    empty: int
    duplicates: int | None
    prompt_format: str | None
    label_format: str | None = None


class Preparer:
    """Maps, renders and (when nothing is filtered after counting) deduplicates one input set's batches, in order."""

    def __init__(self, config: PreprocessConfig, tokenizer: PromptTokenizer | None):
        self.config, self.tokenizer = config, tokenizer
        self.mapper = RowMapper(config)
        self.deduper = Deduper() if config.dedup and config.rollout_max_prompt_len is None else None
        self.prompt_format: str | None = None
        self._render = config.apply_chat_template and tokenizer is not None

    def prepare(self, batch: SourceBatch) -> PreparedBatch:
        problems = list(batch.problems)
        rows = Rows()
        prepared, texts, empty = rows.prepared, rows.texts, 0
        map_row, plain = self.mapper.map, not self._render
        for position, row in batch.rows:
            try:
                mapped = map_row(row)
                prompt = mapped.prompt
                if plain and type(prompt) is str and self.prompt_format == "text":  # the common case, inline
                    if not prompt.strip():
                        empty += 1
                        continue
                    text = prompt
                elif is_empty(prompt):
                    empty += 1
                    continue
                else:
                    text = self._text(mapped)
                prepared.append(mapped)
                texts.append(text)
            except RowError as err:
                raw = orjson.dumps(row, default=json_default, option=orjson.OPT_NON_STR_KEYS).decode()
                problems.append(Problem(batch.file, position, batch.unit, err.reason, str(err), raw[:2000]))
        problems.sort(key=lambda p: p.position)  # file order, so --strict names the first
        duplicates = None
        mask = first_seen(self.deduper, rows.texts)  # nothing is too long: dedup first, count only what is kept
        if mask is not None:
            rows, duplicates = rows.where(mask), int(len(mask) - mask.sum())
        return PreparedBatch(rows, problems, len(batch), empty, duplicates, self.prompt_format,
                             self.mapper.label_format)

    def _text(self, prepared: Prepared) -> str:
        """The prompt as stored: rendered text, the string itself, or the messages' JSON (one format per set)."""
        if self._render:
            text, fmt = self.tokenizer.render(prepared.prompt, prepared.tools), "text"  # type: ignore[union-attr]
        elif isinstance(prepared.prompt, str):
            text, fmt = prepared.prompt, "text"
        else:
            text, fmt = orjson.dumps(prepared.prompt).decode(), "messages"
        if self.prompt_format is None:
            self.prompt_format = fmt
        elif fmt != self.prompt_format:
            raise RowError("mixed_prompt_format", f"a {fmt} prompt in a set whose prompts are "
                           f"{self.prompt_format}; use one kind, or --apply-chat-template to render both")
        return text


def first_seen(deduper: Deduper | None, texts: list[str]) -> np.ndarray | None:
    """A mask of the prompts not seen before (None: all, without dedup, or no texts)."""
    if deduper is None or not texts:
        return None
    digests = b"".join([hashlib.blake2b(t.encode(), digest_size=8).digest() for t in texts])  # a 64-bit hash each
    return deduper.first_seen(np.frombuffer(digests, dtype="<u8"))
