"""Training checkpoints of the torch backend in Megatron's torch_dist layout (readable by Megatron, by the convert
stage and by our export), plus slimeflow's side files for an exact resume.

    <root>/iter_0000020/                 iteration = rollout id, as slime
        *.distcp, .metadata, common.pt, metadata.json   the weights, written by the convert stage's writer
        slimeflow/training_state.pt     optimizer + scheduler state (identical on every data-parallel rank)
        slimeflow/rng_state.pt          every rank's python, numpy, torch (and CUDA) RNG states
        slimeflow/extra_state.json      the caller's JSON state (data source, rollout id, ...)
        slimeflow/checksums.json        sha256 of every other file (convert.integrity), checked before a load

A save is staged in `<root>/.iter_XXXXXXX.tmp-*`, renamed into place when complete, and only then committed to
the tracker; a save that fails or is killed at any point leaves the previous checkpoint as the latest. A load
refuses a damaged checkpoint (CheckpointError naming the file) and an iteration checkpoint that lost its resume
state, rather than training on it or restarting at rollout 0 over the run's checkpoints.
Checkpoint roots are local paths (an s3 root is refused with a message; copy a local root with io.storage).
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slimeflow.checkpoint import safe_pickle
from slimeflow.checkpoint.convert import stage_torch_dist
from slimeflow.checkpoint.hf_write import origin_family, replace_dir
from slimeflow.checkpoint.integrity import Ledger, verify_checkpoint, write_checksums
from slimeflow.checkpoint.mapping import ModelShape, megatron_to_hf
from slimeflow.checkpoint.torch_dist import load_torch_dist, unstack_layers, without_crc32, write_behind
from slimeflow.errors import CheckpointError
from slimeflow.io import checkpoints
from slimeflow.io.checkpoints import RELEASE, CheckpointRef, local_root
from slimeflow.io.guard import held
from slimeflow.io.storage import Storage, local_path
from slimeflow.train.backends.checkpoint import (
    EXTRA_STATE,
    SIDE_DIR,
    TRAINING_STATE,
    read_extra_state,
    reading,
)
from slimeflow.train.backends.common import raise_on_every_rank, wait_for_commit
from slimeflow.train.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from slimeflow.train.backends.torch.backend import TorchBackend

logger = logging.getLogger(__name__)

RNG_STATE = "rng_state.pt"


def save_checkpoint(backend: TorchBackend, root: str | Path, rollout_id: int, extra_state: dict[str, Any],
                    before_commit: Callable[[], None] | None = None, async_save: bool = False) -> CheckpointRef:
    """Save weights, optimizer, scheduler, RNG and `extra_state` as `<root>/iter_{rollout_id:07d}`, then commit it.

    Collective: every data-parallel rank calls it (rank 0 writes, the others hand over their RNG states) and
    every rank gets the committed checkpoint, or the error rank 0 met. `extra_state` must be JSON-serialisable.
    `before_commit` runs on rank 0 once everything is staged, just before the directory is moved into place: an
    error it raises abandons the save as any other failure does (the previous checkpoint stays the latest).
    First the previous `async_save`'s commit is waited for (its error raised on every rank). With `async_save`,
    rank 0 copies what it will write (Snapshot) and returns; the same files are written, fsynced and committed,
    in the same order, by its BackgroundCommit, and the returned reference is committed once `wait_for_save`
    returns.
    """
    extra_json = json.dumps(extra_state)  # fail before writing anything
    wait_for_save(backend, collective=True)
    rngs = _gather_objects(rng_state(), backend.world_size)
    error, ref = None, None
    if backend.rank == 0:
        try:
            ref = _save_or_start(backend, local_root(root), rollout_id, extra_json, rngs, before_commit, async_save)
        except BaseException as err:
            error = err
    raise_on_every_rank(error, backend.rank, backend.world_size, f"rank 0 failed to save checkpoint {rollout_id} under {root}")
    if ref is None:  # ranks > 0: the same reference rank 0 committed
        ref = CheckpointRef(root=str(root), iteration=rollout_id,
                            uri=str(Path(root) / checkpoints.iteration_dirname(rollout_id)))
    return ref


def wait_for_save(backend: TorchBackend, collective: bool = False) -> None:
    """Until this rank's --async-save commit in flight (rank 0's; none elsewhere) has ended; CheckpointError, from
    its cause, when it failed. `collective`: every rank calls it and every rank raises rank 0's error."""
    wait_for_commit(backend.background_commit, backend.rank, backend.world_size, collective)


