"""Placement on Ray: start (or join) Ray, create the RolloutManager and the TrainActor group, and wrap them so the
loop calls plain methods. Colocated on one machine by default (the engines idle while the trainer works).

On a cluster with GPUs (logical ones too) placement is slime's: one placement group (placement_plan,
placement_group), each TrainActor pinned to its bundle, and the engines Ray actors pinned to theirs, started by the
RolloutManager. On a CPU the actors ask Ray for no CPU (they alternate, and torch's threads are set explicitly, see
`cpu_threads`) and the RolloutManager starts the embedded engines itself. With --async the two compute at once, so
on a CPU the cores are split between the trainer ranks and the engines.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from slimeflow.stages.rl.actors import LoopError, RolloutSetup, TrainActor, call, rollout_manager_class
from slimeflow.stages.rl.config import TrainConfig
from slimeflow.stages.rl.engine_actor import sglang_installed
from slimeflow.stages.rl.placement_group import PlacedGroup, create_placement_group
from slimeflow.stages.rl.placement_plan import plan_placement
from slimeflow.stages.rl.remote import hosted

if TYPE_CHECKING:
    from slimeflow.stages.rl.types import TrainBatch


class RolloutManagerHandle:
    """The loop's view of the RolloutManager actor: blocking calls, the train batch kept as a Ray object."""

    def __init__(self, actor: Any):
        self.actor = actor

    def generate(self, rollout_id: int) -> tuple[Any, dict[str, float], list[list[str]]]:
        batch_ref, metrics_ref, rows_ref = self.actor.generate.options(num_returns=3).remote(rollout_id)
        return batch_ref, call(metrics_ref, f"rollout {rollout_id}"), call(rows_ref, f"rollout {rollout_id}")

    def start_generate(self, rollout_id: int, weight_version: int) -> PendingRollout:
        """Ask for rollout `rollout_id` (with the engines' weights `weight_version`) and return at once."""
        refs = self.actor.generate.options(num_returns=3).remote(rollout_id, weight_version)
        return PendingRollout(rollout_id, *refs)

    def evaluate(self, version: str) -> dict[str, float]:
        return call(self.actor.evaluate.remote(version), f"evaluation with weights {version}")

    def recover_engines(self) -> None:
        call(self.actor.recover_engines.remote(), "checking the rollout engines before a weight push")

    def state_dict(self) -> dict[str, Any]:
        return call(self.actor.state_dict.remote(), "reading the data-source state")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        call(self.actor.load_state_dict.remote(state), "restoring the data-source state")

    def shutdown(self) -> None:
        call(self.actor.shutdown.remote(), "stopping the rollout engines")


@dataclass
class PendingRollout:
    """A rollout being generated (RolloutManagerHandle.start_generate); the train batch stays a Ray object."""

    rollout_id: int
    batch_ref: Any
    metrics_ref: Any
    rows_ref: Any

    def wait(self) -> None:
        """Until the rollout is generated (its errors are raised by `result`)."""
        ray.wait([self.metrics_ref], num_returns=1, fetch_local=False)

    def result(self) -> tuple[Any, dict[str, float], list[list[str]]]:
        what = f"rollout {self.rollout_id}"
        return self.batch_ref, call(self.metrics_ref, what), call(self.rows_ref, what)


