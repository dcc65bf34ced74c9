"""The preprocess pipeline: raw datasets -> prompt parquet per named set, a quarantine and a manifest (the
preprocess stage runs it; the train and evaluate stages run it on raw --prompt-data and --eval-prompt-data).

Layout under the output URI: `train/part-00000.parquet`, `eval/<name>/part-00000.parquet` (named eval sets and
the held-out split), `quarantine.jsonl` (one JSON object per bad row: dataset, file, line or row, reason,
detail, raw) and `manifest.json`, written last (an earlier run's is removed before any part is replaced, so a
killed run leaves none). For every input set, rows_in = rows_out + filtered + quarantined, by reason.
"""

from __future__ import annotations

import gc
import hashlib
import shutil
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from slimeflow.config.base import replace
from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.errors import StageInputError, StorageError, UnsafePathError
from slimeflow.io.guard import claimed_scratch, remove_abandoned
from slimeflow.io.manifest import Manifest, content_hash
from slimeflow.io.storage import ArtifactRecord, Storage, inside, join
from slimeflow.preprocess.prepare import PreparedBatch, Preparer, Rows, first_seen
from slimeflow.preprocess.sources import Problem, read_batches, resolve, unreadable
from slimeflow.preprocess.tokens import PromptTokenizer, TokenStats
from slimeflow.preprocess.writer import SCHEMA, DatasetWriter, Deduper

PART = "part-00000.parquet"
QUARANTINE = "quarantine.jsonl"
STAGING_PREFIX = "preprocess-"
"""A run stages its parquet in `<workdir>/preprocess-<8 hex digits>`, claimed while it lives (io.guard)."""
MANIFEST = "manifest.json"


def preprocess(config: PreprocessConfig, storage: Storage, workdir: Path, output: str) -> Manifest:
    """`config`'s sets -> prompt parquet, quarantine and manifest under `output`, staged under `workdir`; a failed run
    keeps its quarantine at <workdir>/preprocess/quarantine.jsonl."""
    tokenizer = _tokenizer(config)
    remove_abandoned(workdir, STAGING_PREFIX)  # what killed runs left there
    with claimed_scratch(workdir, STAGING_PREFIX) as staging:
        quarantine = Quarantine(staging / QUARANTINE, config.strict)
        sets = {"train": config.input, **config.eval_input} if config.input else dict(config.eval_input)
        if not sets:
            raise StageInputError("preprocess", ["no input"], "Give --input PATH and/or --eval-input NAME PATH.")
        _check_set_names([*sets, config.eval_split_name], output)
        inputs = {name: _resolve([specs] if isinstance(specs, str) else specs, storage)
                  for name, specs in sets.items()}  # every input checked before any work
        with _long_lived_heap_frozen():
            results = [_process(name, files, config, tokenizer, storage, staging, quarantine)
                       for name, files in inputs.items()]
        quarantine.close()
        _fail_if_empty(results, quarantine, keep=workdir / "preprocess" / QUARANTINE)
        return _publish(results, quarantine, config, storage, staging, output)


def _tokenizer(config: PreprocessConfig) -> PromptTokenizer | None:
    if config.hf_checkpoint is None:
        if config.needs_tokenizer():
            raise StageInputError("preprocess", ["--apply-chat-template and --rollout-max-prompt-len need a tokenizer"],
                                  "Give --hf-checkpoint DIR (in a pipeline, the model stage's checkpoint is used).")
        return None
    return PromptTokenizer(config.hf_checkpoint, need_template=config.apply_chat_template)