def _save_or_start(backend: TorchBackend, root: Path, rollout_id: int, extra_json: str, rngs: list[Any],
                   before_commit: Callable[[], None] | None, async_save: bool) -> CheckpointRef:
    """The committed checkpoint; with `async_save`, the one whose commit has started (wait_for_save)."""
    weights, training_state = backend.checkpoint_weights(), backend.training_state()
    if not async_save:
        return _save(weights, training_state, backend.hf_checkpoint, root, rollout_id, extra_json, rngs,
                     before_commit)
    snapshot = backend.save_snapshot.take({"weights": weights, "state": training_state})
    backend.background_commit.start(
        f"checkpoint {rollout_id} under {root}",
        lambda: _save(snapshot["weights"], snapshot["state"], backend.hf_checkpoint, root, rollout_id, extra_json,
                      rngs, before_commit))
    return CheckpointRef(root=str(root), iteration=rollout_id,
                         uri=str(root / checkpoints.iteration_dirname(rollout_id)))


def _save(weights: dict[str, torch.Tensor], training_state: dict[str, Any], hf_dir: Path, root: Path,
          rollout_id: int, extra_json: str, rngs: list[Any],
          before_commit: Callable[[], None] | None) -> CheckpointRef:
    name = checkpoints.iteration_dirname(rollout_id)
    ledger = Ledger()  # every file is hashed as it is written, from memory: none is read back for its checksum
    # The side files (the optimizer state: 2/3 of the bytes) are written beside the weights, in a thread of their
    # own: each file's write, hash and fsync are one stream, and the streams overlap.
    staged = stage_torch_dist(weights, hf_dir, root, rollout_id, name, ledger=ledger, beside=lambda staging:
                              write_side_files(staging / SIDE_DIR, training_state, rngs, extra_json, ledger))
    target = root / name
    try:
        with held(staged):  # claimed until it is moved into place: a killed save's is removed by the next run
            write_checksums(staged, ledger)  # last: it covers every other file
            if before_commit is not None:
                before_commit()
            if target.exists():  # a rollout saved before is redone (--start-rollout-id): say so, never silently
                logger.warning("replacing the checkpoint %s with a new save of rollout %d", target, rollout_id)
            replace_dir(staged, target)
        return checkpoints.commit(Storage(), str(root), rollout_id)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        if checkpoints.read_tracker(Storage(), str(root)) != rollout_id:
            shutil.rmtree(target, ignore_errors=True)  # never leave a complete-looking, uncommitted directory
        raise


class Snapshot:
    """--async-save's copy of what a save writes (weights, optimizer state), taken while the trainer waits, so
    training may change the originals while the copy is written. The copies live in host buffers kept from one
    save to the next (the next save waits for the commit that reads them): refilling warm buffers runs at memcpy
    speed, new ones pay a page fault per page. Costs the checkpoint's size in host memory while --async-save is on.
    On a GPU the optimizer state is saved as host tensors (a load maps it to the backend's device either way)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def take(self, tree: Any, path: tuple[Any, ...] = ()) -> Any:
        """`tree` (dicts, lists and tuples of tensors and plain values) with every tensor copied into a buffer."""
        if isinstance(tree, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != tree.shape or buffer.dtype != tree.dtype \
                    or buffer.stride() != tree.stride():
                buffer = self._buffers[path] = torch.empty_like(tree, device="cpu")
            return buffer.copy_(tree.detach())
        if isinstance(tree, dict):
            return {key: self.take(value, (*path, key)) for key, value in tree.items()}
        if type(tree) in (list, tuple):  # not a named tuple: rebuilt from its items
            return type(tree)(self.take(value, (*path, i)) for i, value in enumerate(tree))
        return tree


def write_side_files(side: Path, training_state: dict[str, Any], rngs: list[Any], extra_json: str,
                     ledger: Ledger | None = None) -> None:
    """slimeflow's resume state next to the Megatron files (Megatron ignores the folder), each file fsynced (the
    tracker may name this checkpoint only once its bytes are on disk) and hashed into `ledger` as it is written."""
    side.mkdir(parents=True, exist_ok=True)
    ledger = ledger if ledger is not None else Ledger()
    # The optimizer state is 2x the weights: its CRC32 cost more than its write. Write-behind: the disk writes it
    # out while torch.save is still writing, so the closing fsync finds little left to do.
    with without_crc32(), write_behind(side, TRAINING_STATE), ledger.open(side / TRAINING_STATE) as file:
        torch.save(training_state, file)  # type: ignore[arg-type]  # torch calls only write, flush
    with ledger.open(side / RNG_STATE) as file:
        torch.save({"ranks": [_portable_rng(rng) for rng in rngs]}, file)  # type: ignore[arg-type]
    with ledger.open(side / EXTRA_STATE) as file:
        file.write(extra_json.encode("utf-8"))


def _portable_rng(state: dict[str, Any]) -> dict[str, Any]:
    """An RNG state that torch.load(weights_only=True) reads: numpy's key array as a list (python's state is
    already a tuple of ints, torch's a tensor)."""
    kind, key, *rest = state["numpy"]
    return {**state, "numpy": (kind, key.tolist(), *rest)}


