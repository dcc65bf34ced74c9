"""The training backends by --train-backend name, each behind the one `Backend` protocol.

A spec says where a backend's class lives (imported only when a rank builds it: the torch backend pulls in torch and
transformers, the Megatron one megatron-core), what the driver checks before a run starts and whether a single rank
needs a process group. The driver imports this package to read the specs, so it imports no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from slimeflow.config.train import TrainConfig
from slimeflow.train.backends.megatron.preflight import megatron_backend_problems
from slimeflow.train.backends.protocol import Backend, RankArgs

if TYPE_CHECKING:
    from slimeflow.train.train_hooks import TrainHooks

__all__ = ["BACKENDS", "Backend", "BackendSpec", "RankArgs", "backend_spec", "build_backend", "rank_args"]


@dataclass(frozen=True)
class BackendSpec:
    """One --train-backend."""

    backend: str
    """`module:Class` of the backend, imported when a rank builds it."""
    preflight: Callable[[TrainConfig], list[str]] | None = None
    """What keeps a run from starting with this backend, checked by the driver before anything starts."""
    always_distributed: bool = False
    """Whether even one rank needs a process group (megatron-core keeps its parallel state in process groups)."""


BACKENDS: dict[str, BackendSpec] = {
    "torch": BackendSpec("slimeflow.train.backends.torch.backend:TorchBackend"),
    "megatron": BackendSpec("slimeflow.train.backends.megatron.backend:MegatronBackend",
                            preflight=megatron_backend_problems, always_distributed=True),
}


def backend_spec(name: str) -> BackendSpec:
    """The spec of --train-backend `name`; ValueError naming the known ones otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"--train-backend {name!r} is not a training backend; use one of {sorted(BACKENDS)}") from None


def backend_class(name: str) -> type[Backend]:
    """The class of --train-backend `name`, imported now."""
    module, _, attribute = backend_spec(name).backend.partition(":")
    return cast("type[Backend]", getattr(importlib.import_module(module), attribute))


def rank_args(config: TrainConfig, rank: int, world_size: int, init_method: str | None,
              total_steps: int) -> RankArgs:
    """What every backend's constructor takes from `config` and the rank's place in the world."""
    # Imported here, in the rank: slime's compat namespace imports torch, and the driver imports this package.
    from slimeflow.rollout.slime_plugins import slime_args

    return RankArgs(optimizer=config.optimizer, algorithm=config.algorithm, batch=config.batch, seed=config.seed,
                    rank=rank, world_size=world_size, init_method=init_method or None, total_steps=total_steps,
                    ref_load=config.checkpoint.ref_load, temperature=config.rollout.rollout_temperature,
                    plugin_args=slime_args(config) if config.algorithm.custom_tis_function_path else None)


def build_backend(name: str, config: TrainConfig, hf_checkpoint: str, rank: int, world_size: int,
                  init_method: str | None, total_steps: int, hooks: TrainHooks | None = None) -> Backend:
    """Rank `rank`'s backend of --train-backend `name` for the run `config`, nothing loaded yet (the train actor
    loads the start checkpoint through `Backend.load_checkpoint`)."""
    args = rank_args(config, rank, world_size, init_method, total_steps)
    return backend_class(name).build(config, hf_checkpoint, args, hooks)
