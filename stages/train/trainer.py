"""The work of the TrainActor Ray actor (train_actor.py): one data-parallel rank holding a training backend, its
checkpoints and weight push.

Each rank trains on its share of every global batch; rank 0 pushes the weights to every engine (the RolloutManager
says where they are), versioned: version `k` is the policy that generates rollout `k`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from slimeflow.config.train import TrainConfig
from slimeflow.io.guard import check_owner
from slimeflow.offload import StateOffload
from slimeflow.rollout.slime_plugins import settings_read
from slimeflow.stages.train.engines import WeightTargets
from slimeflow.stages.train.heap import freeze_startup_heap
from slimeflow.stages.train.weight_sync import WeightSync, default_transport
from slimeflow.supervise import parent_gone
from slimeflow.train.backends import Backend, build_backend
from slimeflow.train.backends.checkpoint import resolve_start
from slimeflow.train.train_hooks import TrainHooks, post_write_hook
from slimeflow.train.train_step import train_on_rollout

if TYPE_CHECKING:
    from slimeflow.rollout.types import PackedBatch


logger = logging.getLogger(__name__)

FLAG_TRANSPORTS = {"nccl": "distributed", "disk": "disk", "http": "tensor", "shared_memory": "shared_memory"}
"""--update-weight-transport's values -> weight_sync.TRANSPORTS."""


