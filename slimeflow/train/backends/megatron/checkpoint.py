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
expert parallelism is split in two (dense and expert parameters); it reshards to another expert-parallel size.
Staging, commit and refusals follow the torch backend's checkpoints (torch/checkpoint.py): a save is staged in
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
from slimeflow.checkpoint.torch_dist import CHECKPOINT_VERSION, read_common, tensor_metadata
from slimeflow.errors import CheckpointError
from slimeflow.io import checkpoints
from slimeflow.io.checkpoints import RELEASE, CheckpointRef, local_root
from slimeflow.io.guard import claimed_dir, staging_prefix
from slimeflow.io.storage import Storage
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
    from collections.abc import Callable

    from slimeflow.train.backends.megatron.backend import MegatronBackend

logger = logging.getLogger(__name__)

SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True,
            "chained_optim_avoid_prefix": True}
"""How the optimizer state is laid out (also saved as the checkpoint's content metadata, which Megatron-LM reads
back). With --use-distributed-optimizer, the data-parallel ranks' shards of the Adam state are gathered on DP rank 0
over gloo, in CPU memory (mem_efficient), and saved per parameter in its shape (`optimizer.state.exp_avg.<key>`, as
without it), so the state reshards to any parallel layout; Megatron-LM's default, dp_reshardable, saves the flat
buffers, resumable at another DP size only. Without it the setting changes nothing. An MoE model under expert
parallelism is stepped by two optimizers (dense and expert parameters), without it by one: their Adam states are
saved under the parameters' keys without the chained_0. / chained_1. prefixes (as Megatron-LM saves them), so they
reshard across a change of --expert-model-parallel-size (_optimizer_across_split). Checkpoints saved with the
prefixes (earlier slimeflow) resume at their own split only; the load reads the checkpoint's own metadata."""


def _sharded_state(backend: MegatronBackend, rollout_id: int | None, is_loading: bool,
                   with_training_state: bool, with_rng: bool = True,
                   sharding: dict[str, Any] | None = None) -> dict[str, Any]:
    """What every rank saves (or declares to load): its model shards, and with the training state its optimizer
    shards (laid out by `sharding`, SHARDING unless given: a load declares the checkpoint's), the schedule and its
    RNG states, under Megatron-LM's top-level names."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict[str, Any] = model_state(backend.modules)
    if with_training_state:
        state["optimizer"] = backend.optimizer.sharded_state_dict(dict(state), is_loading=is_loading,
                                                                  metadata=sharding or SHARDING)
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
                    before_commit: Callable[[], None] | None = None, async_save: bool = False) -> CheckpointRef:
    """Save weights, optimizer, schedule, RNG and `extra_state` as `<root>/iter_{rollout_id:07d}`, then commit it.

    Collective: every rank calls it and writes its shards; rank 0 stages, adds the side files and commits.
    Every rank gets the committed checkpoint, or the error rank 0 met. `before_commit` as in Backend.save_checkpoint.
    First the previous `async_save`'s commit is waited for (its error raised on every rank). With `async_save`,
    every rank writes its shards as without (megatron-core's writer, collective and fsynced: the staged files are
    the snapshot training cannot change); rank 0's BackgroundCommit then adds the side files, hashes every file,
    and renames and commits, while training goes on; the returned reference is committed once `wait_for_save`
    returns.
    """
    from megatron.core import dist_checkpointing

    from slimeflow.train.backends.megatron.shims import in_process_write_results

    extra_json = json.dumps(extra_state)  # fail before writing anything
    wait_for_save(backend, collective=True)
    root_path, name = local_root(root), checkpoints.iteration_dirname(rollout_id)
    with ExitStack() as stack:
        staged = None
        if backend.rank == 0:
            staged = stack.enter_context(claimed_dir(root_path, staging_prefix(name)))
        box = [None if staged is None else str(staged)]
        torch.distributed.broadcast_object_list(box, src=0)
        assert box[0] is not None  # rank 0 broadcasts the directory it claimed
        staged = Path(box[0])
        error = None
        try:
            with backend.on_device(), in_process_write_results():
                dist_checkpointing.save(_sharded_state(backend, rollout_id, False, True), str(staged),
                                        sharded_strategy=("torch_dist", 1), content_metadata=SHARDING)
            torch.distributed.barrier()
            if backend.rank == 0 and async_save:
                # the claim goes with the commit: the staging directory stays claimed until it is moved into place
                claim = stack.pop_all()
                backend.background_commit.start(f"checkpoint {rollout_id} under {root}", lambda: _commit_claimed(
                    claim, root_path, staged, rollout_id, extra_json, before_commit))
            elif backend.rank == 0:
                _commit(root_path, staged, rollout_id, extra_json, before_commit)
        except BaseException as err:
            error = err
            if backend.rank == 0:
                shutil.rmtree(staged, ignore_errors=True)
    raise_on_every_rank(error, backend.rank, backend.world_size,
                        f"rank 0 failed to save checkpoint {rollout_id} under {root}")
    return CheckpointRef(root=str(root), iteration=rollout_id, uri=str(Path(root) / name))


def wait_for_save(backend: MegatronBackend, collective: bool = False) -> None:
    """Until this rank's --async-save commit in flight (rank 0's; none elsewhere) has ended; CheckpointError, from
    its cause, when it failed. `collective`: every rank calls it and every rank raises rank 0's error."""
    wait_for_commit(backend.background_commit, backend.rank, backend.world_size, collective)


