"""Placement on a real Ray cluster of logical GPUs (issue 20, item 1): two raylets on loopback with 4 GPUs each
(ray.cluster_utils.Cluster), one cluster for the module. Where every trainer rank and engine lands, colocated and
disaggregated, on one node and across two; a rollout through engines started as Ray actors on their bundles; and,
with --use-fault-tolerance, the loop through an SGLang server (the test-only stand-in, tests/data/fake_sglang)
killed mid-rollout and restarted on its bundle; and colocated SGLang servers fed SGLang's tensor body."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
import ray
from paths import DATA

from slimeflow.cluster import LOCAL_RAY_SYSTEM_CONFIG
from slimeflow.config.pipeline import load_stage_config
from slimeflow.stages.train.engine_actor import ENGINE_ACTOR_ENV, engine_actor_options
from slimeflow.stages.train.placement_group import PlacedGroup, create_placement_group
from slimeflow.stages.train.placement_plan import plan_placement

pytestmark = pytest.mark.slow

GPUS_PER_NODE = 4
FAKE_SGLANG = DATA / "fake_sglang"
"""A test-only `sglang` package: `sglang.launch_server` parses our command line and serves the embedded engine."""


@pytest.fixture
def fake_sglang(monkeypatch):
    """The stand-in `sglang` importable here for one test; its modules leave sys.modules after it (find_spec would
    still find them there, and later tests' engines would be taken for SGLang servers)."""
    monkeypatch.syspath_prepend(str(FAKE_SGLANG))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "sglang"]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def cluster():
    """Two raylets on 127.0.0.1, 4 logical GPUs and 1 CPU each; this process is the driver."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray.shutdown()  # a Ray another test started locally has no logical GPUs
    with pytest.MonkeyPatch.context() as patch:
        # ray.init would turn the loopback address into the machine's (to reach clusters of several hosts), where
        # these raylets do not listen; Ray's own switch for single-host clusters keeps it.
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        # The workers can import the stand-in `sglang`; the driver's choice of engine (placement.sglang_installed)
        # sees it only in the test that puts it on its own sys.path.
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAKE_SGLANG), os.environ.get("PYTHONPATH")])))
        nodes = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "num_gpus": GPUS_PER_NODE, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "_system_config": LOCAL_RAY_SYSTEM_CONFIG})
        try:
            nodes.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE, node_ip_address="127.0.0.1")
            ray.init(address=nodes.address)
            nodes.wait_for_nodes()
            yield nodes
        finally:
            ray.shutdown()
            nodes.shutdown()


@ray.remote(num_cpus=0)
def where() -> tuple[str, list[int]]:
    """Where Ray ran it: its node and the GPU ids it held (a task, so that Ray's idle workers serve it: an actor
    per probe would start a process each)."""
    return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]


def landed(group: PlacedGroup) -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
    """(node, GPU ids) of each trainer rank and of each engine, pinned with the Ray options the run uses."""
    placement = group.engine_placement("embedded", 0, GPUS_PER_NODE, {})
    trainers = [where.options(**group.trainer_options(r)).remote() for r in range(len(group.plan.trainer_slots))]
    engines = []
    for bundle in placement.bundles:
        options = engine_actor_options(placement.placement_group, bundle)
        assert options.pop("runtime_env")["env_vars"] == ENGINE_ACTOR_ENV  # SGLang sees all GPUs, picks by base id
        engines.append(where.options(**options).remote())  # (without the env: Ray's idle workers serve it)
    return ray.get(trainers), ray.get(engines)


def all_gpus_free(timeout_s: float = 30.0) -> bool:
    """Whether every GPU of the cluster is free again (a removed group is given back asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) != 2 * GPUS_PER_NODE:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def placed(*flags: str) -> PlacedGroup:
    config = load_stage_config("train", None, ["--rollout-batch-size", "8", "--num-rollout", "1",
                                               "--num-gpus-per-node", str(GPUS_PER_NODE), *flags])
    return create_placement_group(plan_placement(config.placement), timeout_s=60)


