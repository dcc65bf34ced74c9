"""The convert stage: HF safetensors <-> Megatron torch_dist, exact, in either direction.

hf-to-torch-dist validates the HF directory against its family's spec (slimeflow/families/) before
anything is written, converts with N cooperating worker processes (slimeflow/checkpoint/worker.py), each
writing its share of the layers (of a MoE model: its slice of every layer's experts, as expert parallelism
splits them), into a staging directory that becomes `<save>/release/` only when complete;
the tracker is set last. torch-dist-to-hf reads a checkpoint (a root, release/ or iter_XXXXXXX/), strips the
vocabulary padding and writes sharded safetensors with an index and the origin's config and tokenizer, again via
a staging directory. The format code is the checkpoint library's (slimeflow/checkpoint/); this is the stage.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from slimeflow.checkpoint.convert import publish_release, read_hf_source, write_torch_dist
from slimeflow.checkpoint.hf_source import fingerprint, materialise
from slimeflow.checkpoint.hf_write import write_hf
from slimeflow.checkpoint.integrity import CHECKSUMS, write_checksums
from slimeflow.config.base import replace
from slimeflow.config.convert import ConvertConfig
from slimeflow.config.model import ModelConfig
from slimeflow.config.model_args import check_model_args
from slimeflow.errors import CheckpointError, StageInputError
from slimeflow.io import checkpoints
from slimeflow.io.checkpoints import RELEASE
from slimeflow.io.guard import claimed_dir, staging_prefix
from slimeflow.io.manifest import Manifest, content_hash
from slimeflow.io.storage import Storage, is_local, join, local_path
from slimeflow.stages.base import StageContext


def run(config: ConvertConfig, ctx: StageContext) -> Manifest:
    """Convert in `config.direction`; the manifest lists the written files with their sha256."""
    if config.direction == "hf-to-torch-dist":
        return _to_torch_dist(config, ctx)
    return run_to_hf(config, ctx)


def _to_torch_dist(config: ConvertConfig, ctx: StageContext) -> Manifest:
    if config.hf_checkpoint is None:
        raise StageInputError("convert hf-to-torch-dist", ["no HF checkpoint given"],
                              "Pass --hf-checkpoint DIR (in a pipeline, the model stage's output is used).")
    source = read_hf_source(materialise(ModelConfig(hf_checkpoint=config.hf_checkpoint), ctx.storage,
                                          ctx.workdir, ctx.show_progress),
                            config.megatron.make_vocab_size_divisible_by, config.megatron.tensor_model_parallel_size)
    check_model_flags(config, source.path / "config.json", "--hf-checkpoint")
    save = config.save or str(ctx.workdir / "torch_dist")
    check_target_root(ctx.storage, save, config.overwrite)
    local_root = local_path(save) if is_local(save) else ctx.workdir / "convert-staging"
    started = time.perf_counter()
    with claimed_dir(local_root, staging_prefix(RELEASE)) as staged:  # claimed until published
        ranks = write_torch_dist(source, staged, config.processes, config.megatron.make_vocab_size_divisible_by,
                                 config.megatron.tensor_model_parallel_size, launcher=config.launcher,
                                 ray_address=ctx.ray_address)
        # Hashed once, before the commit: the release's own checksums (verified where it is loaded, e.g. as
        # --ref-load) and the manifest's records.
        records = write_checksums(staged)
        records.append(replace(ctx.storage.sha256(str(staged / CHECKSUMS)), path=CHECKSUMS))
        ref = publish_release(ctx.storage, staged, save)
        seconds = time.perf_counter() - started
        if not is_local(save):
            shutil.rmtree(staged, ignore_errors=True)
    return Manifest(
        stage="convert",
        outputs={"torch_dist": save, "checkpoint": ref.uri, "hf_checkpoint": str(source.path)},
        artifacts=records, artifact_root=ref.uri,
        counts={"files": len(records), "bytes": sum(r.size for r in records), "processes": config.processes,
                "tensors": sum(r["tensors"] for r in ranks), "peak_rss_max": max(r["peak_rss"] for r in ranks)},
        hashes={"content": content_hash(records)},
        facts={"family": source.family.name, "dtype": source.dtype, "seconds": round(seconds, 3),
               "shape": source.shape.__dict__, "ranks": ranks},
        config=config.model_dump(mode="json"),
    )


def check_model_flags(config: ConvertConfig, hf_config: Path, flag: str) -> None:
    """slime's MODEL_ARGS, when given, must describe the HF model being converted (refused before any work)."""
    problems = check_model_args(config.megatron, json.loads(hf_config.read_text(encoding="utf-8")), "convert")
    if problems:
        raise StageInputError(f"{flag} {hf_config.parent}", problems,
                              "Fix or drop the Megatron model flags (MODEL_ARGS) that disagree with the model.")


def run_to_hf(config: ConvertConfig, ctx: StageContext) -> Manifest:
    """The stage's torch-dist-to-hf direction (config validation guarantees the three paths are set)."""
    assert config.input_dir and config.output_dir and config.origin_hf_dir
    try:
        ref = checkpoints.resolve(ctx.storage, config.input_dir)
    except CheckpointError as err:
        raise StageInputError(f"--input-dir {config.input_dir}", [str(err)],
                              "Point it at a checkpoint root, release/ or an iter_XXXXXXX/ directory.") from None
    origin = local_path(config.origin_hf_dir)
    check_model_flags(config, origin / "config.json", "--origin-hf-dir")
    output = local_path(config.output_dir)
    if output.exists() and any(output.iterdir()) and not config.overwrite:
        raise StageInputError(f"--output-dir {output}", ["exists and is not empty"],
                              "Choose another --output-dir, or pass --overwrite to replace it.")
    weights = write_hf(local_path(ref.uri), output, origin, config.megatron.vocab_size)
    records = fingerprint(output, ctx.storage)
    return Manifest(
        stage="convert",
        outputs={"hf_checkpoint": str(output), "checkpoint": ref.uri},
        artifacts=records, artifact_root=str(output),
        counts={"files": len(records), "bytes": sum(r.size for r in records), "tensors": weights},
        hashes={"content": content_hash(records)},
        facts={"iteration": str(ref.iteration)},
        config=config.model_dump(mode="json"),
    )


def check_target_root(storage: Storage, root: str, overwrite: bool) -> None:
    """StageInputError when `root` already holds a checkpoint (or a tracker) and `overwrite` is off."""
    if overwrite:
        return
    present = checkpoints.list_checkpoints(storage, root, include_incomplete=True)
    tracker = checkpoints.read_tracker(storage, root) if storage.isdir(root) else None
    if present or tracker is not None:
        names = [ref.uri for ref in present] or [join(root, checkpoints.TRACKER_FILENAME)]
        raise StageInputError(f"--save {root} already holds a checkpoint", names,
                              "Choose another --save directory, or pass --overwrite to replace it.")
