"""A stage's manifest: small JSON that says what a stage read and wrote. Prefect persists these, never data."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from typing import Any

from pydantic import BaseModel, Field

from slimeflow import code_version
from slimeflow.io.storage import ArtifactRecord, Storage, join

MANIFEST_DIR = "manifests"


class Manifest(BaseModel):
    """Output URIs, checksums of every artifact, counts, content hashes, the config and the code version."""

    stage: str
    outputs: dict[str, str] = Field(default_factory=dict)
    """Named output URIs, e.g. {"hf_checkpoint": "/runs/demo/model/tiny-llama"}."""
    artifacts: list[ArtifactRecord] = Field(default_factory=list)
    """sha256 and size of every file the stage wrote or fingerprinted (paths relative to `artifact_root`)."""
    artifact_root: str | None = None
    counts: dict[str, int] = Field(default_factory=dict)
    hashes: dict[str, str] = Field(default_factory=dict)
    """Content hashes; `content` is the hash of all artifacts, the input of downstream cache keys."""
    cache_key: str | None = None
    """What the stage's result depends on (its config, its inputs' content hashes, the code version); a rerun with
    the same key reuses this manifest (flows.stages)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Scores and figures logged to MLflow with the counts (eval scores, final losses)."""
    facts: dict[str, Any] = Field(default_factory=dict)
    """Small stage-specific values (model type, vocabulary size, ...)."""
    config: dict[str, Any] = Field(default_factory=dict)
    code_version: str = Field(default_factory=code_version)
    created_at: str = Field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))

    def write(self, storage: Storage, output: str) -> tuple[str, ArtifactRecord]:
        """Write to <output>/manifests/<stage>.json atomically; returns the URI and its checksum record."""
        uri = join(output, MANIFEST_DIR, f"{self.stage}.json")
        return uri, storage.write_bytes(uri, self.model_dump_json(indent=2).encode())

    @classmethod
    def read(cls, storage: Storage, uri: str, expect: ArtifactRecord | None = None) -> Manifest:
        return cls.model_validate_json(storage.read_bytes(uri, expect=expect))


def content_hash(records: list[ArtifactRecord]) -> str:
    """One sha256 over (path, sha256, size) of every record, independent of their order."""
    lines = sorted(f"{r.path}\t{r.sha256}\t{r.size}" for r in records)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def config_hash(config: BaseModel) -> str:
    """A stable hash of a config's values (keys sorted), for cache keys; with the plug-in settings a train config
    read from --custom-config-path's file (`custom_args`, not fields of its own), so that editing the file reruns
    the stage."""
    values: Any = config.model_dump(mode="json")
    custom = getattr(config, "custom_args", None)
    if custom:
        values = {"config": values, "custom_args": custom}
    payload = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode()).hexdigest()
