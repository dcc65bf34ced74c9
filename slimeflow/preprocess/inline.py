"""Raw data given straight to a stage that reads prompt parquet (train's --prompt-data, --eval-prompt-data), as
slime reads JSONL, JSON, CSV and parquet directly: each raw set goes through the preprocess stage's own mapping,
quarantine and manifest, into a directory keyed by the set's content and the mapping config, so a rerun (a resume
after a crash) finds the same rows in the same order and rewrites nothing.

Raw or ours is decided by content: our prompt parquet has the reader's columns (row_id, prompt, label, metadata,
tools, prompt_tokens); any other parquet, and every JSONL, JSON or CSV file, is raw.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq

from slimeflow.config.base import replace
from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.errors import StageInputError, StorageError
from slimeflow.io.manifest import Manifest
from slimeflow.io.prompts import COLUMNS
from slimeflow.io.storage import Storage, join
from slimeflow.preprocess.pipeline import MANIFEST, preprocess
from slimeflow.preprocess.sources import file_format, resolve

TRAIN = "train"
"""The set name --prompt-data gets (the preprocess stage's training set)."""


def is_raw(uri: str, storage: Storage) -> bool:
    """True for data that needs preprocessing: a glob, a JSONL/JSON/CSV file, a parquet without our columns, or a
    directory of such files. A directory whose parquet has our columns is ours (the preprocess stage's output root
    holds manifest.json and quarantine.jsonl beside it); a missing path is not raw (the prompt-parquet check names it)."""
    if any(ch in uri for ch in "*?["):
        return True
    if not storage.exists(uri):
        return False
    if storage.isdir(uri):
        try:
            files = resolve(uri, storage)[0]
        except StageInputError:  # no data file under it: the prompt-parquet check says what
            return False
        parquet = [f for f in files if file_format(f) == "parquet"]
        return not parquet or not _ours(parquet[0], storage)
    fmt = file_format(uri)
    return fmt is not None and (fmt != "parquet" or not _ours(uri, storage))


def _ours(uri: str, storage: Storage) -> bool:
    """Whether a parquet file has the prompt parquet's columns (an unreadable one counts as ours: the prompt-parquet
    check reports it with its reason)."""
    try:
        with storage.open_read(uri) as stream:
            names = pq.ParquetFile(stream).schema_arrow.names
    except (OSError, ValueError, StorageError):
        return True
    return all(name in names for name in COLUMNS)


@dataclass(frozen=True)
class PreparedSet:
    """A raw set, preprocessed: where it came from, its prompt parquet, and the preprocess manifest."""

    name: str
    source: str
    prompt_data: str
    manifest: Manifest
    reused: bool

    def counts(self, prefix: str) -> dict[str, int]:
        """rows_in, rows_out, filtered.REASON and quarantined.REASON of this set, each under `prefix`."""
        own = {k: v for k, v in self.manifest.counts.items() if "." not in k or k.startswith(("filtered.", "quarantined."))}
        quarantined = sum(v for k, v in own.items() if k.startswith("quarantined."))
        return {f"{prefix}.{k}": v for k, v in {**own, "quarantined": quarantined}.items()}

    def outputs(self, prefix: str) -> dict[str, str]:
        return {f"{prefix}.source": self.source, f"{prefix}.prompt_data": self.prompt_data,
                f"{prefix}.quarantine": self.manifest.outputs["quarantine"],
                f"{prefix}.manifest": self.manifest.outputs["manifest"]}


def prepare_raw(name: str, uri: str, config: PreprocessConfig, storage: Storage, root: Path) -> PreparedSet:
    """Preprocess the raw set `uri` under `root`/NAME-KEY (KEY: the files' content hashes and `config`), or reuse
    what an earlier run wrote there. `config` holds the mapping flags; its inputs and output are set here."""
    files = resolve(uri, storage)[0]
    key = _key(uri, [storage.sha256(f).sha256 for f in files], config)
    output = str(root / f"{name}-{key[:16]}")
    manifest_uri = join(output, MANIFEST)
    if storage.exists(manifest_uri):  # written last: its presence means the whole set is there
        manifest = Manifest.read(storage, manifest_uri)
        return PreparedSet(name, uri, _prompt_data(manifest, name), manifest, reused=True)
    sets: dict[str, Any] = {"input": [uri]} if name == TRAIN else {"eval_input": {name: uri}}
    run_config = replace(config, **{"input": [], "eval_input": {}, "output": output, **sets})
    manifest = preprocess(run_config, storage, root, output)
    return PreparedSet(name, uri, _prompt_data(manifest, name), manifest, reused=False)


def _prompt_data(manifest: Manifest, name: str) -> str:
    return manifest.outputs[TRAIN if name == TRAIN else f"eval.{name}"]


def _key(uri: str, digests: list[str], config: PreprocessConfig) -> str:
    mapping = config.model_dump(mode="json", exclude={"input", "eval_input", "output"})
    blob = orjson.dumps({"uri": uri, "files": digests, "config": mapping}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(blob).hexdigest()