class ActorGroup:
    """The TrainActors (one per data-parallel rank), called together."""

    def __init__(self, actors: list[Any], pushes_weights: bool = True, before_push: Callable[[], None] | None = None):
        self.actors = actors
        self.pushes_weights = pushes_weights
        """False with --debug-train-only: there is no engine to push to."""
        self.before_push = before_push
        """With --use-fault-tolerance: RolloutManagerHandle.recover_engines (every engine up before a push)."""

    def _all(self, method: str, *args: Any, what: str) -> list[Any]:
        return call([getattr(a, method).remote(*args) for a in self.actors], what)

    def load(self) -> tuple[int, dict[str, Any]]:
        return self._all("load", what="loading the checkpoint")[0]

    def train(self, rollout_id: int, batch: TrainBatch | Any) -> dict[str, float]:
        return self._all("train", rollout_id, batch, what=f"training on rollout {rollout_id}")[0]

    def save(self, rollout_id: int, extra_state: dict[str, Any]) -> str:
        return self._all("save", rollout_id, extra_state, what=f"saving checkpoint {rollout_id}")[0]

    def update_weights(self, version: int) -> None:
        """Rank 0 pushes the policy (gathered from the ranks' shards, if sharded) to every engine as `version`."""
        if self.pushes_weights:
            if self.before_push is not None:
                self.before_push()
            self._all("update_weights", str(version), what=f"pushing weights {version}")


class NoTrainer:
    """--debug-rollout-only: the actor group's interface with no TrainActor behind it (as slime's actors return at
    once in that mode): nothing loads, trains, saves or pushes weights; the loop starts at --start-rollout-id or 0."""

    def __init__(self, start_rollout_id: int | None):
        self.start_rollout_id = start_rollout_id or 0
        self.actors: list[Any] = []

    def load(self) -> tuple[int, dict[str, Any]]:
        return self.start_rollout_id, {}

    def train(self, rollout_id: int, batch: Any) -> dict[str, float]:
        return {}

    def save(self, rollout_id: int, extra_state: dict[str, Any]) -> None:
        return None

    def update_weights(self, version: int) -> None:
        pass


@dataclass
class Placement:
    """The actors of one training run; `shutdown()` stops the engines and releases the actors."""

    config: TrainConfig
    rollout_manager: RolloutManagerHandle
    actor_group: ActorGroup | NoTrainer
    group: PlacedGroup | None = None
    """The placement group on a GPU cluster (None on a CPU)."""

    def shutdown(self) -> None:
        try:
            self.rollout_manager.shutdown()
        except LoopError:
            pass  # the actor is already gone; nothing left to stop
        for actor in [self.rollout_manager.actor, *self.actor_group.actors]:
            ray.kill(actor)
        if self.group is not None:
            self.group.remove()


LOCAL_RAY_SYSTEM_CONFIG = {
    # Ray runs workers at nice 15 by default; here the actors are the job itself, and at nice 15 training ran
    # 10x slower whenever anything else used the CPU (measured: 3 s vs 0.27 s a step).
    "worker_niceness": 0,
    # Ray's own Prometheus metrics, for a dashboard this cluster does not run: the raylet's wait for its metrics
    # exporter made ray.init take 3.32-3.33 s instead of 2.32-2.33 s (4 runs each). Our metrics go to MLflow.
    "enable_metrics_collection": False,
}
"""The local cluster's Ray system config (a cluster joined by address keeps its own)."""


def init_ray(address: str | None) -> None:
    """Join the Ray cluster at `address` (RAY_ADDRESS style), else start a local one for this process.

    A SIGTERM handler the host installed (Prefect's, which turns a cancellation into a Cancelled run) stays in charge:
    ray.init replaces it with one that calls sys.exit, and a cancelled flow run would be reported Crashed."""
    if ray.is_initialized():
        return
    host_handler = signal.getsignal(signal.SIGTERM)
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # "local": a cluster of its own, even where `ray start` left /tmp/ray/ray_current_cluster, which
        # ray.init() would join (another user's cluster, and then num_cpus is refused). RAY_ADDRESS, read into
        # the run's settings, still wins: it arrives here as `address`.
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=True,
                 configure_logging=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    if callable(host_handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, host_handler)


