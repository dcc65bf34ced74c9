"""Checkpoints of the Megatron backend, saved and loaded by every rank through megatron-core's dist_checkpointing.

    <root>/iter_0000020/               iteration = rollout id, committed in latest_checkpointed_iteration.txt
        *.distcp, .metadata, common.pt, metadata.json   Megatron-LM's layout (the convert stage's, too):
            model tensors under the same keys the convert stage writes; optimizer state (`optimizer.*` keys);
            `rng_state` (a ShardedObject per (pipeline, tensor) rank, as Megatron-LM's); common.pt holds args,
            checkpoint_version, iteration and opt_param_scheduler
        slimeflow/extra_state.json     the caller's JSON state (data source, rollout id, ...)
        slimeflow/checksums.json       sha256 of every other file, checked before a load

Each rank writes and reads only its own shards, so a checkpoint loads at another TP/PP layout (or virtual
pipeline) than it was saved at; the RNG states are per (pipeline, tensor) rank, so, as Megatron-LM does, they are
restored only at the layout they were saved at (common.pt's args record it). An MoE model's optimizer state under
expert parallelism is split in two (dense and expert parameters): it resumes at its own expert-parallel size only. Staging, commit and refusals follow the torch backend's checkpoints (checkpoint.py): a save is staged in
`<root>/.iter_XXXXXXX.tmp-*` (claimed by rank 0), moved into place when complete and only then committed.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from argparse import Namespace
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slimeflow.checkpoint.hf_write import replace_dir
from slimeflow.checkpoint.integrity import verify_checkpoint, write_checksums
from slimeflow.checkpoint.staging import claimed_dir, staging_prefix
from slimeflow.checkpoint.torch_dist import CHECKPOINT_VERSION, read_common, tensor_metadata
from slimeflow.io import checkpoints
from slimeflow.io.checkpoints import RELEASE, CheckpointError, CheckpointRef
from slimeflow.io.storage import Storage
from slimeflow.stages.rl.backend.checkpoint import EXTRA_STATE, SIDE_DIR, reading
from slimeflow.stages.rl.backend.ownership import local_root
from slimeflow.stages.rl.backend.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from collections.abc import Callable

    from slimeflow.stages.rl.backend.megatron_backend import MegatronBackend

logger = logging.getLogger(__name__)

SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True,
            "chained_optim_avoid_prefix": False}
"""How the optimizer state is laid out (also saved as the checkpoint's content metadata, which Megatron-LM reads
back). With --use-distributed-optimizer, the data-parallel ranks' shards of the Adam state are gathered on DP rank 0
over gloo, in CPU memory (mem_efficient), and saved per parameter in its shape (`optimizer.state.exp_avg.<key>`, as
without it), so the state reshards to any parallel layout; Megatron-LM's default, dp_reshardable, saves the flat
buffers, resumable at another DP size only. Without it the setting changes nothing. An MoE model under expert
parallelism is stepped by two optimizers (dense and expert parameters): their states keep their chained_0. /
chained_1. prefixes, which is how a resume tells that split from one optimizer's (_check_optimizer_split)."""


def _sharded_state(backend: MegatronBackend, rollout_id: int | None, is_loading: bool,
                   with_training_state: bool, with_rng: bool = True) -> dict[str, Any]:
    """What every rank saves (or declares to load): its model shards, and with the training state its optimizer
    shards, the schedule and its RNG states, under Megatron-LM's top-level names."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict[str, Any] = model_state(backend.modules)
    if with_training_state:
        state["optimizer"] = backend.optimizer.sharded_state_dict(dict(state), is_loading=is_loading,
                                                                  metadata=SHARDING)
    if with_training_state and with_rng:
        pp, tp = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()
        state["rng_state"] = ShardedObject(
            "rng_state", [_rng_with_tracker()], (pp, tp),
            (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
            replica_id=parallel_state.get_data_parallel_rank())
    if with_training_state and not is_loading:
        state["opt_param_scheduler"] = backend.scheduler.state_dict()
    if not is_loading:
        state.update(args=_saved_args(backend), checkpoint_version=CHECKPOINT_VERSION, iteration=rollout_id)
    return state


def _saved_args(backend: MegatronBackend) -> Any:
    """The model's args with the layout it was saved at, as Megatron-LM records its own run's."""
    p = backend.parallel
    return Namespace(**{**vars(backend.args), "tensor_model_parallel_size": p.tensor_model_parallel_size,
                        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                        "expert_model_parallel_size": p.expert_model_parallel_size,
                        "num_layers_per_virtual_pipeline_stage": p.num_layers_per_virtual_pipeline_stage})


def _same_layout(backend: MegatronBackend, directory: Path) -> bool:
    """Whether the checkpoint was saved at this run's (tensor, pipeline) layout: its per-rank RNG states fit."""
    saved = read_common(directory)["args"]
    p = backend.parallel
    return (getattr(saved, "tensor_model_parallel_size", 1), getattr(saved, "pipeline_model_parallel_size", 1)) == \
        (p.tensor_model_parallel_size, p.pipeline_model_parallel_size)


