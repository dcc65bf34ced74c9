"""A rollout engine as a Ray actor pinned to its placement-group bundle, as slime's SGLangEngine: the actor starts
the server process on its node and stops it with itself (the server is given the actor's pid as its parent).

On a GPU cluster with SGLang installed the server is `sglang.launch_server` (engine/sglang_launch.py: tp_size,
port, base GPU id as slime sets them, every --sglang-* flag passed through); elsewhere (a CPU machine, logical
GPUs in tests) it is the embedded engine. Either way the rollout talks HTTP to its URL.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slimeflow.engine.launch import EngineProcess, free_port, launch_engine
from slimeflow.engine.sglang_launch import (
    SGLANG_API_KEY_ENV,
    SGLANG_READY_PATH,
    SGLANG_READY_TIMEOUT_S,
    sglang_server_command,
)
from slimeflow.stages.train.remote import call, hosted

# SGLang picks its GPUs by --base-gpu-id among all of the node's, so Ray must not narrow CUDA_VISIBLE_DEVICES to
# the fraction of one GPU the actor holds (slime sets the same variable on its engine actors).
ENGINE_ACTOR_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
ENGINE_GPU_SHARE = 0.2
"""What an engine actor asks of its bundle's GPU (slime's figure): with --colocate a trainer (0.4) shares it."""


def sglang_installed() -> bool:
    """Whether engines launched here are SGLang servers (else the embedded engine)."""
    return importlib.util.find_spec("sglang") is not None


@dataclass(frozen=True)
class EngineSpec:
    """One engine to start: `kind` "sglang" or "embedded", its rank, GPUs and the server's arguments."""

    kind: str
    model_path: str
    rank: int
    num_gpus: int
    base_gpu_id: int
    seed: int
    server_args: dict[str, Any] = field(default_factory=dict)
    """The --sglang-* pass-through (SGLang servers only)."""
    num_threads: int | None = None
    """torch threads of an embedded engine."""
    api_key: str | None = field(default=None, repr=False)
    memory_saver: bool = False
    """SGLang's --enable-memory-saver (--offload-rollout; SGLang servers only)."""


class EngineActor:
    """Starts the server of `spec` on this actor's node (a free port on its address) and owns its process."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.host = ray.util.get_node_ip_address()
        if spec.kind == "sglang":
            self.process = _start_sglang(spec, self.host)
        else:
            self.process = launch_engine(spec.model_path, host=self.host, port=free_port(self.host),
                                         api_key=spec.api_key, num_threads=spec.num_threads)

    def wait_ready(self, path: str, timeout_s: float) -> str:
        """The server's URL once it answers `path` (an SGLang server: /health_generate, as slime waits for it, within
        SGLANG_READY_TIMEOUT_S); raises with its log tail when it dies or does not answer in time."""
        if self.spec.kind == "sglang":
            path, timeout_s = SGLANG_READY_PATH, SGLANG_READY_TIMEOUT_S
        self.process.wait_ready(path, timeout_s)
        return self.process.url

    def where(self) -> dict[str, Any]:
        """Where this engine runs: node address, the GPU ids Ray gave the actor, its command and process id."""
        return {"node_ip": self.host, "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [int(g) for g in ray.get_gpu_ids()], "rank": self.spec.rank,
                "base_gpu_id": self.spec.base_gpu_id, "command": self.process.command,
                "pid": self.process.process.pid, "url": self.process.url}

    def log_tail(self) -> str:
        return self.process.log_tail()

    def exit_report(self, wait_s: float) -> str | None:
        return self.process.exit_report(wait_s)

    def kill(self) -> None:
        self.process.kill()

    def restart(self) -> None:
        """Kill the server and start it again on this actor's bundle and port (fault_tolerance.recover)."""
        self.process.restart()

    def stop(self) -> None:
        self.process.stop()


def _start_sglang(spec: EngineSpec, host: str) -> Any:
    port = free_port(host)
    command = sglang_server_command(sys.executable, spec.model_path, host=host, port=port,
                                    nccl_port=free_port(host), num_gpus=spec.num_gpus, base_gpu_id=spec.base_gpu_id,
                                    seed=spec.seed, server_args=spec.server_args, memory_saver=spec.memory_saver)
    return EngineProcess(command, f"http://{host}:{port}", spec.api_key, key_env=SGLANG_API_KEY_ENV)


class PlacedEngine:
    """The RolloutManager's handle on an EngineActor, with an engine process's interface (`url` once ready,
    `wait_ready`, `stop`)."""

    kind = "engine"

    def __init__(self, actor: Any, rank: int, engine_kind: str = "embedded"):
        self.actor, self.rank = actor, rank
        self.engine_kind = engine_kind
        """EngineSpec.kind: "sglang" servers have no /get_weights_snapshot for a restarted peer to copy."""
        self.url: str | None = None

    def wait_ready(self, path: str, timeout_s: float) -> None:
        self.url = call(self.actor.wait_ready.remote(path, timeout_s), f"starting rollout engine {self.rank}")

    def kill(self) -> None:
        ray.get(self.actor.kill.remote(), timeout=30)

    def exit_report(self, wait_s: float = 0.0) -> str | None:
        try:
            return ray.get(self.actor.exit_report.remote(wait_s), timeout=30 + wait_s)
        except (ray.exceptions.RayError, TimeoutError) as err:
            return f"the actor of rollout engine {self.rank} does not answer ({type(err).__name__}: {err})"

    def restart(self) -> None:
        """Kill the server and start it again in its actor, on the same bundle and port; `wait_ready` follows."""
        call(self.actor.restart.remote(), f"restarting rollout engine {self.rank}")

    def stop(self) -> None:
        """Stop the server, then the actor (idempotent; an actor already gone is fine)."""
        try:
            ray.get(self.actor.stop.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # gone already, or stuck: ray.kill below ends it, and its server follows its parent
        ray.kill(self.actor)


def start_engine_actors(specs: list[EngineSpec], bundles: list[int], placement_group: Any) -> list[PlacedEngine]:
    """One EngineActor per spec on its bundle of `placement_group`; their servers start at once (wait_ready on
    each handle waits for them)."""
    remote = ray.remote(hosted(EngineActor))
    return [PlacedEngine(remote.options(**engine_actor_options(placement_group, bundle)).remote(spec), spec.rank,
                         spec.kind) for spec, bundle in zip(specs, bundles, strict=True)]


def engine_actor_options(placement_group: Any, bundle: int) -> dict[str, Any]:
    """Ray options that pin an engine actor to `bundle` (its server's child processes stay in the group)."""
    strategy = PlacementGroupSchedulingStrategy(placement_group=placement_group, placement_group_bundle_index=bundle,
                                                placement_group_capture_child_tasks=True)
    return {"num_cpus": 0, "num_gpus": ENGINE_GPU_SHARE, "scheduling_strategy": strategy,
            "runtime_env": {"env_vars": ENGINE_ACTOR_ENV}}

