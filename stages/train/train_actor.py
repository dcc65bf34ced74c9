"""The TrainActor Ray actor: one data-parallel rank holding a training backend, its checkpoints and weight push.

Each rank trains on its share of every global batch; rank 0 pushes the weights to every engine (the RolloutManager
says where they are), versioned: version `k` is the policy that generates rollout `k`.

The driver imports this module only to create the actors, so TrainActor is a shell: its work is trainer.Trainer's
(which imports torch and the backends), imported inside each actor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slimeflow.config.train import TrainConfig
from slimeflow.stages.train.engines import WeightTargets

if TYPE_CHECKING:
    from slimeflow.rollout.types import PackedBatch
    from slimeflow.stages.train.trainer import Trainer


class TrainActor:
    """One data-parallel rank: a training backend, its checkpoints and its share of every global batch; each method
    is trainer.Trainer's."""

    def __init__(self, config: TrainConfig, hf_checkpoint: str, rank: int, world_size: int, init_method: str,
                 total_steps: int, num_threads: int | None = None, run_token: str | None = None,
                 offload_dir: str | None = None):
        """`offload_dir`: where --offload-train writes this rank's state on a CPU (the run's scratch)."""
        # Imported here, in the actor: the driver imports this module and stays free of torch.
        from slimeflow.stages.train.trainer import Trainer

        self.trainer: Trainer = Trainer(config, hf_checkpoint, rank, world_size, init_method, total_steps,
                                        num_threads, run_token, offload_dir)

    def offload(self) -> dict[str, float]:
        return self.trainer.offload()

    def load(self) -> tuple[int, dict[str, Any]]:
        return self.trainer.load()

    def train(self, rollout_id: int, batch: PackedBatch) -> dict[str, float]:
        return self.trainer.train(rollout_id, batch)

    def connect_engines(self, targets: WeightTargets) -> dict[str, str]:
        return self.trainer.connect_engines(targets)

    def update_weights(self, version: str, restarted: list[str] | None = None) -> str:
        return self.trainer.update_weights(version, restarted)

    def push_to(self, urls: list[str], version: str) -> str:
        return self.trainer.push_to(urls, version)

    def save(self, rollout_id: int, extra_state: dict[str, Any]) -> str:
        return self.trainer.save(rollout_id, extra_state)

    def wait_for_save(self) -> None:
        self.trainer.wait_for_save()

    def plugin_settings_read(self) -> list[str]:
        return self.trainer.plugin_settings_read()