def create_placement(config: TrainConfig, setup: RolloutSetup, total_steps: int, scratch: Path,
                     run_token: str | None = None) -> Placement:
    """The RolloutManager and `actor_num_nodes x actor_num_gpus_per_node` TrainActors; `run_token` is the run's
    claim on --save (backend.ownership.claim_root), checked before every commit. The debug modes change the cast:
    --debug-rollout-only creates no TrainActor, --debug-train-only replays saved rollouts without an engine."""
    placement = config.placement
    world = placement.actor_num_nodes * placement.actor_num_gpus_per_node
    group = _placement_group(config) if _has_gpus() else None
    # Synchronous: trainers and engines take turns, each may use the machine. Async: they compute at once.
    at_once = world + setup.num_engines if placement.async_ else world
    threads = None if group else cpu_threads(at_once)
    if setup.engine_threads is None:
        engines = setup.num_engines if group else (at_once if placement.async_ else 1)
        setup = replace(setup, engine_threads=cpu_threads(max(1, engines)))
    if group is not None:
        setup = replace(setup, engines_on=group.engine_placement(
            "sglang" if sglang_installed() else "embedded", config.seed, placement.num_gpus_per_node,
            config.sglang.server_args()))
    init_method = (scratch / f"dist-{uuid.uuid4().hex[:8]}").resolve().as_uri() if world > 1 else ""
    manager = ray.remote(num_cpus=0)(hosted(rollout_manager_class(config))).remote(config, setup)
    ranks = 0 if config.debug.debug_rollout_only else world
    pinned = group.trainer_options if group else (lambda rank: {"num_cpus": 0, "num_gpus": 0})
    actors = [ray.remote(hosted(TrainActor)).options(**pinned(rank)).remote(
        config, setup.hf_checkpoint, rank, world, init_method, total_steps, threads, run_token)
        for rank in range(ranks)]
    try:
        targets = call(manager.weight_targets.remote(), "starting the rollout manager (engines)")
        if actors and targets is not None:
            call(actors[0].connect_engines.remote(targets), "connecting the trainer to the engines")
    except LoopError:
        for actor in [manager, *actors]:
            ray.kill(actor)
        if group is not None:
            group.remove()
        raise
    rollouts = RolloutManagerHandle(manager)
    recover = rollouts.recover_engines if config.fault_tolerance.use_fault_tolerance else None
    trainers = ActorGroup(actors, pushes_weights=targets is not None, before_push=recover) if actors else NoTrainer(
        config.checkpoint.start_rollout_id)
    return Placement(config, rollouts, trainers, group)


def _placement_group(config: TrainConfig) -> PlacedGroup:
    """slime's placement group for `config` (the flags were checked at stage start: placement_plan.flag_problems)."""
    external = config.placement.rollout_external_engine_addrs or config.sglang.args.get("worker_urls")
    plan = plan_placement(config.placement, debug_rollout_only=config.debug.debug_rollout_only,
                          debug_train_only=config.debug.debug_train_only, external_engines=bool(external))
    return create_placement_group(plan)


def cpu_threads(processes: int, *, spare: int = 1) -> int:
    """torch threads for each of `processes` computing at once on this machine's CPU, `spare` cores left over.

    Engines and trainers alike keep one core spare for what runs beside their compute (the HTTP servers, the
    rollout manager's event loop, Ray's own processes, other jobs on the machine): a torch thread that waits for a
    core stalls its op's other threads at every barrier. On the demo's loop on a loaded 2-core machine (loop_bench
    --seed 7, 80 steps, two runs each) the train step took a median 0.019 s with 1 thread against 0.16-0.29 s with
    2; its fastest steps were 0.017 s against 0.018-0.019 s, so one thread also loses nothing on a quiet machine
    now that the step's forward runs once per distinct row.
    """
    return max(1, ((os.cpu_count() or 1) - spare) // processes)


def _has_gpus() -> bool:
    return bool(ray.cluster_resources().get("GPU", 0))


def scratch_dir(workdir: Path | None) -> Path:
    base = workdir if workdir is not None else Path(tempfile.gettempdir())
    path = base / ".ray-scratch"
    path.mkdir(parents=True, exist_ok=True)
    return path