def test_colocated_on_one_node_each_engine_shares_its_trainers_gpus(cluster):
    group = placed("--actor-num-gpus-per-node", "4", "--colocate", "--rollout-num-gpus-per-engine", "2")
    try:
        trainers, engines = landed(group)
        nodes = {node for node, _ in trainers + engines}
        assert len(nodes) == 1  # PACK: four bundles fit one node
        assert [gpus for _, gpus in trainers] == [[0], [1], [2], [3]]  # rank r on GPU r
        assert [gpus for _, gpus in engines] == [[0], [2]]  # each engine's actor on its first GPU
        placement = group.engine_placement("embedded", 1234, GPUS_PER_NODE, {})
        assert placement.base_gpu_ids == (0, 2) and placement.num_gpus_per_engine == 2
    finally:
        group.remove()


def test_disaggregated_on_one_node_engines_follow_the_trainers(cluster):
    group = placed("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2")
    try:
        trainers, engines = landed(group)
        assert len({node for node, _ in trainers + engines}) == 1
        assert [gpus for _, gpus in trainers] == [[0], [1]] and [gpus for _, gpus in engines] == [[2], [3]]
        assert group.engine_placement("embedded", 0, GPUS_PER_NODE, {}).base_gpu_ids == (2, 3)
    finally:
        group.remove()