@contextmanager
def _long_lived_heap_frozen() -> Iterator[None]:
    """Keep the objects that exist now (torch and transformers, once a tokenizer is loaded: millions) out of the
    cyclic collector while rows flow: every full collection would rescan them, a third of the run in a profile.
    Rows are still collected as usual; nothing changes if the caller has frozen objects itself."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Quarantine:
    """The quarantine file, written as problems arrive; counts them by reason and keeps a few for summaries."""

    def __init__(self, path: Path, strict: bool):
        self.path, self.strict = path, strict
        self.examples: list[str] = []
        self._file = path.open("wb")

    def add(self, dataset: str, problem: Problem) -> None:
        if self.strict:
            raise StageInputError(f"{problem.where()}: {problem.reason}", [problem.detail],
                                  "Fix the row, or run without --strict to quarantine bad rows and go on.")
        self._file.write(orjson.dumps(problem.record(dataset)) + b"\n")
        if len(self.examples) < 5:
            self.examples.append(f"{problem.where()}: {problem.reason}: {problem.detail}")

    def close(self) -> None:
        self._file.close()


@dataclass
class SetResult:
    """What became of one input set: its files, counts by outcome, token statistics and output writers."""

    name: str
    files: list[ArtifactRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    tokens: TokenStats = field(default_factory=TokenStats)
    writers: dict[str, DatasetWriter] = field(default_factory=dict)
    prompt_format: str | None = None
    label_format: str | None = None
    packed_columns: Counter[str] = field(default_factory=Counter)
    dropped_columns: Counter[str] = field(default_factory=Counter)


def _process(name: str, inputs: tuple[list[str], list[str]], config: PreprocessConfig,
             tokenizer: PromptTokenizer | None, storage: Storage, staging: Path, quarantine: Quarantine) -> SetResult:
    files, result = inputs[0], SetResult(name, skipped=inputs[1])
    seed = config.data_seed if config.shuffle else None
    outputs = [name] + ([config.eval_split_name] if name == "train" and config.eval_split_fraction else [])
    for output in outputs:
        result.writers[output] = DatasetWriter(staging / _relative_dir(output, name) / PART, config.row_group_size, seed)
    with (ThreadPoolExecutor(max_workers=1, thread_name_prefix="preprocess-count") as pool,
          ThreadPoolExecutor(max_workers=1, thread_name_prefix="preprocess-write") as writing):
        preparer, batcher = Preparer(config, tokenizer), _Batcher(result, config, tokenizer, quarantine, pool, writing)
        for uri in files:
            try:
                result.files.append(storage.sha256(uri))
            except (OSError, StorageError) as err:  # a dangling symlink, no permission: quarantined, not fatal
                batcher.process(preparer.prepare(unreadable(uri, err)))
                continue
            for batch in read_batches(uri, storage, config.read_batch_size):
                batcher.process(preparer.prepare(batch))
        batcher.finish()
    result.packed_columns.update(preparer.mapper.packed)
    result.dropped_columns.update(preparer.mapper.dropped)
    for writer in result.writers.values():
        writer.close()
    return result


def _check_set_names(names: list[str], output: str) -> None:
    """Set names become directories (eval/NAME/): StageInputError for one that would leave eval/."""
    problems = []
    for name in names:
        try:
            inside(join(output, "eval"), name)
        except UnsafePathError as err:
            problems.append(str(err))
    if problems:
        raise StageInputError("--eval-input / --eval-split-name", problems,
                              "Name each eval set with letters, digits, '-' or '_' (e.g. aime, gsm8k-test).")


def _relative_dir(output: str, input_set: str) -> str:
    return "train" if output == "train" and input_set == "train" else f"eval/{output}"


def _resolve(specs: list[str], storage: Storage) -> tuple[list[str], list[str]]:
    """(data files, skipped files) of a set's input specs."""
    files: list[str] = []
    skipped: list[str] = []
    for spec in specs:
        found, passed_over = resolve(spec, storage)
        files += found
        skipped += passed_over
    return files, skipped


