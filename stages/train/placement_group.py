"""The placement plan made real on Ray: one placement group of one-GPU bundles, its bundles ordered by (node, GPU)
as slime orders them, and the Ray options that pin a trainer rank or an engine to its bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slimeflow.stages.train.engine_actor import EngineSpec, start_engine_actors
from slimeflow.stages.train.placement_plan import BundleLocation, PlacementPlan, bind_slots, engine_problems

PLACEMENT_GROUP_TIMEOUT_S = 300.0
"""How long to wait for Ray to find the GPUs of the group (slime waits without limit; we say what is missing)."""
TRAINER_GPU_SHARE = 0.4
"""What a TrainActor asks of its bundle's GPU (slime's figure): with --colocate an engine (0.2) shares it."""


@ray.remote(num_cpus=0, num_gpus=1)
def _bundle_location() -> tuple[str, int, str]:
    return ray.util.get_node_ip_address(), int(ray.get_gpu_ids()[0]), ray.get_runtime_context().get_node_id()


@dataclass
class EnginePlacement:
    """Where the RolloutManager starts its engines (picklable, for the actor): the group, each engine's bundle and
    first GPU id, and how the engines are launched."""

    placement_group: Any
    bundles: tuple[int, ...]
    base_gpu_ids: tuple[int, ...]
    num_gpus_per_engine: int
    num_gpus_per_node: int
    kind: str
    """"sglang" or "embedded" (engine_actor.EngineSpec)."""
    seed: int
    server_args: dict[str, Any]
    memory_saver: bool = False
    """SGLang's --enable-memory-saver, which slimeflow sets for --offload-rollout (as slime)."""

    def start(self, model_path: str, api_key: str, num_threads: int | None) -> list[Any]:
        """An EngineActor per engine, starting (engine_actor.PlacedEngine handles)."""
        specs = [EngineSpec(self.kind, model_path, rank, self.num_gpus_per_engine, base,
                            self.seed + rank * self.num_gpus_per_node, self.server_args, num_threads, api_key,
                            self.memory_saver)
                 for rank, base in enumerate(self.base_gpu_ids)]
        return start_engine_actors(specs, list(self.bundles), self.placement_group)


@dataclass
class PlacedGroup:
    """A created placement group: `slots[k]` is the bundle of logical slot k of `plan`."""

    plan: PlacementPlan
    group: Any
    slots: list[BundleLocation]

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """Ray actor options that pin trainer `rank` to its bundle."""
        bundle = self.slots[self.plan.trainer_slots[rank]].bundle_index
        return {"num_cpus": 0, "num_gpus": TRAINER_GPU_SHARE,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                                        placement_group_bundle_index=bundle)}

    def engine_placement(self, kind: str, seed: int, num_gpus_per_node: int,
                         server_args: dict[str, Any], memory_saver: bool = False) -> EnginePlacement:
        first = [self.slots[engine.first_slot] for engine in self.plan.engines]
        per_engine = self.plan.engines[0].num_gpus if self.plan.engines else 1
        return EnginePlacement(self.group, tuple(loc.bundle_index for loc in first), tuple(loc.gpu_id for loc in first),
                               per_engine, num_gpus_per_node, kind, seed, dict(server_args), memory_saver)

    def remove(self) -> None:
        remove_placement_group(self.group)


def create_placement_group(plan: PlacementPlan, timeout_s: float = PLACEMENT_GROUP_TIMEOUT_S) -> PlacedGroup:
    """Reserve `plan.num_bundles` one-GPU bundles (PACK: as few nodes as possible), find the node and GPU of each
    and order them as slime does. Raises RuntimeError when Ray cannot place them in `timeout_s`, or when an engine's
    GPUs are not consecutive GPUs of one node; the group is removed then."""
    # GPU only: slime's bundles hold a CPU each too, which a node with fewer cores than GPUs (or a CPU machine's
    # logical GPUs) cannot give; our actors ask for no CPU.
    group = placement_group([{"GPU": 1} for _ in range(plan.num_bundles)], strategy="PACK")
    try:
        if not ray.wait([group.ready()], timeout=timeout_s)[0]:
            total, free = ray.cluster_resources().get("GPU", 0), ray.available_resources().get("GPU", 0)
            raise RuntimeError(f"Ray could not reserve {plan.num_bundles} GPUs (trainers and engines of the placement "
                               f"flags) within {timeout_s:.0f} s: the cluster has {total:g} GPUs, {free:g} free; lower "
                               "--actor-num-gpus-per-node / --rollout-num-gpus, or add nodes")
        found = ray.get([_bundle_location.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index)).remote() for index in range(plan.num_bundles)])
        slots = bind_slots([BundleLocation(index, ip, gpu, node) for index, (ip, gpu, node) in enumerate(found)])
        problems = engine_problems(plan, slots)
        if problems:
            raise RuntimeError("the placement group cannot hold the engines: " + "; ".join(problems))
    except BaseException:
        remove_placement_group(group)
        raise
    return PlacedGroup(plan, group, slots)
