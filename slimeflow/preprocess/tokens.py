"""The tokenizer side of preprocessing: chat-template rendering and batched prompt token counts.

Counts are of the text the model is given: the rendered template for messages (with the generation prompt),
the string itself otherwise, both without adding special tokens (the template writes them), as slime counts
for --rollout-max-prompt-len. Messages kept unrendered are counted as the template would render them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np

from slimeflow.errors import StageInputError
from slimeflow.io.storage import is_local, local_path
from slimeflow.preprocess.rows import Prompt, RowError

HISTOGRAM_EDGES = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
COUNT_CHUNK = 2048
"""Texts encoded per tokenizer call: a call's encodings (every token's string and offsets) are freed before the
next, so memory holds a few thousand prompts' encodings, not a batch's."""
UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
"""Normalizers that leave ASCII text unchanged: no ASCII character decomposes or composes."""


class PromptTokenizer:
    """A fast HF tokenizer from a local directory: renders messages and counts tokens in batches."""

    def __init__(self, hf_checkpoint: str, need_template: bool):
        from transformers import AutoTokenizer  # here: the driver imports this module and stays free of torch

        if not is_local(hf_checkpoint) or not local_path(hf_checkpoint).is_dir():
            raise StageInputError(f"--hf-checkpoint {hf_checkpoint}", ["is not a local directory"],
                                  "Give a local HF directory with the tokenizer; run the model stage to fetch a "
                                  "remote checkpoint (the pipeline passes its local copy).")
        path = Path(local_path(hf_checkpoint))
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise StageInputError(f"--hf-checkpoint {hf_checkpoint}", [f"no tokenizer can be loaded: {err}"],
                                  "Point it at a directory with tokenizer.json (and tokenizer_config.json).") from None
        if not self.tokenizer.is_fast:
            raise StageInputError(f"--hf-checkpoint {hf_checkpoint}", ["the tokenizer is not a fast tokenizer"],
                                  "Save it with tokenizers' tokenizer.json; batched counting needs it.")
        self.has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self._encoder = self.tokenizer.backend_tokenizer
        self._ascii_encoder = _without_unicode_normalizer(self._encoder)
        if need_template and not self.has_template:
            raise StageInputError(f"--hf-checkpoint {hf_checkpoint}", ["the tokenizer has no chat template"],
                                  "Use a checkpoint whose tokenizer_config.json has a chat_template, or drop "
                                  "--apply-chat-template and keep the messages unrendered.")

    def render(self, prompt: Prompt, tools: list[Any] | None) -> str:
        """The chat-template text of a prompt (a string is one user message); RowError if the template fails."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as err:  # jinja raises many types for a message the template cannot take
            raise RowError("chat_template_error", f"{type(err).__name__}: {err}") from None

    def count(self, texts: list[str]) -> list[int]:
        """Token counts of `texts`, encoded COUNT_CHUNK at a time by the Rust tokenizer (without offsets).

        ASCII texts skip a Unicode normalizer (Qwen's NFC), which is the identity on them: the same ids, about
        5-15% less tokenizer time on the preprocess benchmark's prompts, measured."""
        counts: list[int] = []
        for start in range(0, len(texts), COUNT_CHUNK):
            counts += self._count_chunk(texts[start : start + COUNT_CHUNK])
        return counts

    def _count_chunk(self, texts: list[str]) -> list[int]:
        if self._ascii_encoder is None:
            return _lengths(self._encoder, texts)
        plain = [text.isascii() for text in texts]
        if all(plain):
            return _lengths(self._ascii_encoder, texts)
        ascii_counts = iter(_lengths(self._ascii_encoder, [t for t, p in zip(texts, plain, strict=True) if p]))
        other_counts = iter(_lengths(self._encoder, [t for t, p in zip(texts, plain, strict=True) if not p]))
        return [next(ascii_counts) if p else next(other_counts) for p in plain]


def _lengths(encoder: Any, texts: list[str]) -> list[int]:
    return [len(e) for e in encoder.encode_batch_fast(texts, add_special_tokens=False)] if texts else []


def _without_unicode_normalizer(encoder: Any) -> Any | None:
    """A copy of the Rust tokenizer without its normalizer when that is only Unicode normal forms (so it
    encodes ASCII text exactly as the original does); None when there is nothing to skip."""
    normalizer = encoder.normalizer
    if normalizer is None:
        return None
    state = json.loads(normalizer.__getstate__())
    forms = [n["type"] for n in state["normalizers"]] if state["type"] == "Sequence" else [state["type"]]
    if not set(forms) <= UNICODE_FORMS:
        return None
    skipping = copy.deepcopy(encoder)
    skipping.normalizer = None
    return skipping


class TokenStats:
    """Exact prompt-length statistics in memory bounded by the longest prompt, not the number of rows."""

    def __init__(self) -> None:
        self.counts = np.zeros(0, dtype=np.int64)

    def add(self, lengths: list[int]) -> None:
        if not lengths:
            return
        binned = np.bincount(np.asarray(lengths, dtype=np.int64))
        if len(binned) > len(self.counts):
            self.counts = np.pad(self.counts, (0, len(binned) - len(self.counts)))
        self.counts[: len(binned)] += binned

    def summary(self) -> dict[str, Any]:
        """min, max, mean, p50/p90/p99 and a histogram over HISTOGRAM_EDGES ('[lo, hi)': rows, up to the bin of
        the longest prompt; past the last edge, hi is max + 1); {} when nothing was counted."""
        total = int(self.counts.sum())
        if not total:
            return {}
        lengths = np.arange(len(self.counts))
        cumulative = np.cumsum(self.counts)
        nonzero = np.flatnonzero(self.counts)

        def percentile(q: float) -> int:
            return int(np.searchsorted(cumulative, q * total, side="left"))

        top = int(nonzero[-1])
        edges = [e for e in HISTOGRAM_EDGES if e <= top]
        edges.append(next((e for e in HISTOGRAM_EDGES if e > top), top + 1))
        histogram = {f"[{lo}, {hi})": int(self.counts[lo:hi].sum()) for lo, hi in zip(edges, edges[1:], strict=False)}
        return {"rows": total, "min": int(nonzero[0]), "max": int(nonzero[-1]),
                "mean": round(float((lengths * self.counts).sum() / total), 2), "p50": percentile(0.5),
                "p90": percentile(0.9), "p99": percentile(0.99), "histogram": histogram}
