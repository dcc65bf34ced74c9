"""The RolloutManager Ray actor: the buffered data source, the rollout engines and the rollout function.

It owns the engines (embedded engines started here, with the real sglang-router in front of two or more, or external
SGLang servers named by --sglang-worker-urls / --sglang-router-ip/port) and returns the train batch as a Ray object
that the TrainActors read directly. Weights go from trainer rank 0 straight to every engine (the RolloutManager only
says where they are), versioned: version `k` is the policy that generates rollout `k`.

The driver imports this module only to create the actors, so the classes here are shells: their work is in
rollouts.py (which imports torch, transformers and the rollout function), imported inside each actor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slimeflow.config.train import TrainConfig
from slimeflow.stages.train.engines import EngineLaunch, EngineSet, WeightTargets

if TYPE_CHECKING:
    from slimeflow.rollout.types import PackedBatch
    from slimeflow.stages.train.placement_group import EnginePlacement
    from slimeflow.stages.train.rollouts import ReplayRollouts, Rollouts


@dataclass(frozen=True)
class RolloutSetup:
    """What the RolloutManager is built from besides the train config."""

    hf_checkpoint: str
    prompt_data: str | None
    """None when a --debug-train-only run replays saved rollouts instead."""
    eval_prompt_data: dict[str, str]
    num_engines: int = 1
    engine_threads: int | None = None
    concurrency: int = 512
    """Samples in flight at once (slime's --sglang-server-concurrency default)."""
    engines_on: EnginePlacement | None = None
    """On a GPU cluster: the placement-group bundles the engines run on, as Ray actors (else started here)."""

    def launch_engines(self, config: TrainConfig) -> EngineLaunch:
        """Start the run's engines without waiting for them (EngineSet.launch; `ready()` waits)."""
        return EngineSet.launch(self.hf_checkpoint, config.sglang.args, self.num_engines, self.engine_threads,
                                in_process=config.placement.engine_in_process, placed=self.engines_on,
                                router_args=config.sglang.router,
                                external_addrs=config.placement.rollout_external_engine_addrs)


class RolloutManager:
    """Data source + buffer, engines (and router), rewards and the rollout function, in one Ray actor: each method
    is rollouts.Rollouts'."""

    def __init__(self, config: TrainConfig, setup: RolloutSetup):
        # The engines import and load (seconds) while this actor imports and sets up the rest.
        launching = setup.launch_engines(config)
        try:
            # Imported here, in the actor: the driver imports this module and stays free of torch.
            from slimeflow.stages.train.rollouts import Rollouts
        except BaseException:
            launching.cancel()
            raise
        self.rollouts: Rollouts = Rollouts(config, setup, launching)

    def generate(self, rollout_id: int, weight_version: int | None = None
                 ) -> tuple[PackedBatch, dict[str, float], list[list[str]]]:
        """Rollout `rollout_id` with the weights of `weight_version`: (train batch, metrics, row ids per group)."""
        return self.rollouts.generate(rollout_id, weight_version)

    def evaluate(self, version: str | None) -> dict[str, float]:
        return self.rollouts.evaluate(version)

    def recover_engines(self) -> list[str]:
        return self.rollouts.recover_engines()

    def connect_trainer(self, trainer: Any) -> None:
        self.rollouts.connect_trainer(trainer)

    def release_memory(self, tags: list[str] | None = None) -> dict[str, float]:
        return self.rollouts.release_memory(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.rollouts.resume_memory(tags)

    def weight_targets(self) -> WeightTargets:
        return self.rollouts.weight_targets()

    def engine_locations(self) -> dict[str, Any]:
        return self.rollouts.engine_locations()

    def state_dict(self, trained: int | None = None) -> dict[str, Any]:
        return self.rollouts.state_dict(trained)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rollouts.load_state_dict(state)

    def plugin_settings_read(self) -> list[str]:
        return self.rollouts.plugin_settings_read()

    def shutdown(self) -> None:
        self.rollouts.shutdown()


class ReplayRolloutManager:
    """--debug-train-only: the RolloutManager's interface with no engine, over rollouts saved by
    --save-debug-rollout-data or made by a rollout function that needs none; each method is rollouts.ReplayRollouts'."""

    def __init__(self, config: TrainConfig, setup: RolloutSetup):
        # Imported here, in the actor: the driver imports this module and stays free of torch.
        from slimeflow.stages.train.rollouts import ReplayRollouts

        self.rollouts: ReplayRollouts = ReplayRollouts(config, setup)

    def generate(self, rollout_id: int) -> tuple[PackedBatch, dict[str, float], list[list[str]]]:
        return self.rollouts.generate(rollout_id)

    def evaluate(self, version: str | None) -> dict[str, float]:
        return self.rollouts.evaluate(version)

    def weight_targets(self) -> WeightTargets | None:
        return self.rollouts.weight_targets()

    def state_dict(self, trained: int | None = None) -> dict[str, Any]:
        return self.rollouts.state_dict(trained)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rollouts.load_state_dict(state)

    def plugin_settings_read(self) -> list[str]:
        return self.rollouts.plugin_settings_read()

    def shutdown(self) -> None:
        self.rollouts.shutdown()


def rollout_manager_class(config: TrainConfig) -> type:
    """What serves the loop's rollouts: with --debug-train-only no engine (saved rollouts, or a rollout function's
    that needs none), else engines."""
    return ReplayRolloutManager if config.debug.debug_train_only else RolloutManager