class _Batcher:
    """Counts, filters and writes prepared batches, in order.

    A batch's tokens are counted on a worker thread (the Rust tokenizer releases the GIL) while the next batch is
    prepared; `process` then filters the batch before it and hands it to the writer thread (parquet encoding and
    compression release the GIL too), and `finish` the last one. So at most three batches are in memory, and
    rows, quarantine entries and counts come out as if done one batch at a time.
    """

    def __init__(self, result: SetResult, config: PreprocessConfig, tokenizer: PromptTokenizer | None,
                 quarantine: Quarantine, pool: ThreadPoolExecutor, writer: ThreadPoolExecutor):
        self.result, self.config, self.tokenizer, self.quarantine = result, config, tokenizer, quarantine
        self.deduper = Deduper() if config.dedup and config.rollout_max_prompt_len is not None else None
        self.pool, self.writer = pool, writer
        self._pending: tuple[Rows, Future[list[int]] | None] | None = None
        self._writing: Future[None] | None = None

    def process(self, batch: PreparedBatch) -> None:
        counts = self.result.counts
        counts["rows_in"] += batch.rows_in
        if batch.empty:
            counts["filtered.empty_prompt"] += batch.empty
        for problem in batch.problems:
            self._quarantine(problem)
        if batch.duplicates is not None:
            counts["filtered.duplicate_prompt"] += batch.duplicates
        self.result.prompt_format = batch.prompt_format
        self.result.label_format = batch.label_format
        counting = self._start_count(batch.rows)
        self._finish_pending()
        self._pending = batch.rows, counting

    def finish(self) -> None:
        """Filter and write the last batch; return once everything is written."""
        self._finish_pending()
        if self._writing is not None:
            self._writing.result()
            self._writing = None

    def _finish_pending(self) -> None:
        """Filter and write the batch whose tokens are being counted."""
        if self._pending is None:
            return
        rows, counting = self._pending
        self._pending = None
        if counting is not None:
            rows.tokens = counting.result()
        self._write(self._filter(rows))

    def _quarantine(self, problem: Problem) -> None:
        self.result.counts[f"quarantined.{problem.reason}"] += 1
        self.quarantine.add(self.result.name, problem)

    def _filter(self, rows: Rows) -> Rows:
        limit = self.config.rollout_max_prompt_len
        if limit is None:  # deduplicated before counting
            return rows
        kept = rows.where([n <= limit for n in rows.tokens])  # type: ignore[union-attr]
        self.result.counts["filtered.too_long"] += len(rows) - len(kept)
        return kept.where(self._first_seen(kept.texts))  # a too-long prompt counts as too long, not as a duplicate

    def _first_seen(self, texts: list[str]) -> np.ndarray | None:
        mask = first_seen(self.deduper, texts)
        if mask is not None:
            self.result.counts["filtered.duplicate_prompt"] += int(len(mask) - mask.sum())
        return mask

    def _start_count(self, rows: Rows) -> Future[list[int]] | None:
        """Token counts of the rows' prompts, counted on the worker thread; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        if self.result.prompt_format == "messages":  # unrendered: count what the template will render
            if not self.tokenizer.has_template:
                raise StageInputError("--hf-checkpoint", ["its tokenizer has no chat template to count messages with"],
                                      "Use a tokenizer with a chat template, or give string prompts.")
            texts = [self.tokenizer.render(p.prompt, p.tools) for p in rows.prepared]
        else:
            texts = rows.texts
        return self.pool.submit(self.tokenizer.count, texts)

    def _write(self, rows: Rows) -> None:
        if not rows.prepared:
            return
        self.result.counts["rows_out"] += len(rows)
        if rows.tokens is not None:
            self.result.tokens.add(rows.tokens)
        if self.result.name == "train" and self.config.eval_split_fraction:
            by_output: dict[str, list[int]] = {}
            for index, prepared in enumerate(rows.prepared):
                by_output.setdefault(self._destination(prepared.row_id), []).append(index)
            parts = [(output, rows.take(chosen)) for output, chosen in by_output.items()]
        else:
            parts = [(self.result.name, rows)]
        formats = self.result.prompt_format or "text", self.result.label_format or "text"
        columns = [(self.result.writers[output], part.columns()) for output, part in parts]
        if self._writing is not None:
            self._writing.result()
        self._writing = self.writer.submit(_write_parts, columns, *formats)

    def _destination(self, row_id: str) -> str:
        keyed = _hash64(f"{self.config.data_seed}:{row_id}")
        return self.config.eval_split_name if keyed < self.config.eval_split_fraction * 2**64 else "train"  # type: ignore[operator]


def _write_parts(parts: list[tuple[DatasetWriter, dict[str, list[Any]]]], prompt_format: str,
                 label_format: str) -> None:
    for writer, columns in parts:
        writer.write(columns, prompt_format, label_format)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _fail_if_empty(results: list[SetResult], quarantine: Quarantine, keep: Path) -> None:
    """A set that yields no row is an error with a summary of what became of its rows, not an empty success; the
    quarantine is moved to `keep` (the staging directory is deleted) and the message names it."""
    empty = [r for r in results if not r.counts["rows_out"]]
    if not empty:
        return
    problems = [f"{r.name}: {r.counts['rows_in']} rows in, 0 out ("
                + ", ".join(f"{k} {v}" for k, v in sorted(r.counts.items()) if "." in k and v) + ")" for r in empty]
    problems += [f"e.g. {example}" for example in quarantine.examples]
    keep.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(quarantine.path, keep)
    raise StageInputError("preprocess: no usable rows", problems,
                          f"The quarantine {keep} lists every bad row with its file, line and reason.")


def _publish(results: list[SetResult], quarantine: Quarantine, config: PreprocessConfig, storage: Storage,
             staging: Path, output: str) -> Manifest:
    """Upload the parquet files and the quarantine, then manifest.json, and return the manifest.

    An earlier run's manifest.json is removed before any part is replaced, and a new one written only once every
    part is in place: a run killed in between leaves no manifest, never an old one describing new parts.
    """
    _withdraw(storage, output, {writer.path.relative_to(staging).as_posix()
                                for result in results for writer in result.writers.values() if writer.rows})
    records, outputs, sets = [], {"root": output}, {}
    for result in results:
        for name, writer in result.writers.items():
            if not writer.rows:
                continue
            relative = writer.path.relative_to(staging).as_posix()
            records.append(replace(storage.put_file(writer.path, join(output, relative)), path=relative))
            outputs["train" if relative.startswith("train/") else f"eval.{name}"] = join(output, str(Path(relative).parent))
        sets[result.name] = _set_facts(result)
    records.append(replace(storage.put_file(quarantine.path, join(output, QUARANTINE)), path=QUARANTINE))
    outputs.update(quarantine=join(output, QUARANTINE), manifest=join(output, MANIFEST))
    outputs["commit"] = outputs["manifest"]  # the stage cache reuses this run only while it names this content
    inputs = [f for r in results for f in r.files]
    manifest = Manifest(
        stage="preprocess", outputs=outputs, artifacts=records, artifact_root=output,
        counts=_counts(results),
        hashes={"content": content_hash(records), "inputs": content_hash(inputs)},
        facts={"sets": sets, "schema": {f.name: str(f.type) for f in SCHEMA},
               "quarantine_examples": quarantine.examples},
        config=config.model_dump(mode="json"),
    )
    storage.write_text(outputs["manifest"], manifest.model_dump_json(indent=2))
    return manifest


def _withdraw(storage: Storage, output: str, rewritten: set[str]) -> None:
    """Remove an earlier run's manifest.json at `output`, then the files it lists that this run does not rewrite
    (an eval set no longer asked for): they were ours, and no manifest describes them any more."""
    uri = join(output, MANIFEST)
    if not storage.exists(uri):
        return
    try:
        earlier = Manifest.read(storage, uri)
    except (StorageError, ValueError) as err:
        raise StageInputError(uri, [f"is not a preprocess manifest: {err}"],
                              "Remove it, or choose another --output; preprocess writes manifest.json itself.") from None
    storage.remove(uri)
    for record in earlier.artifacts:
        stale = join(output, inside(output, record.path))
        if record.path not in rewritten and record.path != QUARANTINE and storage.exists(stale):
            storage.remove(stale)


def _set_facts(result: SetResult) -> dict[str, Any]:
    mapper_counts = {k: v for k, v in result.counts.items() if k.startswith(("filtered.", "quarantined."))}
    return {
        "inputs": [f.model_dump() for f in result.files],
        "skipped_files": result.skipped,
        "prompt_format": result.prompt_format, "label_format": result.label_format,
        "packed_columns": dict(result.packed_columns), "dropped_columns": dict(result.dropped_columns),
        "outputs": {name: w.rows for name, w in result.writers.items()},
        "rows_in": result.counts["rows_in"], "rows_out": result.counts["rows_out"], **mapper_counts,
        "prompt_tokens": result.tokens.summary(),
    }


def _counts(results: list[SetResult]) -> dict[str, int]:
    """Totals (rows_in, rows_out, filtered.REASON, quarantined.REASON) and the same per set as SET.KEY."""
    totals: Counter[str] = Counter()
    per_set = {}
    for result in results:
        totals.update(result.counts)
        per_set.update({f"{result.name}.{k}": v for k, v in result.counts.items()})
    return {**dict(sorted(totals.items())), **per_set}
