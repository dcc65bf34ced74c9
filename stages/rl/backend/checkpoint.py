"""Training checkpoints of the torch backend in Megatron's torch_dist layout (readable by Megatron, by the convert
stage and by our export), plus slimeflow's side files for an exact resume.

    <root>/iter_0000020/                 iteration = rollout id, as slime
        *.distcp, .metadata, common.pt, metadata.json   the weights, written by the convert stage's writer
        slimeflow/training_state.pt     optimizer + scheduler state (identical on every data-parallel rank)
        slimeflow/rng_state.pt          every rank's python, numpy, torch (and CUDA) RNG states
        slimeflow/extra_state.json      the caller's JSON state (data source, rollout id, ...)

A save is staged in `<root>/.iter_XXXXXXX.tmp-*`, renamed into place when complete, and only then committed to
the tracker; a save that fails or is killed at any point leaves the previous checkpoint as the latest.
Checkpoint roots are local paths (an s3 root is refused with a message; copy a local root with io.storage).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from slimeflow.io import checkpoints
from slimeflow.io.checkpoints import CheckpointRef
from slimeflow.io.storage import Storage, local_path
from slimeflow.stages.convert.export import origin_family, replace_dir
from slimeflow.stages.convert.mapping import ModelShape, megatron_to_hf
from slimeflow.stages.convert.stage import convert_hf_to_torch_dist, read_hf_source
from slimeflow.stages.convert.torch_dist import load_torch_dist, unstack_layers
from slimeflow.stages.model.stage import TOKENIZER_FILES
from slimeflow.stages.rl.backend.ownership import local_root
from slimeflow.stages.rl.backend.torch_backend import rng_state, set_rng_state

if TYPE_CHECKING:
    from slimeflow.stages.rl.backend.torch_backend import TorchBackend

SIDE_DIR = "slimeflow"
TRAINING_STATE = "training_state.pt"
RNG_STATE = "rng_state.pt"
EXTRA_STATE = "extra_state.json"
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
                  *TOKENIZER_FILES)
"""What the convert stage's reader needs next to the weights (config and tokenizer), copied from the HF dir."""


def save_checkpoint(backend: TorchBackend, root: str | Path, rollout_id: int, extra_state: dict[str, Any],
                    before_commit: Callable[[], None] | None = None) -> CheckpointRef:
    """Save weights, optimizer, scheduler, RNG and `extra_state` as `<root>/iter_{rollout_id:07d}`, then commit it.

    Collective: every data-parallel rank calls it (rank 0 writes, the others hand over their RNG states) and
    every rank gets the committed checkpoint, or the error rank 0 met. `extra_state` must be JSON-serialisable.
    `before_commit` runs on rank 0 once everything is staged, just before the directory is moved into place: an
    error it raises abandons the save as any other failure does (the previous checkpoint stays the latest).
    """
    extra_json = json.dumps(extra_state)  # fail before writing anything
    rngs = _gather_objects(rng_state(), backend.world_size)
    error, ref = None, None
    if backend.rank == 0:
        try:
            ref = _save(backend, local_root(root), rollout_id, extra_json, rngs, before_commit)
        except BaseException as err:
            error = err
    if backend.world_size > 1:
        status = [None if error is None else f"{type(error).__name__}: {error}"]
        torch.distributed.broadcast_object_list(status, src=0)
        if backend.rank != 0 and status[0] is not None:
            raise RuntimeError(f"rank 0 failed to save checkpoint {rollout_id} under {root}: {status[0]}")
    if error is not None:
        raise error
    if ref is None:  # ranks > 0: the same reference rank 0 committed
        ref = CheckpointRef(root=str(root), iteration=rollout_id,
                            uri=str(Path(root) / checkpoints.iteration_dirname(rollout_id)))
    return ref


def _save(backend: TorchBackend, root: Path, rollout_id: int, extra_json: str, rngs: list[Any],
          before_commit: Callable[[], None] | None) -> CheckpointRef:
    name = checkpoints.iteration_dirname(rollout_id)
    staged = _stage_weights(backend, root, rollout_id)
    target = root / name
    try:
        write_side_files(staged / SIDE_DIR, backend.training_state(), rngs, extra_json)
        if before_commit is not None:
            before_commit()
        replace_dir(staged, target)
        return checkpoints.commit(Storage(), str(root), rollout_id)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        if checkpoints.read_tracker(Storage(), str(root)) != rollout_id:
            shutil.rmtree(target, ignore_errors=True)  # never leave a complete-looking, uncommitted directory
        raise


