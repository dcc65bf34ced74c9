"""The convert stage: HF safetensors <-> Megatron torch_dist, exact, in either direction.

hf-to-torch-dist validates the HF directory against its family's spec (slimeflow/families/) before
anything is written, converts with N cooperating worker processes (worker.py), each writing its share of the
layers, into a staging directory that becomes `<save>/release/` only when complete; the tracker is set last.
torch-dist-to-hf reads a checkpoint (a root, release/ or iter_XXXXXXX/), strips the vocabulary padding and
writes sharded safetensors with an index and the origin's config and tokenizer, again via a staging directory.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimeflow.families import FamilySpec, family_for, supported_architectures
from slimeflow.io import checkpoints
from slimeflow.io.checkpoints import RELEASE, CheckpointError
from slimeflow.io.storage import Storage, inside, is_local, join, local_path
from slimeflow.manifest import Manifest, content_hash
from slimeflow.stages.base import StageContext, StageInputError
from slimeflow.stages.convert.config import ConvertConfig
from slimeflow.stages.convert.diskspace import no_space_left, ran_out_of_space
from slimeflow.stages.convert.export import check_model_flags, replace_dir, run_to_hf
from slimeflow.stages.convert.integrity import CHECKSUMS, write_checksums
from slimeflow.stages.convert.launch import Launcher, launch
from slimeflow.stages.convert.mapping import ModelShape, expected_hf_tensors, global_rules
from slimeflow.stages.convert.staging import JOB_PREFIX, claimed_dir, remove_abandoned, staging_prefix
from slimeflow.stages.convert.worker import Job, Share
from slimeflow.stages.model.config import ModelConfig
from slimeflow.stages.model.stage import INDEX_FILE, inspect_hf_dir, materialise

ITERATION = 1  # a converted model is saved as iteration 1 and published as release/, as Megatron's tools do


@dataclass(frozen=True)
class HFSource:
    """A validated HF checkpoint: where it is, its family and shape, and where each tensor lives."""

    path: Path
    family: FamilySpec
    shape: ModelShape
    weight_map: dict[str, str]
    sizes: dict[str, int]
    """Bytes of each tensor."""
    dtype: str
    """torch dtype name of the embedding (the model's parameter dtype)."""


def run(config: ConvertConfig, ctx: StageContext) -> Manifest:
    """Convert in `config.direction`; the manifest lists the written files with their sha256."""
    if config.direction == "hf-to-torch-dist":
        return _to_torch_dist(config, ctx)
    return run_to_hf(config, ctx)


# ---------------------------------------------------------------------------------------------------------------
# HF -> torch_dist
# ---------------------------------------------------------------------------------------------------------------


def _to_torch_dist(config: ConvertConfig, ctx: StageContext) -> Manifest:
    if config.hf_checkpoint is None:
        raise StageInputError("convert hf-to-torch-dist", ["no HF checkpoint given"],
                              "Pass --hf-checkpoint DIR (in a pipeline, the model stage's output is used).")
    source = read_hf_source(materialise(ModelConfig(hf_checkpoint=config.hf_checkpoint), ctx),
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
        records.append(ctx.storage.sha256(str(staged / CHECKSUMS)).model_copy(update={"path": CHECKSUMS}))
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


def read_hf_source(path: Path, make_vocab_size_divisible_by: int = 128,
                   tensor_model_parallel_size: int = 1) -> HFSource:
    """Validate an HF directory for conversion; StageInputError listing every problem, before any write."""
    inspect_hf_dir(path)  # config, tokenizer, whole (untruncated) safetensors files
    hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    family = family_for(hf_config.get("architectures"))
    where = f"HF checkpoint {path} cannot be converted"
    if family is None:
        raise StageInputError(where, [f"unsupported architecture {hf_config.get('architectures')} "
                                      f"(model_type {hf_config.get('model_type')!r})"],
                              f"Supported: {', '.join(supported_architectures())}. A new family is a spec in "
                              "slimeflow/families/ plus its round-trip test.")
    try:
        shape = ModelShape.from_hf_config(hf_config, family, make_vocab_size_divisible_by, tensor_model_parallel_size)
    except KeyError as err:
        raise StageInputError(where, [f"config.json has no {err.args[0]!r}"], "Re-save the config with transformers.") from None
    problems = shape.problems()
    if problems:
        raise StageInputError(where, problems, "Fix config.json so that it describes these weights.")
    weight_map, headers = _read_headers(path)
    mtp = _mtp_layers(headers, shape.num_layers)
    if mtp:
        raise StageInputError(where, [f"layers {mtp} after the {shape.num_layers} decoder layers are multi-token "
                                      f"prediction layers (num_nextn_predict_layers: "
                                      f"{hf_config.get('num_nextn_predict_layers')}), which are not converted yet"],
                              "Convert a copy without the model.layers.<n>.* tensors of those layers (training "
                              "without MTP, as --mtp-num-layers is refused too).")
    problems = _tensor_problems(headers, expected_hf_tensors(shape))
    if problems:
        raise StageInputError(where, problems, "The weights do not match config.json: re-save the model with "
                              "save_pretrained, or fix the config.")
    sizes = {name: _nbytes(shape_, dtype) for name, (shape_, dtype) in headers.items()}
    dtype = _TORCH_DTYPES[headers["model.embed_tokens.weight"][1]]
    return HFSource(path, family, shape, weight_map, sizes, dtype)


_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    count = _ITEMSIZE.get(dtype, 4)
    for dim in shape:
        count *= dim
    return count


def _read_headers(path: Path) -> tuple[dict[str, str], dict[str, tuple[tuple[int, ...], str]]]:
    """(tensor -> file, tensor -> (shape, safetensors dtype)) from the safetensors headers, no data read."""
    from safetensors import safe_open

    index = path / INDEX_FILE
    files = (sorted({inside(str(path), name)  # index entries are data: none may point outside the checkpoint
                     for name in json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()})
             if index.is_file() else ["model.safetensors"])
    weight_map, headers = {}, {}
    for filename in files:
        with safe_open(path / filename, framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                weight_map[name] = filename
                headers[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return weight_map, headers


def _mtp_layers(headers: dict[str, Any], num_layers: int) -> list[int]:
    """Layer numbers at or past num_layers (DeepSeek's and GLM-4.5's checkpoints keep their MTP layers there)."""
    numbers = {name.split(".")[2] for name in headers if name.startswith("model.layers.")}
    return sorted(int(n) for n in numbers if n.isdigit() and int(n) >= num_layers)


def _tensor_problems(headers: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, tuple[int, ...]]
                     ) -> list[str]:
    missing = [n for n in expected if n not in headers]
    unexpected = [n for n in headers if n not in expected]
    wrong = [f"{n} has shape {list(headers[n][0])}, config.json implies {list(s)}"
             for n, s in expected.items() if n in headers and headers[n][0] != s]
    odd = [f"{n} has dtype {headers[n][1]}; supported: {', '.join(_TORCH_DTYPES)}"
           for n in headers if headers[n][1] not in _TORCH_DTYPES]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:8])}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:8])}")
    return problems + wrong[:8] + odd[:8]


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