def _commit_claimed(claim: ExitStack, root: Path, staged: Path, rollout_id: int, extra_json: str,
                    before_commit: Callable[[], None] | None) -> None:
    """_commit in the background, releasing the staging directory's claim after (removed first, if it failed)."""
    with claim:
        try:
            _commit(root, staged, rollout_id, extra_json, before_commit)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise


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

    from slimeflow.train.backends.megatron.core_settings import fuse_host_adam

    ref = ref_or_uri if isinstance(ref_or_uri, CheckpointRef) else checkpoints.resolve(Storage(), str(ref_or_uri))
    directory = local_root(ref.uri)
    verify_checkpoint(directory)
    resume = not weights_only and has_resume_state(ref, directory)
    sharding = dist_checkpointing.load_content_metadata(str(directory)) or SHARDING
    split_changed = resume and _optimizer_split_changed(backend, ref.uri, directory, sharding)
    with_rng = resume and _same_layout(backend, directory)
    if resume and not with_rng:
        logger.warning("%s was saved at another tensor/pipeline parallel layout: its weights and optimizer state are "
                       "resharded, its per-rank RNG states are not restored (as Megatron-LM)", ref.uri)
    with backend.on_device(), reading(directory):
        declared = _sharded_state(backend, None, True, resume, with_rng, sharding)
        own = _own_values(declared["optimizer"]) if split_changed else None
        loaded = dist_checkpointing.load(declared, str(directory))
        assign(backend.modules, loaded, ref.uri)
        if not resume:
            # --bf16: the optimizer's fp32 main parameters are copies of the model's, as Megatron-LM refreshes
            # them after loading weights only (nothing to do in fp32: the optimizer steps the model's own)
            backend.optimizer.reload_model_params()
            return {}
        optimizer_state = loaded["optimizer"] if own is None else _optimizer_across_split(own, loaded["optimizer"])
        backend.optimizer.load_state_dict(optimizer_state)
        fuse_host_adam(backend.optimizer)  # the loaded param groups carry the flag they were saved with
        backend.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if with_rng:
        from megatron.core import tensor_parallel

        rng = loaded["rng_state"][0]
        set_rng_state(rng)
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
    return read_extra_state(directory)


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


def model_state(chunks: list[Any]) -> dict[str, Any]:
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


