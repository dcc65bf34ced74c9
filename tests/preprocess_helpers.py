"""Shared helpers of the preprocess tests: run the stage, read its quarantine, check the count identity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.io.manifest import Manifest
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.stages.preprocess.stage import run


def run_stage(tmp_path: Path, storage: Storage | None = None, **config: Any) -> Manifest:
    config.setdefault("output", str(tmp_path / "out"))
    ctx = StageContext(storage or Storage(), tmp_path / "work", str(tmp_path / "root"))
    manifest = run(PreprocessConfig(**config), ctx)
    assert_count_identity(manifest, storage or Storage())
    return manifest


def assert_count_identity(manifest: Manifest, storage: Storage) -> None:
    """rows_in = rows_out + filtered + quarantined, in total and per set; the quarantine file agrees."""
    counts = manifest.counts
    sets = list(manifest.facts["sets"])
    for prefix in ["", *(f"{name}." for name in sets)]:
        own = {k[len(prefix):]: v for k, v in counts.items() if k.startswith(prefix)
               and (prefix or not k.startswith(tuple(f"{s}." for s in sets)))}
        removed = sum(v for k, v in own.items() if k.startswith(("filtered.", "quarantined.")))
        assert own["rows_in"] == own.get("rows_out", 0) + removed, (prefix, own)
    records = quarantine(manifest, storage)
    assert len(records) == sum(v for k, v in counts.items() if k.startswith("quarantined."))
    for name, facts in manifest.facts["sets"].items():
        assert sum(facts["outputs"].values()) == facts["rows_out"] == counts.get(f"{name}.rows_out", 0)


def quarantine(manifest: Manifest, storage: Storage | None = None) -> list[dict[str, Any]]:
    text = (storage or Storage()).read_text(manifest.outputs["quarantine"])
    return [json.loads(line) for line in text.splitlines()]


def reasons(records: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    """(file name, line or row, reason) of each quarantine record, in file order."""
    return [(r["file"].rsplit("/", 1)[-1], r.get("line", r.get("row")), r["reason"]) for r in records]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": text}]
