"""An HF checkpoint as a source: resolve it to a local directory (a tiny spec built, a GGUF file dequantized, a remote
URI downloaded, an export checked against its marker), check it is whole, and fingerprint every file.

The model stage's manifest is this; convert, train, evaluate and export read HF directories through it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from slimeflow.checkpoint.gguf_source import is_gguf_source, materialise_gguf
from slimeflow.checkpoint.publish import MARKER, STAGING, ExportMarker, read_marker
from slimeflow.config.base import replace
from slimeflow.config.model import ModelConfig
from slimeflow.errors import StageInputError, UnsafePathError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model, is_tiny_uri
from slimeflow.io.storage import ArtifactRecord, Storage, inside, is_local, join, local_path
from slimeflow.progress import byte_progress

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def is_source_spec(spec: str) -> bool:
    """True when `spec` names a checkpoint `materialise` makes or fetches (a tiny spec, a GGUF file, a remote URI)
    rather than a local HF directory used in place."""
    return is_tiny_uri(spec) or is_gguf_source(spec) or not is_local(spec)


def materialise(config: ModelConfig, storage: Storage, workdir: Path, show_progress: bool = False) -> Path:
    """A local directory holding the checkpoint: built (tiny spec), dequantized (GGUF file), downloaded (remote URI)
    or used in place. Built, dequantized and downloaded ones go under --cache-dir, else `workdir`/model."""
    spec = config.hf_checkpoint
    target_root = Path(config.cache_dir) if config.cache_dir else workdir / "model"
    if is_tiny_uri(spec):
        tiny = TinyModelSpec.from_uri(spec)
        target = target_root / ("tiny-" + hashlib.sha256(tiny.to_uri().encode()).hexdigest()[:12])
        # The factory is deterministic and writes atomically: an existing directory is that same model.
        return target if target.is_dir() else build_tiny_model(target, tiny)
    if is_gguf_source(spec):
        return materialise_gguf(spec, storage, target_root)
    if is_local(spec):
        path = local_path(spec)
        if not path.is_dir():
            raise StageInputError(f"--hf-checkpoint {spec}", ["is not a directory"],
                                  "Give an HF model directory (config.json, tokenizer, safetensors weights).")
        return path
    target = target_root / ("remote-" + hashlib.sha256(spec.encode()).hexdigest()[:12])
    files = storage.list(spec, recursive=True)
    if not files:
        raise StageInputError(f"--hf-checkpoint {spec}", ["holds no files"], "Check the URI and the S3 credentials.")
    exported = _complete_export(storage, spec, files)
    with byte_progress(f"download {spec}", None, show_progress) as advance:
        if exported is None:
            storage.copy_tree(spec, str(target), progress=advance)
        else:  # our own export: exactly the files its marker lists, each checked against its sha256
            for record in exported.files:
                relative = inside(spec, record.path)
                storage.get_file(join(spec, relative), target / relative, expect=record)
                advance(record.size)
    return target


def _complete_export(storage: Storage, spec: str, files: list[str]) -> ExportMarker | None:
    """The marker of the export stage's output at `spec` (None for any other checkpoint); StageInputError if
    that export is unfinished (a killed upload, or one still running)."""
    marker = read_marker(storage, spec)
    staged = any(f"/{STAGING}/" in uri for uri in files)
    if marker is None and not staged:
        return None
    if marker is not None and marker.state == "complete":
        return marker
    state = f"its {MARKER} says {marker.state!r}" if marker else f"files under {STAGING}/, no {MARKER} yet"
    raise StageInputError(f"--hf-checkpoint {spec}", [f"is an unfinished export: {state}"],
                          "Run the export again (it completes or replaces it), or wait for the one running.")


def inspect_hf_dir(path: Path) -> dict[str, Any]:
    """Check config, tokenizer and safetensors weights; return facts; raise StageInputError listing every problem."""
    problems: list[str] = []
    facts: dict[str, Any] = {}
    config = _read_json(path / "config.json", problems)
    if config is not None:
        facts.update({k: config.get(k) for k in ("model_type", "architectures", "vocab_size", "hidden_size",
                                                 "num_hidden_layers", "tie_word_embeddings")})
        _check_transformers_config(path, problems)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"no tokenizer: expected one of {', '.join(TOKENIZER_FILES)}")
    tensors = _check_weights(path, problems)
    if problems:
        raise StageInputError(
            f"HF checkpoint {path} cannot be used", problems,
            "Re-save it with transformers' save_pretrained(safe_serialization=True), or re-download the files named.",
        )
    facts["dtypes"] = sorted({t["dtype"] for t in tensors.values()})
    facts["parameters"] = sum(_numel(t["shape"]) for t in tensors.values())
    return facts


def _read_json(path: Path, problems: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        problems.append(f"{path.name} is missing")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problems.append(f"{path.name} is not valid JSON: {err}")
        return None


def _check_transformers_config(path: Path, problems: list[str]) -> None:
    from slimeflow.families.hf import load_config

    try:
        load_config(path, local_files_only=True)
    except Exception as err:  # transformers raises many types for a config it cannot read
        problems.append(f"config.json is not a config transformers can read: {err}")


def _check_weights(path: Path, problems: list[str]) -> dict[str, dict[str, Any]]:
    """Every safetensors shard exists and is whole; every tensor the index names is in its shard."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = (_read_json(index, problems) or {}).get("weight_map", {})
        shards = _shards_inside(path, set(weight_map.values()), problems)
    elif (path / "model.safetensors").is_file():
        weight_map, shards = {}, ["model.safetensors"]
    else:
        problems.append("no safetensors weights: expected model.safetensors or " + INDEX_FILE)
        return {}
    tensors: dict[str, dict[str, Any]] = {}
    for shard in shards:
        header = _safetensors_header(path / shard, problems)
        tensors.update({k: v for k, v in header.items() if k != "__metadata__"})
    missing = sorted(name for name in weight_map if name not in tensors)
    if missing and not any(p.startswith(tuple(shards)) for p in problems):
        problems.append(f"{INDEX_FILE} names {len(missing)} tensors absent from their shards: {missing[:5]}")
    return tensors


def _shards_inside(path: Path, shards: set[str], problems: list[str]) -> list[str]:
    """The index's shard names that stay inside the checkpoint; one problem for each that would leave it."""
    kept = []
    for shard in sorted(shards):
        try:
            kept.append(inside(str(path), shard))
        except UnsafePathError as err:
            problems.append(f"{INDEX_FILE} names a shard outside the checkpoint: {err}")
    return kept


def _safetensors_header(shard: Path, problems: list[str]) -> dict[str, Any]:
    """The header of a safetensors file, read without loading tensors; checks the file is not truncated."""
    if not shard.is_file():
        problems.append(f"{shard.name} is missing")
        return {}
    size = shard.stat().st_size
    with shard.open("rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else size
        if length > size - 8:
            problems.append(f"{shard.name} is truncated or not safetensors ({size} bytes)")
            return {}
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            problems.append(f"{shard.name} has an unreadable safetensors header")
            return {}
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end != size:
        problems.append(f"{shard.name} is truncated: its header needs {8 + length + end} bytes, the file has {size}")
    return header


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def fingerprint(path: Path, storage: Storage, show_progress: bool = False) -> list[ArtifactRecord]:
    """sha256 and size of every file under `path` (paths relative to it, sorted), streamed by `storage`."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    records = []
    with byte_progress(f"fingerprint {path.name}", sum(p.stat().st_size for p in files), show_progress) as advance:
        for file in files:
            record = storage.sha256(str(file))
            advance(record.size)
            records.append(replace(record, path=file.relative_to(path).as_posix()))
    return records
