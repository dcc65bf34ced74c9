"""Placement on Ray: start (or join) Ray, create the RolloutManager and the TrainActor group, and wrap them so the
loop calls plain methods. Colocated on one machine by default (the engines idle while the trainer works).

On a cluster with GPUs (logical ones too) placement is slime's: one placement group (placement_plan,
placement_group), each TrainActor pinned to its bundle, and the engines Ray actors pinned to theirs, started by the
RolloutManager. On a CPU the actors ask Ray for no CPU (they alternate, and torch's threads are set explicitly, see
`cpu_threads`) and the RolloutManager starts the embedded engines itself. With --async the two compute at once, so
on a CPU the cores are split between the trainer ranks and the engines.

A synchronous run on a CPU (no --async, no --use-fault-tolerance) hosts the RolloutManager in trainer rank 0's
process (`rank_zero_class`): the two take turns anyway, and each Ray actor process pays 5-7 CPU s of imports
(torch, transformers) before its first call, which a 2-core machine feels on every run.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from slimeflow.cluster import cpu_threads, has_gpus
from slimeflow.config.train import TrainConfig
from slimeflow.stages.train.engine_actor import sglang_installed
from slimeflow.stages.train.loop import Timer, should_push
from slimeflow.stages.train.placement_group import PlacedGroup, create_placement_group
from slimeflow.stages.train.placement_plan import plan_placement, sglang_weight_problems
from slimeflow.stages.train.remote import LoopError, call, hosted
from slimeflow.stages.train.rollout_manager import RolloutSetup, rollout_manager_class
from slimeflow.stages.train.train_actor import TrainActor
from slimeflow.train.backends import backend_spec

logger = logging.getLogger(__name__)

COMMIT_GRACE_S = 4.0
"""How long a stopping run (SIGTERM, an error) lets an --async-save commit in flight end before its trainers are
killed; within the driver's own stop deadline (cli.STOP_DEADLINE_S). A commit killed midway commits nothing."""

if TYPE_CHECKING:
    from slimeflow.rollout.types import TrainBatch


class Colocation:
    """Who holds the shared devices (--offload-train, --offload-rollout), as slime's train.py hands them over.

    A rollout or an evaluation runs with the trainer's state offloaded and the engines' memory resumed; training
    with the engines' weights and KV cache released (only the KV cache when no weight push follows the rollout:
    between pushes, with --update-weights-interval N, the engines must keep serving the weights they have); a
    weight push with the engines' weights resumed first. The trainer brings its own state back when it next needs
    it (TrainActor.offload). What each hand-over freed is reported with the rollout's metrics.
    """

    def __init__(self, manager: Any, trainers: list[Any], offload_train: bool, offload_rollout: bool,
                 update_weights_interval: int):
        self.manager, self.trainers = manager, trainers
        self.offload_train, self.offload_rollout = offload_train, offload_rollout
        self.interval = update_weights_interval
        self.metrics: dict[str, float] = {}
        self.timer = Timer()

    def for_rollout(self) -> None:
        with self.timer("handover_to_rollout"):
            if self.offload_train and self.trainers:
                self.metrics.update(call([a.offload.remote() for a in self.trainers], "offloading the trainer")[0])
            if self.offload_rollout:
                call(self.manager.resume_memory.remote(), "resuming the engines' memory")

    def for_training(self, rollout_id: int) -> None:
        if self.offload_rollout:
            tags = None if should_push(self.interval, rollout_id) else ["kv_cache"]
            with self.timer("handover_to_train"):
                self.metrics.update(call(self.manager.release_memory.remote(tags), "releasing the engines' memory"))

    def for_weight_push(self) -> None:
        if self.offload_rollout:
            call(self.manager.resume_memory.remote(["weights"]), "resuming the engines' weights")

    def take_metrics(self) -> dict[str, float]:
        """What the hand-overs since the last call freed, and their seconds (time/handover_*, inside time/generate)."""
        metrics, self.metrics = {**self.metrics, **self.timer.seconds}, {}
        self.timer = Timer()
        return metrics