def _optimizer_split_changed(backend: MegatronBackend, uri: str, directory: Path, sharding: dict[str, Any]) -> bool:
    """Whether the checkpoint's optimizer state is split otherwise than this run's optimizer: megatron steps an MoE
    model's expert parameters with an optimizer of their own under expert parallelism, all with one without it.
    Their Adam states reshard (saved under the parameters' keys); CheckpointError where they cannot: saved with
    chained_N. prefixes, or with the distributed optimizer (its resharding across the split is not verified)."""
    saved = _chained(read_common(directory).get("optimizer"))
    mine = len(getattr(backend.optimizer, "chained_optimizers", ())) > 1
    if saved == mine:
        return False
    why = None
    if not sharding.get("chained_optim_avoid_prefix", False):
        why = "its optimizer states are saved under chained_0. / chained_1. prefixes (an earlier slimeflow's layout)"
    elif backend.parallel.use_distributed_optimizer:
        why = "with --use-distributed-optimizer that resharding is not built"
    if why is not None:
        raise CheckpointError(
            f"{uri} holds the optimizer state {'split over' if saved else 'of'} "
            f"{'a dense and an expert optimizer' if saved else 'one optimizer'}, this run has "
            f"{'two' if mine else 'one'} (a change of --expert-model-parallel-size): {why}. Resume at the layout it "
            f"was saved at, or train on from its weights with --ref-load {uri} and a new --save")
    return True


def _chained(optimizer_state: Any) -> bool:
    """Whether a (common) optimizer state dict is a ChainedOptimizer's of several optimizers (keyed 0, 1, ...)."""
    return isinstance(optimizer_state, dict) and 0 in optimizer_state


class _Loaded:
    """Marks, in _own_values' copy, where a loaded tensor goes."""


_LOADED = _Loaded()


def _own_values(declared: Any) -> Any:
    """The declared optimizer state's structure with its own non-tensor values (parameter groups), _LOADED where
    a tensor is declared: what this run's optimizer takes, before dist_checkpointing.load fills it."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedBase,
        ShardedTensorFactory,
    )

    if isinstance(declared, dict):
        return {key: _own_values(value) for key, value in declared.items()}
    if isinstance(declared, list):
        return [_own_values(value) for value in declared]
    if isinstance(declared, ShardedBase | ShardedTensorFactory):
        return _LOADED
    return declared.unwrap() if isinstance(declared, LocalNonpersistentObject) else declared


def _optimizer_across_split(own: Any, loaded: Any) -> Any:
    """This run's optimizer state from a checkpoint saved by another split (one optimizer against a dense and an
    expert one): the Adam states loaded under the parameters' keys, this run's own parameter groups (the schedule's
    load sets their lr and weight decay) and the saved Adam step count (the optimizers share one)."""
    steps = list(_values_of(loaded, "common_step"))

    def fill(template: Any, values: Any) -> Any:
        if template is _LOADED:
            return values
        if isinstance(template, dict):
            return {key: fill(value, values.get(key) if isinstance(values, dict) else None)
                    for key, value in template.items()}
        if isinstance(template, list):
            return [fill(value, values[i] if isinstance(values, list) and i < len(values) else None)
                    for i, value in enumerate(template)]
        return template

    state = fill(own, loaded)
    for optimizer in (state.values() if _chained(state) else [state]):
        optimizer["state"].pop("common_step", None)
        if steps:
            optimizer["state"]["common_step"] = steps[0]
    return state


def _values_of(tree: Any, name: str) -> Any:
    """Every value under the key `name` in a nested dict/list."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == name:
                yield value
            else:
                yield from _values_of(value, name)
    elif isinstance(tree, list):
        for value in tree:
            yield from _values_of(value, name)


def has_resume_state(ref: CheckpointRef, directory: Path) -> bool:
    """True when the checkpoint holds the Megatron backend's resume state (optimizer shards and extra_state);
    False for a release/ that holds weights only (a converted one); CheckpointError otherwise."""
    has_optimizer = any(_OPTIMIZER_KEY.match(key) for key in tensor_metadata(directory))
    has_extra = (directory / SIDE_DIR / EXTRA_STATE).is_file()
    if has_optimizer and has_extra:
        return True
    if ref.iteration == RELEASE and not has_optimizer and not has_extra:
        return False
    saved_by_torch = (directory / SIDE_DIR / TRAINING_STATE).is_file()
    why = ("it was saved by the torch backend, whose optimizer state Megatron's optimizer cannot take"
           if saved_by_torch else "its optimizer state or its slimeflow/extra_state.json is missing")
    raise CheckpointError(
        f"{ref.uri} cannot be resumed by --train-backend megatron: {why}. To train on from its weights, pass "
        f"--ref-load {ref.uri} with a new --save; to resume from an earlier checkpoint, move {ref.uri} aside")