def _rng_with_tracker() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {**rng_state(), "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def save_checkpoint(backend: MegatronBackend, root: str | Path, rollout_id: int, extra_state: dict[str, Any],
                    before_commit: Callable[[], None] | None = None) -> CheckpointRef:
    """Save weights, optimizer, schedule, RNG and `extra_state` as `<root>/iter_{rollout_id:07d}`, then commit it.

    Collective: every rank calls it and writes its shards; rank 0 stages, adds the side files and commits.
    Every rank gets the committed checkpoint, or the error rank 0 met. `before_commit` as in checkpoint.py.
    """
    from megatron.core import dist_checkpointing

    from slimeflow._compat import in_process_write_results

    extra_json = json.dumps(extra_state)  # fail before writing anything
    root_path, name = local_root(root), checkpoints.iteration_dirname(rollout_id)
    with ExitStack() as stack:
        staged = None
        if backend.rank == 0:
            staged = stack.enter_context(claimed_dir(root_path, staging_prefix(name)))
        box = [None if staged is None else str(staged)]
        torch.distributed.broadcast_object_list(box, src=0)
        staged = Path(box[0])
        error = None
        try:
            with backend.on_device(), in_process_write_results():
                dist_checkpointing.save(_sharded_state(backend, rollout_id, False, True), str(staged),
                                        sharded_strategy=("torch_dist", 1), content_metadata=SHARDING)
            torch.distributed.barrier()
            if backend.rank == 0:
                _commit(root_path, staged, rollout_id, extra_json, before_commit)
        except BaseException as err:
            error = err
            if backend.rank == 0:
                shutil.rmtree(staged, ignore_errors=True)
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    torch.distributed.broadcast_object_list(status, src=0)
    if error is not None:
        raise error
    if status[0] is not None:
        raise RuntimeError(f"rank 0 failed to save checkpoint {rollout_id} under {root}: {status[0]}")
    return CheckpointRef(root=str(root), iteration=rollout_id, uri=str(Path(root) / name))


def _commit(root: Path, staged: Path, rollout_id: int, extra_json: str,
            before_commit: Callable[[], None] | None) -> None:
    (staged / SIDE_DIR).mkdir(exist_ok=True)
    (staged / SIDE_DIR / EXTRA_STATE).write_text(extra_json, encoding="utf-8")
    write_checksums(staged)  # last: it covers every other file
    if before_commit is not None:
        before_commit()
    target = root / checkpoints.iteration_dirname(rollout_id)
    if target.exists():  # a rollout saved before is redone (--start-rollout-id): say so, never silently
        logger.warning("replacing the checkpoint %s with a new save of rollout %d", target, rollout_id)
    try:
        replace_dir(staged, target)
        checkpoints.commit(Storage(), str(root), rollout_id)
    except BaseException:
        if checkpoints.read_tracker(Storage(), str(root)) != rollout_id:
            shutil.rmtree(target, ignore_errors=True)  # never leave a complete-looking, uncommitted directory
        raise


def load_checkpoint(backend: MegatronBackend, ref_or_uri: CheckpointRef | str | Path,
                    weights_only: bool = False) -> dict[str, Any]:
    """Verify the checkpoint, restore this rank's weights and, unless weights_only, its optimizer, schedule and RNG
    states; returns the saved extra_state ({} for weights only). CheckpointError for a damaged checkpoint and,
    unless weights_only, for an iteration checkpoint without the Megatron backend's resume state."""
    from megatron.core import dist_checkpointing

    ref = ref_or_uri if isinstance(ref_or_uri, CheckpointRef) else checkpoints.resolve(Storage(), str(ref_or_uri))
    directory = local_root(ref.uri)
    verify_checkpoint(directory)
    resume = not weights_only and has_resume_state(ref, directory)
    if resume:
        _check_optimizer_split(backend, ref.uri, directory)
    with_rng = resume and _same_layout(backend, directory)
    if resume and not with_rng:
        logger.warning("%s was saved at another tensor/pipeline parallel layout: its weights and optimizer state are "
                       "resharded, its per-rank RNG states are not restored (as Megatron-LM)", ref.uri)
    with backend.on_device(), reading(directory):
        loaded = dist_checkpointing.load(_sharded_state(backend, None, True, resume, with_rng), str(directory))
        assign(backend.modules, loaded, ref.uri)
        if not resume:
            return {}
        backend.optimizer.load_state_dict(loaded["optimizer"])
        backend.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if with_rng:
        from megatron.core import tensor_parallel

        rng = loaded["rng_state"][0]
        set_rng_state(rng)
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
    with reading(directory / SIDE_DIR / EXTRA_STATE):
        return json.loads((directory / SIDE_DIR / EXTRA_STATE).read_text(encoding="utf-8"))