class RolloutManagerHandle:
    """The loop's view of the RolloutManager actor: blocking calls, the train batch kept as a Ray object."""

    def __init__(self, actor: Any, colocation: Colocation | None = None):
        self.actor = actor
        self.colocation = colocation

    def generate(self, rollout_id: int) -> tuple[Any, dict[str, float], list[list[str]]]:
        if self.colocation is not None:
            self.colocation.for_rollout()
        batch_ref, metrics_ref, rows_ref = self.actor.generate.options(num_returns=3).remote(rollout_id)
        metrics, rows = call(metrics_ref, f"rollout {rollout_id}"), call(rows_ref, f"rollout {rollout_id}")
        if self.colocation is not None:
            self.colocation.for_training(rollout_id)
            metrics = {**metrics, **self.colocation.take_metrics()}
        return batch_ref, metrics, rows

    def start_generate(self, rollout_id: int, weight_version: int) -> PendingRollout:
        """Ask for rollout `rollout_id` (with the engines' weights `weight_version`) and return at once."""
        refs = self.actor.generate.options(num_returns=3).remote(rollout_id, weight_version)
        return PendingRollout(rollout_id, *refs)

    def evaluate(self, version: str) -> dict[str, float]:
        if self.colocation is not None:
            self.colocation.for_rollout()
        return call(self.actor.evaluate.remote(version), f"evaluation with weights {version}")

    def recover_engines(self) -> list[str]:
        """Restart an engine lost since the last rollout; the URLs of those restarted since the last push."""
        return call(self.actor.recover_engines.remote(), "checking the rollout engines before a weight push")

    def state_dict(self, trained: int | None = None) -> dict[str, Any]:
        """The data-source state to save after rollout `trained` (with --async, the rollouts generated past it)."""
        return call(self.actor.state_dict.remote(trained), "reading the data-source state")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        call(self.actor.load_state_dict.remote(state), "restoring the data-source state")

    def plugin_settings_read(self) -> list[str]:
        return call(self.actor.plugin_settings_read.remote(), "asking which plug-in settings were read")

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

    def __init__(self, actors: list[Any], pushes_weights: bool = True, colocation: Colocation | None = None,
                 before_push: Callable[[], list[str]] | None = None):
        self.actors = actors
        self.pushes_weights = pushes_weights
        """False with --debug-train-only: there is no engine to push to."""
        self.colocation = colocation
        self.before_push = before_push
        """With --use-fault-tolerance: RolloutManagerHandle.recover_engines (every engine up before a push; the
        restarted ones are regrouped by the push)."""

    def _all(self, method: str, *args: Any, what: str) -> list[Any]:
        return call([getattr(a, method).remote(*args) for a in self.actors], what)

    def load(self) -> tuple[int, dict[str, Any]]:
        return self._all("load", what="loading the checkpoint")[0]

    def train(self, rollout_id: int, batch: TrainBatch | Any) -> dict[str, float]:
        return self._all("train", rollout_id, batch, what=f"training on rollout {rollout_id}")[0]

    def save(self, rollout_id: int, extra_state: dict[str, Any]) -> str:
        return self._all("save", rollout_id, extra_state, what=f"saving checkpoint {rollout_id}")[0]

    def wait_for_save(self, timeout: float | None = None) -> bool:
        """Until every rank's --async-save commit in flight has ended (a LoopError when one failed); False when
        `timeout` seconds passed first (the commit goes on)."""
        refs = [a.wait_for_save.remote() for a in self.actors]
        if timeout is not None and len(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0]) < len(refs):
            return False
        call(refs, "committing the last checkpoint (--async-save)")
        return True

    def plugin_settings_read(self) -> list[str]:
        return sorted({name for names in self._all("plugin_settings_read", what="asking which plug-in settings "
                                                   "were read") for name in names})

    def update_weights(self, version: int) -> None:
        """Rank 0 pushes the policy (gathered from the ranks' shards, if sharded) to every engine as `version`."""
        if self.pushes_weights:
            if self.colocation is not None:
                self.colocation.for_weight_push()
            # after the engines took their memory back (colocated)
            restarted = self.before_push() if self.before_push is not None else []
            self._all("update_weights", str(version), restarted, what=f"pushing weights {version}")


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

    def wait_for_save(self, timeout: float | None = None) -> bool:
        return True

    def update_weights(self, version: int) -> None:
        pass

    def plugin_settings_read(self) -> list[str]:
        return []


