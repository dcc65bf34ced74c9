"""The model stage: resolve the base HF checkpoint, check it is whole, and fingerprint every file.

Its manifest's `hashes.content` is the identity of the base model that convert, train and export build on, and
`outputs.hf_checkpoint` the local directory they read; for a GGUF source, `facts.source` is the file's sha256 and
tensor types and how it was dequantized. The work is the checkpoint library's
(slimeflow/checkpoint/hf_source.py), which convert, train and export read too.
"""

from __future__ import annotations

from slimeflow.checkpoint.gguf_source import is_gguf_source, read_record
from slimeflow.checkpoint.hf_source import fingerprint, inspect_hf_dir, materialise
from slimeflow.config.model import ModelConfig
from slimeflow.io.manifest import Manifest, content_hash
from slimeflow.stages.base import StageContext


def run(config: ModelConfig, ctx: StageContext) -> Manifest:
    """Materialise `config.hf_checkpoint` locally, validate it, and return its manifest."""
    local = materialise(config, ctx.storage, ctx.workdir, ctx.show_progress)
    facts = inspect_hf_dir(local)
    if is_gguf_source(config.hf_checkpoint):
        facts["source"] = read_record(local)
    records = fingerprint(local, ctx.storage, ctx.show_progress)
    return Manifest(
        stage="model",
        outputs={"hf_checkpoint": str(local), "source": config.hf_checkpoint},
        artifacts=records,
        artifact_root=str(local),
        counts={"files": len(records), "bytes": sum(r.size for r in records), "parameters": facts.pop("parameters")},
        hashes={"content": content_hash(records)},
        facts=facts,
        config=config.model_dump(mode="json"),
    )
