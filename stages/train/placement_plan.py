"""Where trainers and engines go, as slime places them: one placement group of one-GPU bundles, trainer ranks on
the first slots, engines on the slots after them (or on the same slots, with --colocate).

Two pure steps, testable without Ray:
- `plan_placement` turns the placement flags into a `PlacementPlan`: how many bundles, which logical slot each
  trainer rank takes and which run of slots each engine takes.
- `bind_slots` orders the bundles Ray created by (node IP, GPU id), as slime does, so that slot k is the k-th GPU
  of the cluster in that order; a trainer rank or engine then knows its bundle index, node and GPU ids.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from slimeflow.config.train import PlacementConfig, TrainConfig
from slimeflow.config.train_validation import external_engine_problems
from slimeflow.engine.sglang_launch import router_flag_problems, server_arg_problems


@dataclass(frozen=True)
class EngineSlots:
    """One rollout engine: `rank` among the engines, its first slot and its number of GPUs (SGLang's tp_size x
    pp_size), all on one node."""

    rank: int
    first_slot: int
    num_gpus: int

    @property
    def slots(self) -> range:
        return range(self.first_slot, self.first_slot + self.num_gpus)


@dataclass(frozen=True)
class PlacementPlan:
    """`num_bundles` one-GPU bundles; trainer rank r uses slot `trainer_slots[r]`, engine e the slots of
    `engines[e]`. Slots are logical: `bind_slots` maps them to bundles."""

    num_bundles: int
    trainer_slots: tuple[int, ...]
    engines: tuple[EngineSlots, ...]
    colocate: bool


def plan_placement(placement: PlacementConfig, *, debug_rollout_only: bool = False, debug_train_only: bool = False,
                   external_engines: bool = False) -> PlacementPlan:
    """The plan of slime's create_placement_groups for these flags. Raises ValueError (naming the flags) for a
    layout this version cannot run: an engine wider than a node."""
    trainers = placement.actor_num_nodes * placement.actor_num_gpus_per_node
    per_engine = placement.rollout_num_gpus_per_engine
    rollout = placement.rollout_num_gpus or per_engine  # unset: one engine
    if per_engine > placement.num_gpus_per_node and not (debug_train_only or external_engines):
        raise ValueError(f"--rollout-num-gpus-per-engine {per_engine} is larger than --num-gpus-per-node "
                         f"{placement.num_gpus_per_node}: an engine spanning several nodes is not supported yet; use at "
                         f"most {placement.num_gpus_per_node} GPUs per engine (or raise --num-gpus-per-node if the "
                         "nodes have more)")
    trainer_slots = () if debug_rollout_only else tuple(range(trainers))
    if debug_train_only or external_engines:
        return PlacementPlan(len(trainer_slots), trainer_slots, (), placement.colocate)
    if debug_rollout_only:
        bundles, offset = rollout, 0
    elif placement.colocate:
        bundles, offset = max(trainers, rollout), 0
    else:
        bundles, offset = trainers + rollout, trainers
    engines = tuple(EngineSlots(rank, offset + rank * per_engine, per_engine) for rank in range(rollout // per_engine))
    return PlacementPlan(bundles, trainer_slots, engines, placement.colocate and not debug_rollout_only)


@dataclass(frozen=True)
class BundleLocation:
    """Where Ray put one bundle: its index in the placement group, its node (IP and Ray node id: raylets on one
    host share an IP) and the GPU id it holds there."""

    bundle_index: int
    node_ip: str
    gpu_id: int
    node_id: str = ""


def bind_slots(locations: Sequence[BundleLocation]) -> list[BundleLocation]:
    """The bundles in slot order: by node IP (numerically; a host name is resolved, else compared by its
    characters), then GPU id, as slime's sort_key, so that consecutive slots are consecutive GPUs of one node (the
    node id separates raylets that share an IP)."""
    return sorted(locations, key=lambda loc: (_node_key(loc.node_ip), loc.node_id, loc.gpu_id))


def _node_key(node: str) -> tuple[int, ...]:
    for candidate in (node, _resolve(node)):
        try:
            return tuple(int(part) for part in (candidate or "").split("."))
        except ValueError:
            continue
    return tuple(ord(c) for c in node)


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):
        return None


def engine_problems(plan: PlacementPlan, slots: Sequence[BundleLocation]) -> list[str]:
    """Engines whose bundles did not land on one node with consecutive GPU ids (SGLang takes `--base-gpu-id` and
    uses the next tp_size GPUs of its node)."""
    problems = []
    for engine in plan.engines:
        placed = [slots[s] for s in engine.slots]
        nodes = {(loc.node_ip, loc.node_id) for loc in placed}
        gpus = [loc.gpu_id for loc in placed]
        if len(nodes) > 1 or gpus != list(range(gpus[0], gpus[0] + len(gpus))):
            problems.append(f"engine {engine.rank} got GPUs {gpus} on {len(nodes)} node(s); an engine needs "
                            f"{engine.num_gpus} consecutive GPUs of one node: make --rollout-num-gpus-per-engine "
                            "divide the GPUs each node gives the rollout")
    return problems


def flag_problems(config: TrainConfig, sglang_server_args: set[str] | None) -> list[str]:
    """What the placement, engine and router flags ask for that this run cannot do, one line each (checked when
    the train stage starts, before Ray). `sglang_server_args`: the installed SGLang server's argument names
    (sglang_launch.installed_server_args); None where SGLang is not installed and the engines are embedded."""
    placement, sglang = config.placement, config.sglang
    external = placement.rollout_external_engine_addrs or sglang.args.get("worker_urls")
    launches_sglang = sglang_server_args is not None and not external and not config.debug.debug_train_only
    problems = sglang.unread(launches_sglang)
    if launches_sglang and sglang_server_args is not None:
        problems += server_arg_problems(sglang.server_args(), sglang_server_args)
    problems += external_engine_problems(config)
    given_router = sglang.args.get("router_ip") is not None or sglang.args.get("router_port") is not None
    try:
        plan = plan_placement(placement, debug_rollout_only=config.debug.debug_rollout_only,
                              debug_train_only=config.debug.debug_train_only, external_engines=bool(external))
    except ValueError as err:
        return [*problems, str(err)]
    engines = len(_split(external)) if external else len(plan.engines)
    if sglang.router and (given_router or engines < 2 or config.debug.debug_train_only):
        why = ("the router is yours (--sglang-router-ip)" if given_router else
               "no engine runs (--debug-train-only)" if config.debug.debug_train_only else
               "with one engine no router is started")
        problems += [f"--router-{name.replace('_', '-')}: no sglang-router of slimeflow's would get it ({why}); "
                     "remove it" for name in sorted(sglang.router)]
    elif sglang.router:
        problems += router_flag_problems(sglang.router)
    return problems


def sglang_weight_problems(config: TrainConfig, sglang_engines: bool) -> list[str]:
    """How the trainer's weights reach the engines this run launches: SGLang servers read SGLang's own formats only
    (colocated: its /update_weights_from_tensor body, by default); --sglang-weights-dir is read for SGLang servers
    (external, or launched here), not by the embedded engine."""
    sglang, transport = config.sglang, config.weight_sync.update_weight_transport
    external = config.placement.rollout_external_engine_addrs or sglang.args.get("worker_urls")
    weights_dir = sglang.args.get("weights_dir")
    if config.debug.debug_rollout_only or config.debug.debug_train_only:
        return []
    if transport in ("http", "shared_memory") and (external or sglang_engines):
        return [f"--update-weight-transport {transport} reaches the embedded engines only; SGLang servers take nccl "
                "or --sglang-weights-dir (and, colocated, the default IPC body)"]
    if external:
        return []
    if not sglang_engines:
        return ["--sglang-weights-dir: read for SGLang servers (started elsewhere, or launched here where SGLang is "
                "installed); the embedded engines take the weights over HTTP, /dev/shm (--colocate) or "
                "--update-weight-transport nccl: remove it"] if weights_dir else []
    if weights_dir and transport == "nccl":
        return ["--sglang-weights-dir and --update-weight-transport nccl name two ways to push the weights; give one"]
    if transport is None and not weights_dir and not config.placement.colocate:
        return ["the SGLang servers launched here read weights in SGLang's formats only, and engines disaggregated "
                "from the trainer take them as slime's do: give --update-weight-transport nccl (SGLang's broadcast "
                "group) or --sglang-weights-dir DIR (a directory the servers can read: each version is written there "
                "and loaded with /update_weights_from_disk); or --colocate (SGLang's /update_weights_from_tensor)"]
    if transport is None and not weights_dir:
        return _ipc_problems(config)
    return []


def _ipc_problems(config: TrainConfig) -> list[str]:
    """Colocated SGLang servers take SGLang's /update_weights_from_tensor body from trainer rank 0 (on slot 0): its
    IPC handles and /dev/shm files reach the GPUs of rank 0's node only (slime sends from each engine's own trainer
    ranks instead, which is not built)."""
    placement = config.placement
    try:
        plan = plan_placement(placement)
    except ValueError:
        return []  # flag_problems names it
    elsewhere = [e.rank for e in plan.engines if e.first_slot + e.num_gpus > placement.num_gpus_per_node]
    if not elsewhere:
        return []
    return [f"--colocate: engines {elsewhere} run on other nodes than trainer rank 0, which pushes the weights as "
            "SGLang's /update_weights_from_tensor handles (CUDA IPC, node-local); sending from each node's own "
            "trainer ranks is not built: give --update-weight-transport nccl or --sglang-weights-dir DIR, or keep "
            f"--rollout-num-gpus within one node (--num-gpus-per-node {placement.num_gpus_per_node})"]


def _split(urls: str | list[str]) -> list[str]:
    return urls.split() if isinstance(urls, str) else list(urls)