@dataclass
class Placement:
    """The actors of one training run; `shutdown()` stops the engines and releases the actors."""

    config: TrainConfig
    rollout_manager: RolloutManagerHandle
    actor_group: ActorGroup | NoTrainer
    group: PlacedGroup | None = None
    """The placement group on a GPU cluster (None on a CPU)."""

    def unused_settings(self) -> list[str]:
        """The --custom-config-path settings (keys that are not flags) no plug-in of the run has read so far."""
        custom = self.config.custom_args
        if not custom:
            return []
        read = {*self.rollout_manager.plugin_settings_read(), *self.actor_group.plugin_settings_read()}
        return sorted(set(custom) - read)

    def shutdown(self) -> None:
        if self.config.checkpoint.async_save:
            self._let_commit_end()
        try:
            self.rollout_manager.shutdown()
        except LoopError:
            pass  # the actor is already gone; nothing left to stop
        _kill([self.rollout_manager.actor, *self.actor_group.actors])
        if self.group is not None:
            self.group.remove()

    def _let_commit_end(self) -> None:
        """A run stopped midway (SIGTERM, an error) lets an --async-save commit in flight end, for up to
        COMMIT_GRACE_S, before its trainers are killed: either way the tracker names a complete checkpoint."""
        try:
            if not self.actor_group.wait_for_save(timeout=COMMIT_GRACE_S):
                logger.warning("the checkpoint commit in flight (--async-save) did not end within %.0f s and is "
                               "abandoned: the run resumes from the previous checkpoint", COMMIT_GRACE_S)
        except LoopError as err:
            logger.warning("%s; the run resumes from the previous checkpoint", err)


class Facet:
    """One role (the RolloutManager's or trainer rank 0's) of the actor that hosts both (`rank_zero_class`): its
    methods are the host's with the role's prefix, so `facet.generate.remote(...)` is `host.manager_generate`."""

    def __init__(self, host: Any, prefix: str):
        self.host, self.prefix = host, prefix

    def __getattr__(self, name: str) -> Any:
        return getattr(self.host, name if name.startswith("__") else self.prefix + name)