def test_across_two_nodes_trainers_fill_one_node_and_engines_the_other(cluster):
    group = placed("--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    try:
        trainers, engines = landed(group)
        trainer_nodes, engine_nodes = {n for n, _ in trainers}, {n for n, _ in engines}
        assert len(trainer_nodes) == 1 and len(engine_nodes) == 1 and trainer_nodes != engine_nodes
        assert [gpus for _, gpus in trainers] == [[0], [1], [2], [3]] and [g for _, g in engines] == [[0], [2]]
        assert group.engine_placement("embedded", 0, GPUS_PER_NODE, {}).base_gpu_ids == (0, 2)
    finally:
        group.remove()


def test_more_gpus_than_the_cluster_has_is_a_clear_error(cluster):
    with pytest.raises(RuntimeError, match=r"could not reserve 12 GPUs .* the cluster has 8 GPUs"):
        create_placement_group(plan_placement(load_stage_config("train", None, [
            "--rollout-batch-size", "8", "--num-rollout", "1", "--actor-num-gpus-per-node", "8",
            "--rollout-num-gpus", "4"]).placement), timeout_s=3)
    assert all_gpus_free()  # the group was removed


def test_an_engine_that_dies_at_start_reaches_the_caller_with_its_log(cluster, tmp_path):
    from slimeflow.stages.train.engine_actor import EngineSpec, start_engine_actors
    from slimeflow.stages.train.remote import LoopError

    group = placed("--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1")
    try:
        [engine] = start_engine_actors([EngineSpec("embedded", str(tmp_path / "no-model"), 0, 1, 0, 0)],
                                       [group.slots[1].bundle_index], group.group)
        with pytest.raises(LoopError, match=r"starting rollout engine 0 failed: RuntimeError: engine exited with code "
                                            r"\d+ before answering (.|\n)*log tail") as err:
            engine.wait_ready("/health", 120)
        assert "no-model" in str(err.value)  # the server's own complaint, from its log
        engine.stop()
    finally:
        group.remove()


def test_a_rollout_through_engine_actors_pinned_to_their_bundles(cluster, tmp_path):
    """The train stage's placement on logical GPUs: one TrainActor on slot 0, two embedded engines started by
    EngineActors on slots 1 and 2, sglang-router in front with a --router-* flag; weights pushed, a rollout
    generated and trained on."""
    from train_helpers import train_config

    from slimeflow.stages.train.placement import create_placement
    from slimeflow.stages.train.remote import call
    from slimeflow.stages.train.stage import rollout_setup, with_defaults

    config, ctx = train_config(tmp_path, **{
        "num-rollout": 1, "rollout-batch-size": 2, "n-samples-per-prompt": 2, "eval-interval": None,
        "save-interval": None, "rollout-num-gpus": 2, "num-gpus-per-node": GPUS_PER_NODE,
        "router-queue-size": 7})
    config = with_defaults(config, ctx)
    setup = rollout_setup(config, ctx)
    placement = create_placement(config, setup, total_steps=1, scratch=tmp_path)
    try:
        where: dict[str, Any] = call(placement.rollout_manager.actor.engine_locations.remote(), "engine locations")
        trainer_node, trainer_gpus = call(placement.actor_group.actors[0].__ray_call__.remote(
            lambda self: (ray.get_runtime_context().get_node_id(), ray.get_gpu_ids())), "where the trainer is")
        placement.actor_group.update_weights(version=0)
        batch, metrics, rows = placement.rollout_manager.generate(0)
        trained = placement.actor_group.train(0, batch)
    finally:
        placement.shutdown()
    engines = where["engines"]
    assert [e["rank"] for e in engines] == [0, 1]
    # slot 0 is the trainer's, slots 1 and 2 the engines': the next GPUs of the same node, in order
    engine_gpus = [e["gpu_ids"][0] for e in engines]
    assert [int(g) for g in trainer_gpus] < engine_gpus[:1] and engine_gpus == sorted(engine_gpus)
    assert [e["base_gpu_id"] for e in engines] == engine_gpus and {e["node_id"] for e in engines} == {trainer_node}
    assert all(e["url"].startswith("http://127.0.0.1:") and "slimeflow.engine.server" in e["command"]
               for e in engines)
    router = where["router"]
    assert router[router.index("--queue-size") + 1] == "7" and "--disable-circuit-breaker" in router
    assert len(rows) == 2 and "rollout/reward_mean" in metrics and "pg_loss" in trained
    assert all_gpus_free()  # everything given back


def test_with_fault_tolerance_the_loop_survives_an_sglang_server_killed_mid_rollout(cluster, tmp_path, monkeypatch, fake_sglang):
    """The train stage's own path (RolloutManager and TrainActor as Ray actors, the engine an EngineActor on its
    bundle) with the SGLang launch path: the actor runs `sglang.launch_server` (the stand-in) with the command line
    we build and waits for /health_generate. One engine, weights by broadcast (--update-weight-transport nccl, gloo
    here): its server is SIGKILLed during rollout 0; it is restarted in its actor and given version 0 by the trainer
    (no peer to copy, and SGLang has none to offer) in a weight-update group of its own; the rollout completes with
    every prompt once, the trainer's next push regroups it and rollout 1 is generated with version 1."""
    import signal
    import threading

    import httpx
    from train_helpers import train_config

    from slimeflow.stages.train.placement import create_placement
    from slimeflow.stages.train.remote import call
    from slimeflow.stages.train.stage import rollout_setup, with_defaults

    config, ctx = train_config(tmp_path, **{
        "num-rollout": 2, "rollout-batch-size": 4, "n-samples-per-prompt": 2, "eval-interval": None,
        "save-interval": None, "rollout-num-gpus": 1, "num-gpus-per-node": GPUS_PER_NODE,
        "update-weight-transport": "nccl", "sglang": {"mem_fraction_static": 0.5},
        "use-fault-tolerance": True, "rollout-health-check-interval": 0.5, "rollout-health-check-timeout": 5})
    config = with_defaults(config, ctx)
    placement = create_placement(config, rollout_setup(config, ctx), total_steps=2, scratch=tmp_path)
    try:
        manager = placement.rollout_manager.actor
        engine = call(manager.engine_locations.remote(), "engine locations")["engines"][0]
        key = call(manager.weight_targets.remote(), "weight targets").api_key

        def kill_when_busy():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and httpx.get(engine["url"] + "/get_model_info", timeout=5, headers={
                    "Authorization": f"Bearer {key}"}).json()["requests_received"] == 0:
                time.sleep(0.005)
            os.kill(engine["pid"], signal.SIGKILL)

        killer = threading.Thread(target=kill_when_busy, daemon=True)
        placement.actor_group.update_weights(version=0)
        killer.start()
        batch, metrics, rows = placement.rollout_manager.generate(0)
        killer.join()
        placement.actor_group.train(0, batch)
        placement.actor_group.update_weights(version=1)
        _, metrics_1, rows_1 = placement.rollout_manager.generate(1)
        after = call(manager.engine_locations.remote(), "engine locations")["engines"][0]
        recoveries = call(manager.__ray_call__.remote(lambda self: self.rollouts.monitor.recoveries), "recoveries")
        log = call(manager.__ray_call__.remote(lambda self: ray.get(self.rollouts.engines.processes[0].actor.log_tail.remote())),
                   "the engine's log")
    finally:
        placement.shutdown()
    command = engine["command"]
    assert "sglang.launch_server" in " ".join(command) and engine["url"].startswith("http://127.0.0.1:")
    assert command[command.index("--tp-size") + 1] == "1" and command[command.index("--mem-fraction-static") + 1] == "0.5"
    assert "--api-key" not in command and "test stand-in) parsed" in log and "'mem_fraction_static': 0.5" in log
    assert [(r.rank, r.weights_from, r.weight_version) for r in recoveries] == [(0, "trainer", "0")]
    # restarted in its EngineActor: on its bundle (node and GPU) and at its URL
    assert after["pid"] != engine["pid"]
    assert {k: after[k] for k in ("node_id", "gpu_ids", "url")} == {k: engine[k] for k in ("node_id", "gpu_ids", "url")}
    for rollout_rows in (rows, rows_1):
        assert len(rollout_rows) == 4 and all(len(group) == 2 and len(set(group)) == 1 for group in rollout_rows)
        assert len({group[0] for group in rollout_rows}) == 4  # each prompt once
    assert metrics["rollout/weight_version_min"] == metrics["rollout/weight_version_max"] == 0
    assert metrics_1["rollout/weight_version_min"] == 1
    assert all_gpus_free()


def test_colocated_sglang_servers_take_sglangs_tensor_body_from_the_trainer(cluster, tmp_path, fake_sglang):
    """--colocate with the SGLang launch path (the stand-in server, --enable-memory-saver for the default
    --offload-rollout): the trainer picks SGLang's /update_weights_from_tensor body (flattened buckets of handles,
    engine/tensor_ipc.py) by itself; after weights it perturbed are pushed, the engine's log-probs of rollout 1 are
    the trainer's. Released engines are not health-checked (they answer 503 until they resume)."""
    import torch
    from train_helpers import train_config

    from slimeflow.stages.train.placement import create_placement
    from slimeflow.stages.train.remote import call
    from slimeflow.stages.train.stage import rollout_setup, with_defaults

    def perturb(self: Any) -> None:
        noise = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.trainer.backend.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=noise))

    config, ctx = train_config(tmp_path, **{
        "num-rollout": 2, "rollout-batch-size": 2, "n-samples-per-prompt": 2, "eval-interval": None,
        "save-interval": None, "colocate": True, "actor-num-gpus-per-node": 1, "num-gpus-per-node": GPUS_PER_NODE,
        "update-weight-buffer-size": 65536})
    config = with_defaults(config, ctx)
    placement = create_placement(config, rollout_setup(config, ctx), total_steps=2, scratch=tmp_path)
    trainer = placement.actor_group.actors[0]
    try:
        transport = call(trainer.__ray_call__.remote(lambda self: (self.trainer.weight_sync.transport,
                                                                   self.trainer.weight_sync.targets.sglang)), "transport")
        engine = call(placement.rollout_manager.actor.engine_locations.remote(), "engine locations")["engines"][0]
        placement.actor_group.update_weights(version=0)
        batch, _, _ = placement.rollout_manager.generate(0)
        placement.actor_group.train(0, batch)
        call(trainer.__ray_call__.remote(perturb), "perturbing the trainer's weights")
        placement.actor_group.update_weights(version=1)
        batch_1, metrics_1, _ = placement.rollout_manager.generate(1)
        trained_1 = placement.actor_group.train(1, batch_1)
        buckets = call(trainer.__ray_call__.remote(lambda self: self.trainer.weight_sync.buckets_sent), "buckets sent")
    finally:
        placement.shutdown()
    assert transport == ("ipc", True) and buckets > 2
    command = " ".join(engine["command"])
    assert "sglang.launch_server" in command and "--enable-memory-saver" in command
    assert metrics_1["rollout/weight_version_min"] == 1
    assert trained_1["train_rollout_logprob_abs_diff"] < 1e-5  # the perturbed weights reached the server
    assert all_gpus_free()