def assign_shares(source: HFSource, processes: int) -> list[Share]:
    """Split layers and globals over `processes` ranks, balancing bytes (largest first onto the lightest rank)."""
    shape = source.shape
    items: list[tuple[int, int | str]] = []
    for rule in global_rules(shape):
        items.append((sum(source.sizes[n] for n in rule.hf), rule.megatron))
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}."
        items.append((sum(size for name, size in source.sizes.items() if name.startswith(prefix)), layer))
    loads = [0] * processes
    picked: list[list[int | str]] = [[] for _ in range(processes)]
    for size, item in sorted(items, key=lambda pair: -pair[0]):
        rank = loads.index(min(loads))
        loads[rank] += size
        picked[rank].append(item)
    return [Share(tuple(sorted(i for i in p if isinstance(i, int))), tuple(i for i in p if isinstance(i, str)))
            for p in picked]


def convert_hf_to_torch_dist(source: HFSource, root: Path, processes: int = 1, make_vocab_size_divisible_by: int = 128,
                             tensor_model_parallel_size: int = 1, iteration: int = ITERATION,
                             staging_name: str = RELEASE, launcher: Launcher = "local", ray_address: str | None = None
                             ) -> tuple[Path, list[dict[str, Any]]]:
    """Write the torch_dist checkpoint of `source` into a staging directory under `root` (write_torch_dist);
    returns the staging directory and each rank's report. The caller publishes it.

    `iteration` goes into common.pt and the staging directory is `.<staging_name>.tmp-*`: a conversion keeps
    the defaults (release), a training backend saving its weights passes its iteration and `iter_XXXXXXX`."""
    with claimed_dir(root, staging_prefix(staging_name)) as staging:
        ranks = write_torch_dist(source, staging, processes, make_vocab_size_divisible_by, tensor_model_parallel_size,
                                 iteration, launcher, ray_address)
    return staging, ranks