def rank_zero_class(manager_cls: type, trainer_cls: type) -> type:
    """An actor class hosting a RolloutManager (`manager_cls`) and trainer rank 0 (`trainer_cls`) in one process,
    both already `hosted`: each keeps its own start failure, and each method raises what the role's own would.
    The manager is built first (its engines load while it sets up), then the trainer."""

    def __init__(self: Any, manager_args: tuple, trainer_args: tuple) -> None:
        self.manager = manager_cls(*manager_args)
        self.trainer = trainer_cls(*trainer_args)

    def delegate(role: str, name: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(getattr(self, role), name)(*args, **kwargs)

        method.__name__ = method.__qualname__ = f"{role}_{name}"
        return method

    methods: dict[str, Any] = {"__init__": __init__, "__module__": __name__,
                               "__doc__": f"{manager_cls.__name__} and {trainer_cls.__name__} rank 0 in one process."}
    for role, cls in (("manager", manager_cls), ("trainer", trainer_cls)):
        for name, member in vars(cls).items():
            if callable(member) and not name.startswith("_"):
                methods[f"{role}_{name}"] = delegate(role, name)
    return type("RankZero", (), methods)


def shares_rank_zero(config: TrainConfig, on_gpus: bool, ranks: int) -> bool:
    """Whether the RolloutManager runs in trainer rank 0's process: on a CPU, with a trainer, when the two never
    compute at once (no --async) and the manager never calls the trainer (--use-fault-tolerance pushes weights to a
    restarted engine from inside a rollout)."""
    return (not on_gpus and ranks > 0 and not config.placement.async_
            and not config.fault_tolerance.use_fault_tolerance)


def _kill(actors: list[Any]) -> None:
    for handle in dict.fromkeys(a.host if isinstance(a, Facet) else a for a in actors):
        ray.kill(handle)


def create_placement(config: TrainConfig, setup: RolloutSetup, total_steps: int, scratch: Path,
                     run_token: str | None = None) -> Placement:
    """The RolloutManager and `actor_num_nodes x actor_num_gpus_per_node` TrainActors; `run_token` is the run's
    claim on --save (io.guard.claim_root), checked before every commit. The debug modes change the cast:
    --debug-rollout-only creates no TrainActor, --debug-train-only replays saved rollouts without an engine."""
    placement = config.placement
    world = placement.actor_num_nodes * placement.actor_num_gpus_per_node
    group = _placement_group(config) if has_gpus() else None
    # Synchronous: trainers and engines take turns, each may use the machine. Async: they compute at once.
    at_once = world + setup.num_engines if placement.async_ else world
    threads = None if group else cpu_threads(at_once)
    if setup.engine_threads is None:
        engines = setup.num_engines if group else (at_once if placement.async_ else 1)
        setup = replace(setup, engine_threads=cpu_threads(max(1, engines)))
    # SGLang servers on a GPU cluster's placement group where SGLang is installed; the embedded engine otherwise.
    kind = "sglang" if group is not None and sglang_installed() else "embedded"
    problems = sglang_weight_problems(config, sglang_engines=kind == "sglang")
    if problems:
        if group is not None:
            group.remove()
        raise ValueError("the train stage cannot start: " + "; ".join(problems))
    if group is not None:
        setup = replace(setup, engines_on=group.engine_placement(  # the memory saver as slime: --offload-rollout
            kind, config.seed, placement.num_gpus_per_node, config.sglang.server_args(), placement.offload_rollout))
    # Some backends need a process group even for one rank (megatron-core keeps its parallel state in them).
    needs_world = world > 1 or backend_spec(config.placement.train_backend).always_distributed
    init_method = (scratch / f"dist-{uuid.uuid4().hex[:8]}").resolve().as_uri() if needs_world else ""
    ranks = 0 if config.debug.debug_rollout_only else world
    manager_cls = hosted(rollout_manager_class(config))
    trainer_cls = hosted(TrainActor) if ranks else TrainActor
    pinned = group.trainer_options if group else (lambda rank: {"num_cpus": 0, "num_gpus": 0})

    def trainer_args(rank: int) -> tuple:
        return (config, setup.hf_checkpoint, rank, world, init_method, total_steps, threads, run_token,
                str(scratch / "offload"))

    if shares_rank_zero(config, group is not None, ranks):
        host: Any = ray.remote(rank_zero_class(manager_cls, trainer_cls)).options(**pinned(0)).remote(
            (config, setup), trainer_args(0))
        manager, first = Facet(host, "manager_"), [Facet(host, "trainer_")]
    else:
        manager, first = ray.remote(num_cpus=0)(manager_cls).remote(config, setup), []
    actors = [*first, *(ray.remote(trainer_cls).options(**pinned(rank)).remote(*trainer_args(rank))
                        for rank in range(len(first), ranks))]
    try:
        targets = call(manager.weight_targets.remote(), "starting the rollout manager (engines)")
        if actors and targets is not None:
            chosen = call(actors[0].connect_engines.remote(targets), "connecting the trainer to the engines")
            logger.info("weight sync to the engines: %s (%s)", chosen["transport"], chosen["reason"])
            if config.fault_tolerance.use_fault_tolerance:  # a restarted engine gets the trainer's weights
                call(manager.connect_trainer.remote(actors[0]), "connecting the rollout manager to the trainer")
    except LoopError:
        _kill([manager, *actors])
        if group is not None:
            group.remove()
        raise
    colocation = None
    if placement.offload_train or placement.offload_rollout:
        colocation = Colocation(manager, actors, bool(placement.offload_train),
                                bool(placement.offload_rollout) and targets is not None,
                                config.weight_sync.update_weights_interval)
    rollouts = RolloutManagerHandle(manager, colocation)
    recover = rollouts.recover_engines if config.fault_tolerance.use_fault_tolerance else None
    trainers = ActorGroup(actors, pushes_weights=targets is not None, colocation=colocation,
                          before_push=recover) if actors else NoTrainer(config.checkpoint.start_rollout_id)
    return Placement(config, rollouts, trainers, group)


def _placement_group(config: TrainConfig) -> PlacedGroup:
    """slime's placement group for `config` (the flags were checked at stage start: placement_plan.flag_problems)."""
    external = config.placement.rollout_external_engine_addrs or config.sglang.args.get("worker_urls")
    plan = plan_placement(config.placement, debug_rollout_only=config.debug.debug_rollout_only,
                          debug_train_only=config.debug.debug_train_only, external_engines=bool(external))
    return create_placement_group(plan)
