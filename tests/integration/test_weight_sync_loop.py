"""--update-weights-interval and --update-weight-buffer-size through a real train stage on Ray, colocated: the
trainer pushes every 2 rollouts, in buckets, through a /dev/shm file, and every rollout answer is checked against the
version the engines should serve (a wrong one fails the run). The gloo transport's run (--update-weight-transport
nccl) is the same but for the flag; test_engine_control checks both transports' buckets against HF's outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slimeflow.config.pipeline import load_stage_config
from slimeflow.errors import ConfigError

TRAIN = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2"]


def test_the_weight_sync_flags_parse_under_slimes_names():
    config = load_stage_config("train", None, [*TRAIN, "--update-weights-interval", "4", "--update-weight-buffer-size",
                                               "1048576", "--update-weight-transport", "nccl"])
    sync = config.weight_sync
    assert (sync.update_weights_interval, sync.update_weight_buffer_size, sync.update_weight_transport) == (
        4, 2**20, "nccl")
    with pytest.raises(ConfigError, match="update-weights-interval"):
        load_stage_config("train", None, [*TRAIN, "--update-weights-interval", "0"])
    with pytest.raises(ConfigError, match="update-weight-transport"):
        load_stage_config("train", None, [*TRAIN, "--update-weight-transport", "ipc"])


def test_the_health_check_flags_are_taken_and_fault_tolerance_with_one_engine_too():
    ft = load_stage_config("train", None, [*TRAIN, "--rollout-health-check-interval", "10",
                                           "--rollout-health-check-timeout", "5",
                                           "--rollout-health-check-first-wait", "0"]).fault_tolerance
    assert (ft.rollout_health_check_interval, ft.rollout_health_check_timeout,
            ft.rollout_health_check_first_wait, ft.use_fault_tolerance) == (10.0, 5.0, 0.0, False)
    one = load_stage_config("train", None, [*TRAIN, "--use-fault-tolerance"])  # the trainer restores its weights
    assert one.fault_tolerance.use_fault_tolerance and not one.placement.engine_in_process
    with pytest.raises(ConfigError, match="--use-fault-tolerance with --engine-in-process"):
        load_stage_config("train", None, [*TRAIN, "--use-fault-tolerance", "--engine-in-process"])


@pytest.mark.slow
def test_a_colocated_run_pushes_every_interval_in_buckets_through_shared_memory(tmp_path, monkeypatch, local_ray):
    from train_helpers import run_stage, train_config

    config, _ = train_config(tmp_path / "prep", **{
        "num-rollout": 3, "rollout-batch-size": 4, "n-samples-per-prompt": 4, "eval-interval": 1,
        "save-interval": None, "update-weights-interval": 2, "update-weight-buffer-size": 65536,
        "colocate": True})
    records, _, manifest = run_stage(config, tmp_path / "run", monkeypatch)
    rollouts = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in rollouts] == [0, 1, 2]
    # Pushed after rollout 1 only (and before rollout 0): (rollout_id + 1) % 2 == 0.
    assert ["time/update_weights" in r for r in rollouts] == [False, True, False]
    assert manifest.outputs["checkpoint"].endswith("iter_0000002")


def test_the_engines_ray_node_is_where_the_rollout_manager_started_them_and_the_trainer_compares_it(local_ray):
    """The same-host default rests on Ray's node ids: an engine process started by the RolloutManager is on that
    actor's node, which is the trainer's on one machine; external servers have none (so never a same-host guess)."""
    import ray

    from slimeflow.stages.train.engines import EngineSet, WeightTargets
    from slimeflow.stages.train.rollouts import engine_node_ids
    from slimeflow.stages.train.trainer import ray_node_id
    from slimeflow.stages.train.weight_sync import default_transport

    @ray.remote(num_cpus=0)
    def started_here() -> tuple[tuple[str, ...], str | None]:
        engine = SimpleNamespace(url="http://127.0.0.1:1")
        router = SimpleNamespace(url="http://127.0.0.1:9", kind="router")
        return engine_node_ids(EngineSet([engine.url], router.url, "hf", processes=[engine, router])), ray_node_id()

    nodes, manager_node = ray.get(started_here.remote())
    trainer_node = ray_node_id()
    assert nodes == (manager_node,) and trainer_node == manager_node is not None
    targets = WeightTargets(("http://127.0.0.1:1",), "hf", node_ids=nodes)
    assert default_transport(targets, colocate=False, node_id=trainer_node)[0] == "shared_memory"
    assert engine_node_ids(EngineSet(["http://10.0.0.1:1"], "http://10.0.0.1:1", "hf", "/w")) == ()