def write_torch_dist(source: HFSource, staging: Path, processes: int = 1, make_vocab_size_divisible_by: int = 128,
                     tensor_model_parallel_size: int = 1, iteration: int = ITERATION, launcher: Launcher = "local",
                     ray_address: str | None = None) -> list[dict[str, Any]]:
    """Write the torch_dist checkpoint of `source` into the (claimed, empty) directory `staging` with `processes`
    worker processes, started by `launcher` (launch.py: local subprocesses, or Ray tasks on the cluster at
    `ray_address`, None: a local Ray); returns each rank's report. On failure `staging` is removed.

    The job's files live in a claimed `.convert-job-*` beside `staging`, removed at the end; first, what crashed
    conversions left beside it is removed (staging.remove_abandoned)."""
    remove_abandoned(staging.parent)
    with claimed_dir(staging.parent, JOB_PREFIX) as scratch:
        job = Job(hf_dir=str(source.path), weight_map=source.weight_map, shape=source.shape.__dict__,
                  dtype=source.dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                  tensor_model_parallel_size=tensor_model_parallel_size, checkpoint_dir=str(staging),
                  iteration=iteration, init_method=(scratch / "rendezvous").resolve().as_uri(),
                  shares=assign_shares(source, processes))
        try:
            job.write(scratch / "job.json")
            launch(scratch / "job.json", processes, launcher, ray_address)
            return [json.loads((scratch / f"rank-{r}.json").read_text(encoding="utf-8")) for r in range(processes)]
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            _raise_if_out_of_space(err, staging, sum(source.sizes.values()))
            raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _raise_if_out_of_space(err: BaseException, staging: Path, needed: int) -> None:
    """NoSpaceLeft, from `err`, when the conversion failed for want of space in `staging` (ran_out_of_space: the
    ranks' logs beside it may have lost their words, but the checkpoint still does not fit)."""
    if isinstance(err, Exception) and ran_out_of_space(err, staging, needed):
        raise no_space_left(staging, "the checkpoint", needed) from err


def publish_release(storage: Storage, staged: Path, root: str) -> checkpoints.CheckpointRef:
    """Move a complete staged checkpoint to `<root>/release/` (replacing one that is there), then set the tracker."""
    missing = checkpoints.missing_markers(storage, str(staged))
    if missing:
        raise CheckpointError(f"staged checkpoint {staged} is incomplete: missing {', '.join(missing)}")
    target = join(root, RELEASE)
    if is_local(root):
        replace_dir(staged, local_path(target))
    else:
        if storage.exists(target):
            storage.remove(target, recursive=True)
        storage.copy_tree(str(staged), target)
    return checkpoints.commit(storage, root, RELEASE)
