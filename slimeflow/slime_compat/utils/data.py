"""slime.utils.data: the prompt-file helpers slime's data plug-ins call (read_file with slime's `path@[start:end]`
row slices, filter_long_prompt), over slimeflow's readers (slimeflow.preprocess.sources).

read_file reads every format slimeflow's preprocess reads (JSONL, JSON arrays, CSV, parquet, .gz), local or s3://.
A row that does not parse is skipped with a warning naming its file and line, as slime skips it. slime's `Dataset`
is not provided: slimeflow's data source reads --prompt-data (leave --data-source-path unset).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import re
from collections.abc import Iterator
from typing import Any

from slimeflow.io.storage import Storage
from slimeflow.preprocess.sources import read_batches
from slimeflow.rollout.types import Sample

__all__ = ["filter_long_prompt", "read_file"]

logger = logging.getLogger(__name__)
READ_BATCH_ROWS = 1024
_ROW_SLICE = re.compile(r"(?P<path>.*)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]")


def _parse_generalized_path(spec: str) -> tuple[str, slice | None]:
    """'file@[start:stop]' -> ('file', slice(start, stop)) (either bound may be empty or negative); a plain path
    -> (path, None)."""
    match = _ROW_SLICE.fullmatch(spec)
    if match is None:
        return spec, None
    bounds = [int(match[name]) if match[name] else None for name in ("start", "stop")]
    return match["path"], slice(*bounds)


def _rows(path: str) -> Iterator[dict[str, Any]]:
    for batch in read_batches(path, Storage(), READ_BATCH_ROWS):
        for problem in batch.problems:
            logger.warning("read_file: skipping %s: %s (%s)", problem.where(), problem.reason, problem.detail)
        for _, row in batch.rows:
            yield row


def read_file(path: str) -> Iterator[dict[str, Any]]:
    """The rows of a prompt file, in order; `path@[start:stop]` yields that slice of them, as a Python slice (a
    negative bound counts from the end, which reads the whole file first; otherwise rows stream)."""
    path, rows = _parse_generalized_path(path)
    if not Storage().exists(path):
        raise FileNotFoundError(f"Prompt dataset path '{path}' does not exist.")
    reader = _rows(path)
    if rows is None:
        yield from reader
    elif (rows.start or 0) < 0 or (rows.stop or 0) < 0:
        yield from list(reader)[rows]
    else:
        yield from itertools.islice(reader, rows.start, rows.stop)


def _is_multimodal(sample: Sample) -> bool:
    return bool(sample.multimodal_inputs) and any(v is not None for v in sample.multimodal_inputs.values())


def _processor_length(sample: Sample, processor: Any) -> int:
    try:  # slime's own vision helper: slimeflow has none to offer in its place
        vision = importlib.import_module("slime.utils.processing_utils")
    except ImportError as err:
        raise ImportError("filter_long_prompt: a multimodal sample's length is counted with "
                          "slime.utils.processing_utils.process_vision_info, which slimeflow does not provide; "
                          "install slime for multimodal prompts") from err
    inputs = vision.process_vision_info(sample.prompt, processor)
    return len(processor(text=sample.prompt, **inputs)["input_ids"][0])


def filter_long_prompt(origin_samples: list[Sample], tokenizer: Any, processor: Any,
                       max_length: int | None) -> list[Sample]:
    """The samples whose prompt is at most `max_length` tokens, in their order (the rule of slimeflow's preprocess,
    --rollout-max-prompt-len). Text prompts are counted with one batched `tokenizer` call; with a `processor`,
    multimodal ones through it. Unrendered (message-list) prompts are not counted and all kept."""
    if max_length is None or not origin_samples:
        return origin_samples
    if not isinstance(origin_samples[0].prompt, str):
        logger.warning("filter_long_prompt: prompts are message lists, not counted (render them with the chat "
                       "template to filter by length)")
        return origin_samples
    lengths: dict[int, int] = {}
    text = [i for i, s in enumerate(origin_samples) if not (processor and _is_multimodal(s))]
    if text:
        encoded = tokenizer([origin_samples[i].prompt for i in text], add_special_tokens=False)["input_ids"]
        lengths.update(zip(text, map(len, encoded), strict=True))
    for i in sorted(set(range(len(origin_samples))) - set(text)):
        lengths[i] = _processor_length(origin_samples[i], processor)
    kept = [s for i, s in enumerate(origin_samples) if lengths[i] <= max_length]
    logger.info("filter_long_prompt: %d of %d samples longer than max_length=%d dropped",
                len(origin_samples) - len(kept), len(origin_samples), max_length)
    return kept


def __getattr__(name: str) -> Any:
    if name in ("Dataset", "get_source", "process_rollout_data"):
        raise ImportError(f"slime.utils.data.{name} is not provided by slimeflow's slime compatibility layer: "
                          "slimeflow's data source reads --prompt-data (leave --data-source-path unset), or read rows "
                          "with slime.utils.data.read_file", name=name)
    raise AttributeError(f"module 'slime.utils.data' has no attribute {name!r}")