def load_weights(chunks: list[torch.nn.Module], checkpoint: str | Path) -> None:
    """This rank's share of the weights of the torch_dist checkpoint `checkpoint` (a root or a directory) into
    its model `chunks`, at whatever TP/PP/EP the checkpoint was written (the reference model's load)."""
    from megatron.core import dist_checkpointing

    ref = checkpoints.resolve(Storage(), str(local_root(checkpoint)))
    directory = local_root(ref.uri)
    verify_checkpoint(directory)
    with reading(directory):
        loaded = dist_checkpointing.load(model_state(chunks), str(directory))
    assign(chunks, loaded, ref.uri)


def model_state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """The model chunks' sharded state dicts under Megatron-LM's names: `model`, or `model0`, `model1`, ... for
    virtual pipeline stages. The tensors' keys are global (layer offsets applied), so the files do not depend on
    the chunking and load at any other layout."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def assign(chunks: list[torch.nn.Module], loaded: dict[str, Any], source: str) -> None:
    """Load each chunk's part of `loaded` (under model_state's names) into it; ValueError naming missing weights."""
    names = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    missing = []
    for name, chunk in zip(names, chunks, strict=True):
        missing += chunk.load_state_dict(loaded[name], strict=False)[0]
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"{source} lacks weights this model needs: {missing[:5]}; was it written for this "
                         "--hf-checkpoint's architecture?")


_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")
"""An optimizer state's key: megatron's optimizer, or one of a ChainedOptimizer's (an MoE model's dense and expert
parameters are stepped by two, keyed chained_0., chained_1., as Megatron-LM saves them)."""


def _check_optimizer_split(backend: MegatronBackend, uri: str, directory: Path) -> None:
    """CheckpointError when the checkpoint's optimizer state is split otherwise than this run's optimizer: megatron
    steps an MoE model's expert parameters with an optimizer of their own under expert parallelism (keys chained_0.,
    chained_1.), with one optimizer without it; dist_checkpointing cannot map one onto the other."""
    saved = any(key.startswith("chained_") for key in tensor_metadata(directory))
    mine = len(getattr(backend.optimizer, "chained_optimizers", ())) > 1
    if saved != mine:
        raise CheckpointError(
            f"{uri} holds the optimizer state {'split over' if saved else 'of'} "
            f"{'a dense and an expert optimizer' if saved else 'one optimizer'}, this run has "
            f"{'two' if mine else 'one'}: resuming across a change of --expert-model-parallel-size is not built. "
            f"Resume at the layout it was saved at, or train on from its weights with --ref-load {uri} and a new --save")


def has_resume_state(ref: CheckpointRef, directory: Path) -> bool:
    """True when the checkpoint holds the Megatron backend's resume state (optimizer shards and extra_state);
    False for a release/ that holds weights only (a converted one); CheckpointError otherwise."""
    has_optimizer = any(_OPTIMIZER_KEY.match(key) for key in tensor_metadata(directory))
    has_extra = (directory / SIDE_DIR / EXTRA_STATE).is_file()
    if has_optimizer and has_extra:
        return True
    if ref.iteration == RELEASE and not has_optimizer and not has_extra:
        return False
    saved_by_torch = (directory / SIDE_DIR / "training_state.pt").is_file()
    why = ("it was saved by the torch backend, whose optimizer state Megatron's optimizer cannot take"
           if saved_by_torch else "its optimizer state or its slimeflow/extra_state.json is missing")
    raise CheckpointError(
        f"{ref.uri} cannot be resumed by --train-backend megatron: {why}. To train on from its weights, pass "
        f"--ref-load {ref.uri} with a new --save; to resume from an earlier checkpoint, move {ref.uri} aside")