def _read_rngs(path: Path) -> list[Any]:
    try:
        return torch.load(path, weights_only=True)["ranks"]
    except pickle.UnpicklingError:  # saved before the RNG states were portable: numpy arrays, pickled
        return safe_pickle.torch_load(path)["ranks"]


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
    verify_checkpoint(local_path(ref.uri))
    return _read_weights(local_path(ref.uri), hf_dir)


def _read_weights(directory: Path, hf_dir: str | Path) -> dict[str, torch.Tensor]:
    hf_config, family = origin_family(Path(hf_dir))
    with reading(directory):
        tensors, args = load_torch_dist(directory)
    shape = ModelShape.from_megatron_args(args, family, hf_config["vocab_size"])
    return megatron_to_hf(unstack_layers(tensors), shape)


def load_checkpoint(backend: TorchBackend, ref_or_uri: CheckpointRef | str | Path,
                    weights_only: bool = False) -> dict[str, Any]:
    """Verify the checkpoint, restore weights, then (unless weights_only) optimizer, scheduler and this rank's RNG
    states; returns the saved extra_state. A release/ checkpoint without side files (a converted one) loads weights
    only and returns {}. CheckpointError for a damaged checkpoint (convert.integrity) and, unless weights_only, for
    an iteration checkpoint without its resume state. Every rank calls it; none needs the others."""
    ref = ref_or_uri if isinstance(ref_or_uri, CheckpointRef) else checkpoints.resolve(Storage(), str(ref_or_uri))
    directory = local_root(ref.uri)
    verify_checkpoint(directory)
    side = directory / SIDE_DIR
    resume = not weights_only and has_resume_state(ref, side)
    backend.load_weights(_read_weights(directory, backend.hf_checkpoint), ref.uri)
    if not resume:
        return {}
    with reading(side / TRAINING_STATE):
        backend.load_training_state(torch.load(side / TRAINING_STATE, map_location=backend.device,
                                               weights_only=True))
    with reading(side / RNG_STATE):
        rngs = _read_rngs(side / RNG_STATE)
    set_rng_state(rngs[backend.rank % len(rngs)])
    return read_extra_state(directory)


def has_resume_state(ref: CheckpointRef, side: Path) -> bool:
    """True when `side` holds every resume file; False for a release/ without any (weights only, as slime);
    CheckpointError otherwise: resuming from the weights alone would restart at rollout 0 and overwrite the run's
    checkpoints."""
    missing = [name for name in (TRAINING_STATE, RNG_STATE, EXTRA_STATE) if not (side / name).is_file()]
    if not missing or (ref.iteration == RELEASE and len(missing) == 3):
        return not missing
    raise CheckpointError(
        f"{ref.uri} cannot be resumed: {', '.join(str(side / m) for m in missing)} missing, so the optimizer, "
        f"scheduler, RNG and data position it was saved with are lost, and starting over from its weights would "
        f"restart at rollout 0 over the checkpoints in {ref.root}. To train on from its weights, pass "
        f"--ref-load {ref.uri} with a new --save; to resume from an earlier checkpoint, move {ref.uri} aside")