def ray_node_id() -> str | None:
    """This process's Ray node id (None outside Ray)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class Trainer:
    """One data-parallel rank: a training backend, its checkpoints and its share of every global batch (the work of
    the TrainActor, train_actor.py)."""

    def __init__(self, config: TrainConfig, hf_checkpoint: str, rank: int, world_size: int, init_method: str,
                 total_steps: int, num_threads: int | None = None, run_token: str | None = None,
                 offload_dir: str | None = None):
        """`offload_dir`: where --offload-train writes this rank's state on a CPU (the run's scratch)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.parent_pid = os.getppid()  # under Ray: this node's raylet (see check_may_commit)
        self.run_token = run_token  # the run's claim on --save (see check_may_commit)
        self.hooks = TrainHooks.load(config)  # slime's hooks into its training actor (train_hooks)
        self.backend: Backend = build_backend(config.placement.train_backend, config, hf_checkpoint, rank,
                                              world_size, init_method, total_steps, self.hooks)
        self.state_offload = StateOffload(Path(offload_dir or tempfile.gettempdir()))
        freeze_startup_heap()

    def offload(self) -> dict[str, float]:
        """--offload-train, before a rollout: move this rank's weights, gradients and optimizer state off its device
        (slime's actor sleep) until it next loads, trains, saves or pushes weights; what it moved and the resident
        memory it gave back, as metrics (none when it was offloaded already)."""
        if self.state_offload.offloaded:
            return {}
        return self.state_offload.offload(self.backend.state_tensors()).metrics("offload/train")

    def _onload(self) -> None:
        """Bring the offloaded state back, bit for bit, before anything reads it (a no-op when none is offloaded)."""
        self.state_offload.onload()

    def load(self) -> tuple[int, dict[str, Any]]:
        """slime's start: the latest checkpoint of --load, else --ref-load's weights, else the HF weights.
        Returns (the first rollout id to run, the saved extra state: data position, ...)."""
        ckpt = self.config.checkpoint
        self._onload()
        start = resolve_start(ckpt.load, ckpt.ref_load)
        extra = self.backend.load_checkpoint(start.ref, start.weights_only) if start.ref is not None else {}
        first = extra["rollout_id"] + 1 if "rollout_id" in extra else 0
        return (ckpt.start_rollout_id if ckpt.start_rollout_id is not None else first), extra

    def train(self, rollout_id: int, batch: PackedBatch) -> dict[str, float]:
        self._onload()
        return train_on_rollout(self.backend, batch.unpack(), self.config, rank=self.backend.dp_rank,
                                world_size=self.backend.dp_size, rollout_id=rollout_id, hooks=self.hooks)

    def connect_engines(self, targets: WeightTargets) -> dict[str, str]:
        """Make this rank the one that pushes weights to the engines of `targets` (rank 0; ranks are identical).
        Returns the transport chosen and why (logged here, and by the driver)."""
        sync = self.config.weight_sync
        node_id = ray_node_id()
        flag = sync.update_weight_transport
        if flag is None:  # weight_sync.default_transport: in place on the trainer's host, as slime's colocated push
            transport, why = default_transport(targets, self.config.placement.colocate, node_id)
        else:
            transport, why = FLAG_TRANSPORTS[flag], f"--update-weight-transport {flag}"
        self.weight_sync = WeightSync(targets, sync.update_weight_buffer_size, transport,
                                      post_write=post_write_hook(self.config, self.hooks.args, targets),
                                      tp_size=self.config.placement.rollout_num_gpus_per_engine, node_id=node_id,
                                      fallback="tensor" if flag is None and transport == "shared_memory" else None)
        logger.info("weight sync: %s (%s)", transport, why)
        self.pushed: tuple[str, dict[str, Any]] | None = None
        """With --use-fault-tolerance: the version and a host copy of the weights last pushed, for push_to."""
        self.loop = asyncio.new_event_loop()
        return {"transport": transport, "reason": why}

    def update_weights(self, version: str, restarted: list[str] | None = None) -> str:
        """Push the current weights to every engine as `version` (rank 0, after connect_engines); returns the
        version. Every rank calls it: the Megatron backend gathers its TP/PP shards onto rank 0 first. `restarted`:
        engines restarted since the last push (fault tolerance), which the push regroups first."""
        self._onload()
        weights = self.backend.named_weights()
        if self.rank != 0:
            return version
        if restarted:
            self.loop.run_until_complete(self.weight_sync.regroup())
        pushed = self.loop.run_until_complete(self.weight_sync.push(weights, version))
        if self.config.fault_tolerance.use_fault_tolerance:
            # Copied: training changes the weights in place before the rollout of `version` has ended.
            self.pushed = (version, {name: t.detach().to("cpu", copy=True) for name, t in weights.items()})
        if self.config.placement.offload_rollout:
            # The engines release their weights before the next push: with no mapping of this rank's the segment's
            # memory goes with them (the next push writes new files, a small cost beside their reload from disk).
            self.weight_sync.drop_segment()
        return pushed

    def push_to(self, urls: list[str], version: str) -> str:
        """--use-fault-tolerance, rank 0: give the restarted engines at `urls` the weights last pushed, as `version`,
        through the transport in use (the distributed one in a group of their own, closed after). Raises when the
        last push was another version."""
        if self.pushed is None or self.pushed[0] != version:
            last = "none" if self.pushed is None else f"version {self.pushed[0]}"
            raise RuntimeError(f"a restarted engine needs weight version {version}, but trainer rank 0 last pushed "
                               f"{last}")
        weights = self.pushed[1]
        main = self.weight_sync
        nodes = dict(zip(main.targets.worker_urls, main.targets.node_ids, strict=False))  # empty when not known
        targets = dataclasses.replace(main.targets, worker_urls=tuple(urls),
                                      node_ids=tuple(nodes[u] for u in urls) if all(u in nodes for u in urls) else ())
        sync = WeightSync(targets, main.buffer_size, main.transport, tp_size=main.tp_size, node_id=main.node_id)

        async def push() -> str:
            try:
                return await sync.push(weights, version)
            finally:
                await sync.aclose()

        return self.loop.run_until_complete(push())

    def plugin_settings_read(self) -> list[str]:
        """The `args` attributes this rank's plug-ins read (slime_plugins.settings_read)."""
        return settings_read()

    def save(self, rollout_id: int, extra_state: dict[str, Any]) -> str:
        save = self.config.checkpoint.save
        if save is None:  # the loop saves only with --save
            raise ValueError(f"rollout {rollout_id}: the trainer was asked to save a checkpoint, but --save is not set")
        self._onload()
        ref = self.backend.save_checkpoint(save, rollout_id, {**extra_state, "rollout_id": rollout_id},
                                           before_commit=self.check_may_commit,
                                           async_save=self.config.checkpoint.async_save)
        return ref.uri

    def wait_for_save(self) -> None:
        """Until this rank's --async-save commit in flight has ended (its error raised)."""
        self.backend.wait_for_save()

    def check_may_commit(self) -> None:
        """Refuse to commit a checkpoint once this actor's job is gone or another run has claimed --save.

        Ray gives each actor a process group of its own, so a job killed with SIGKILL takes its actors down only
        when they notice their raylet's death, a second or more later; a save in flight could commit in that time,
        into a checkpoint root that a restarted run may already be resuming from. On one machine the raylet's death
        shows at once (this process's parent changes); on a cluster, where a driver can die while the raylets live,
        the restarted run's claim on the root does (io.guard.claim_root).
        """
        if parent_gone(self.parent_pid):
            raise RuntimeError(f"not committing the checkpoint: this TrainActor's parent process {self.parent_pid} "
                               "(its Ray node) has exited, so the job that asked for the save is gone")
        if self.run_token is not None:
            check_owner(self.config.checkpoint.save, self.run_token)

