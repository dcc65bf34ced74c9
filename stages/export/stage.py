"""The export stage: a torch_dist checkpoint (a training run's, or a converted one) -> HF safetensors at a URI.

The HF directory is written locally (the convert stage's torch-dist -> HF path: sharded safetensors, the index,
the origin's config and tokenizer), checksummed, then uploaded to `--output-dir` when that is remote and verified
there against the checksums. The manifest lists every file with its sha256 and size. The target gets a marker
listing them; a target holding anything else is refused, an earlier export is replaced only with --overwrite,
and an upload is staged and committed so that a kill never leaves a torn export looking complete (publish.py).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from slimeflow.checkpoint.hf_source import fingerprint
from slimeflow.checkpoint.hf_write import write_hf
from slimeflow.checkpoint.publish import MARKER, check_target, publish, write_marker
from slimeflow.config.export import ExportConfig, parse_size
from slimeflow.errors import CheckpointError, StageInputError
from slimeflow.io import checkpoints
from slimeflow.io.manifest import Manifest, content_hash
from slimeflow.io.storage import is_local, join, local_path
from slimeflow.stages.base import StageContext


def run(config: ExportConfig, ctx: StageContext) -> Manifest:
    """Export; returns the manifest (output URI, checksums, the checkpoint it came from)."""
    ref, origin = _inputs(config, ctx)
    target = config.output_dir or join(ctx.output, "export", "hf")
    previous = check_target(ctx.storage, target, config.overwrite)  # before any work: refusals come first
    local = local_path(target) if is_local(target) else ctx.workdir / "export" / "hf"
    tensors = write_hf(local_path(ref.uri), local, origin, config.vocab_size, parse_size(config.max_shard_size))
    records = fingerprint(local, ctx.storage, ctx.show_progress)
    if is_local(target):
        write_marker(ctx.storage, target, records)
    else:
        publish(ctx.storage, local, target, records, previous, uuid.uuid4().hex[:12])
    return Manifest(
        stage="export",
        outputs={"hf_model": target, "checkpoint": ref.uri, "commit": join(target, MARKER)},
        artifacts=records, artifact_root=target,
        counts={"files": len(records), "bytes": sum(r.size for r in records), "tensors": tensors},
        hashes={"content": content_hash(records)},
        facts={"iteration": str(ref.iteration)},
        config=config.model_dump(mode="json"),
    )


def _inputs(config: ExportConfig, ctx: StageContext) -> tuple[checkpoints.CheckpointRef, Path]:
    problems = []
    if config.input_dir is None:
        problems.append("--input-dir is not set (a torch_dist checkpoint root, release/ or iter_XXXXXXX/)")
    if config.origin_hf_dir is None:
        problems.append("--origin-hf-dir is not set (the HF directory whose config and tokenizer are copied)")
    if problems:
        raise StageInputError("the export stage cannot start", problems,
                              "In a pipeline these come from the train and model stages; alone, pass them.")
    try:
        ref = checkpoints.resolve(ctx.storage, config.input_dir)
    except CheckpointError as err:
        raise StageInputError(f"--input-dir {config.input_dir}", [str(err)],
                              "Point it at a checkpoint root, release/ or an iter_XXXXXXX/ directory.") from None
    if not is_local(ref.uri):
        raise StageInputError(f"--input-dir {config.input_dir}", ["is not on local disk"],
                              "Export reads checkpoints from local or shared disk; copy it there first.")
    return ref, local_path(config.origin_hf_dir)