def _stage_weights(backend: TorchBackend, root: Path, rollout_id: int) -> Path:
    """The current weights as a staged torch_dist directory, via HF safetensors and the convert stage's writer."""
    from safetensors.torch import save_file

    scratch = root / f".hf-weights-{uuid.uuid4().hex[:8]}"
    scratch.mkdir(parents=True)
    try:
        weights = {k: v.contiguous() for k, v in backend.named_weights().items()}
        save_file(weights, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        for filename in _HF_SIDE_FILES:
            if (backend.hf_checkpoint / filename).is_file():
                shutil.copy2(backend.hf_checkpoint / filename, scratch / filename)
        staged, _ = convert_hf_to_torch_dist(read_hf_source(scratch), root, processes=1, iteration=rollout_id,
                                             staging_name=checkpoints.iteration_dirname(rollout_id))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return staged


def write_side_files(side: Path, training_state: dict[str, Any], rngs: list[Any], extra_json: str) -> None:
    """slimeflow's resume state next to the Megatron files (Megatron ignores the folder)."""
    side.mkdir(parents=True, exist_ok=True)
    torch.save(training_state, side / TRAINING_STATE)
    torch.save({"ranks": rngs}, side / RNG_STATE)
    (side / EXTRA_STATE).write_text(extra_json, encoding="utf-8")


def _gather_objects(obj: Any, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def read_weights(checkpoint: str | Path, hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """HF-named weights of a torch_dist checkpoint (a root, iter_XXXXXXX/ or release/), vocabulary padding
    stripped; `hf_dir` gives the family and the true vocabulary size."""
    ref = checkpoints.resolve(Storage(), str(checkpoint))
    hf_config, family = origin_family(Path(hf_dir))
    tensors, args = load_torch_dist(local_path(ref.uri))
    shape = ModelShape.from_megatron_args(args, family, hf_config["vocab_size"])
    return megatron_to_hf(unstack_layers(tensors), shape)


def load_checkpoint(backend: TorchBackend, ref_or_uri: CheckpointRef | str | Path,
                    weights_only: bool = False) -> dict[str, Any]:
    """Restore weights, then (unless weights_only) optimizer, scheduler and this rank's RNG states; returns the
    saved extra_state. A checkpoint without side files (a converted release/, Megatron's own) loads weights
    only and returns {}. Every rank calls it; none needs the others."""
    ref = ref_or_uri if isinstance(ref_or_uri, CheckpointRef) else checkpoints.resolve(Storage(), str(ref_or_uri))
    directory = local_root(ref.uri)
    backend.load_weights(read_weights(directory, backend.hf_checkpoint), ref.uri)
    side = directory / SIDE_DIR
    if weights_only or not (side / TRAINING_STATE).is_file():
        return {}
    backend.load_training_state(torch.load(side / TRAINING_STATE, map_location=backend.device, weights_only=True))
    # Pickled python/numpy RNG states: our own files (only load checkpoints you trust, as with common.pt).
    rngs = torch.load(side / RNG_STATE, weights_only=False)["ranks"]
    set_rng_state(rngs[backend.rank % len(rngs)])
    return json.loads((side / EXTRA_STATE).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class StartPoint:
    """Where training starts: `ref` to load (None: the HF checkpoint's own weights) and whether weights only."""

    source: Literal["load", "ref_load", "hf_checkpoint"]
    ref: CheckpointRef | None
    weights_only: bool


def resolve_start(load: str | None, ref_load: str | None) -> StartPoint:
    """slime's rule: --load holding a valid checkpoint resumes from its latest (everything); otherwise --ref-load
    (weights only; CheckpointError if it holds no checkpoint); otherwise the HF checkpoint's weights.

    Then: `load_checkpoint(backend, start.ref, start.weights_only)` when start.ref is not None.
    """
    storage = Storage()
    if load is not None:
        latest = checkpoints.find_latest(storage, str(local_root(load)))
        if latest is not None:
            return StartPoint("load", latest, weights_only=False)
    if ref_load is not None:
        return StartPoint("ref_load", checkpoints.resolve(storage, str(local_root(ref_load))), weights_only=True)
    return StartPoint("hf_checkpoint", None, weights_only=True)
