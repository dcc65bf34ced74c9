"""Placement as slime does it (issue 20, item 1), without Ray: the plan from the placement flags, the bundle order,
the SGLang server and sglang-router command lines, and the flags no server would get, refused by name."""

from __future__ import annotations

import pytest
import torch

from slimeflow.config.pipeline import load_stage_config
from slimeflow.engine.sglang_launch import (
    router_options,
    server_arg_problems,
    sglang_server_command,
    to_flags,
)
from slimeflow.stages.train.placement_plan import (
    BundleLocation,
    EngineSlots,
    PlacementPlan,
    bind_slots,
    engine_problems,
    flag_problems,
    plan_placement,
)

BASE = ["--rollout-batch-size", "8", "--num-rollout", "1"]
SGLANG_ARGS = {"mem_fraction_static", "max_running_requests", "tp_size", "port"}
"""Some of an SGLang server's argument names, as installed_server_args() reads them where SGLang is installed."""


def config(*flags: str):
    return load_stage_config("train", None, [*BASE, *flags])


def plan(*flags: str, **debug) -> PlacementPlan:
    c = config(*flags)
    return plan_placement(c.placement, **debug)


def test_disaggregated_trainers_take_the_first_slots_and_engines_the_next():
    got = plan("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "8",
               "--rollout-num-gpus-per-engine", "2")
    assert got.num_bundles == 16 and got.trainer_slots == tuple(range(8)) and not got.colocate
    assert got.engines == tuple(EngineSlots(rank, 8 + 2 * rank, 2) for rank in range(4))


def test_colocated_engines_share_the_trainers_slots():
    got = plan("--actor-num-gpus-per-node", "4", "--colocate", "--rollout-num-gpus-per-engine", "2")
    assert got.num_bundles == 4 and got.trainer_slots == (0, 1, 2, 3) and got.colocate
    assert [list(e.slots) for e in got.engines] == [[0, 1], [2, 3]]


def test_debug_modes_and_external_engines_change_the_cast_as_in_slime():
    rollout_only = plan("--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "2", debug_rollout_only=True)
    assert rollout_only.num_bundles == 2 and rollout_only.trainer_slots == ()
    assert [e.first_slot for e in rollout_only.engines] == [0, 1]
    train_only = plan("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", debug_train_only=True)
    assert (train_only.num_bundles, train_only.trainer_slots, train_only.engines) == (2, (0, 1), ())
    external = plan("--actor-num-gpus-per-node", "2", external_engines=True)
    assert (external.num_bundles, external.engines) == (2, ())
    # rollout-num-gpus unset: one engine of --rollout-num-gpus-per-engine GPUs after the trainers
    assert plan("--rollout-num-gpus-per-engine", "2").engines == (EngineSlots(0, 1, 2),)


def test_an_engine_wider_than_a_node_is_refused_with_the_flags():
    with pytest.raises(ValueError, match="--rollout-num-gpus-per-engine 16 is larger than --num-gpus-per-node 8"):
        plan("--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "16")


def test_bundles_are_ordered_by_node_ip_numerically_then_gpu():
    found = [BundleLocation(0, "10.0.0.10", 1), BundleLocation(1, "10.0.0.9", 1), BundleLocation(2, "10.0.0.10", 0),
             BundleLocation(3, "10.0.0.9", 0)]
    assert [b.bundle_index for b in bind_slots(found)] == [3, 1, 2, 0]  # .9 before .10, as numbers
    # raylets on one host share its IP: the node id keeps each node's GPUs together
    same_ip = [BundleLocation(0, "127.0.0.1", 0, "b"), BundleLocation(1, "127.0.0.1", 0, "a"),
               BundleLocation(2, "127.0.0.1", 1, "a"), BundleLocation(3, "127.0.0.1", 1, "b")]
    assert [b.bundle_index for b in bind_slots(same_ip)] == [1, 2, 0, 3]


def test_an_engine_split_across_nodes_or_gaps_is_named():
    two_per_engine = plan_placement(config("--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
                                           "--actor-num-gpus-per-node", "1").placement)
    split = bind_slots([BundleLocation(0, "1.0.0.1", 0), BundleLocation(1, "1.0.0.1", 1),
                        BundleLocation(2, "1.0.0.2", 0)])
    assert engine_problems(two_per_engine, split) == [
        "engine 0 got GPUs [1, 0] on 2 node(s); an engine needs 2 consecutive GPUs of one node: make "
        "--rollout-num-gpus-per-engine divide the GPUs each node gives the rollout"]
    whole = bind_slots([BundleLocation(i, "1.0.0.1", i) for i in range(3)])
    assert engine_problems(two_per_engine, whole) == []


def test_the_sglang_server_command_has_slimes_settings_and_every_passed_flag():
    command = sglang_server_command("/py", "/models/qwen", host="10.0.0.2", port=15000, nccl_port=15001, num_gpus=4,
                                    base_gpu_id=4, seed=1242, server_args={
                                        "mem_fraction_static": "0.7", "pp_size": "2", "enable_metrics": True,
                                        "cuda_graph_bs": ["1", "2", "4"], "disable_radix_cache": False})
    assert command[:2] == ["/py", "-c"] and "runpy.run_module('sglang.launch_server'" in command[2]
    assert "api-key" not in " ".join(command[3:])  # the key comes from the environment, never the command line
    assert command[3:] == [
        "--model-path", "/models/qwen", "--host", "10.0.0.2", "--port", "15000", "--nccl-port", "15001",
        "--tp-size", "2", "--base-gpu-id", "4", "--gpu-id-step", "1", "--random-seed", "1242", "--trust-remote-code",
        "--skip-server-warmup", "--mem-fraction-static", "0.7", "--pp-size", "2", "--enable-metrics",
        "--cuda-graph-bs", "1", "2", "4"]
    with pytest.raises(ValueError, match="not a multiple of --sglang-pp-size 3"):
        sglang_server_command("/py", "/m", host="h", port=1, nccl_port=2, num_gpus=4, base_gpu_id=0, seed=0,
                              server_args={"pp_size": "3"})
    with pytest.raises(ValueError, match="slimeflow sets itself: tp_size"):
        sglang_server_command("/py", "/m", host="h", port=1, nccl_port=2, num_gpus=1, base_gpu_id=0, seed=0,
                              server_args={"tp_size": "2"})
    saver = sglang_server_command("/py", "/m", host="h", port=1, nccl_port=2, num_gpus=1, base_gpu_id=0, seed=0,
                                  server_args={}, memory_saver=True)  # --offload-rollout's, set by slimeflow
    assert saver[-1] == "--enable-memory-saver" and "--enable-memory-saver" not in command


def test_router_flags_go_to_sglang_router_over_slimes_defaults():
    c = config("--router-policy", "cache_aware", "--router-prometheus-duration-buckets", "0.1", "1",
               "--router-dp-aware", "--sglang-router-request-timeout-secs", "600")
    assert c.sglang.router == {"policy": "cache_aware", "prometheus_duration_buckets": ["0.1", "1"], "dp_aware": True}
    options = router_options(c.sglang.router, c.sglang.args["router_request_timeout_secs"])
    assert to_flags(options) == [
        "--log-level", "warn", "--balance-abs-threshold", "10", "--balance-rel-threshold", "1.2",
        "--disable-circuit-breaker", "--disable-health-check", "--policy", "cache_aware",
        "--prometheus-duration-buckets", "0.1", "1", "--dp-aware", "--request-timeout-secs", "600"]
    assert router_options({})["request_timeout_secs"] == 14400  # slime's default
    # YAML: flat router-* keys, or nested under sglang
    yaml = load_stage_config("train", {"rollout-batch-size": 8, "num-rollout": 1, "router-policy": "random",
                                       "sglang": {"args": {"mem_fraction_static": 0.7}, "router": {"queue-size": 4}}})
    assert yaml.sglang.router == {"policy": "random", "queue_size": 4}
    assert yaml.sglang.args == {"mem_fraction_static": 0.7}


def test_the_router_takes_every_option_we_pass_it():
    """Our spelling (--router-X -> --X) against sglang-router's own parser: every option slimeflow sets parses."""
    import argparse

    from sglang_router.launch_router import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    parsed = parser.parse_args(["--worker-urls", "http://a:1", *to_flags(router_options({"dp_aware": True}, 60))])
    assert (parsed.policy, parsed.log_level, parsed.balance_abs_threshold, parsed.request_timeout_secs) == \
        ("round_robin", "warn", 10, 60)
    assert parsed.disable_circuit_breaker and parsed.disable_health_check and parsed.dp_aware


def test_flags_no_server_would_get_are_refused_by_name():
    c = config("--rollout-num-gpus", "2", "--sglang-mem-fraction-static", "0.7", "--sglang-tp-size", "2",
               "--router-policy", "random", "--router-polcy", "random", "--router-api-key", "k")
    embedded = flag_problems(c, sglang_server_args=None)
    assert embedded == [
        "--sglang-tp-size: not taken (set by slimeflow from --rollout-num-gpus-per-engine (divided by "
        "--sglang-pp-size)); remove it",
        "--sglang-mem-fraction-static: an SGLang server argument, but no SGLang server is launched here (the engines "
        "are servers started elsewhere, or the embedded engine, which takes none, where SGLang is not installed); "
        "install SGLang on a GPU cluster, or start your SGLang servers with it and pass "
        "--rollout-external-engine-addrs",
        "--router-api-key: not supported (the router takes the engines' key: the run's own, or --sglang-api-key for "
        "external servers); remove it",
        "--router-polcy: sglang-router has no --polcy option; did you mean --router-policy?"]
    assert flag_problems(c, SGLANG_ARGS) == [embedded[0], *embedded[2:]]  # passed to SGLang when there
    one_engine = flag_problems(config("--router-policy", "random"), sglang_server_args=SGLANG_ARGS)
    assert one_engine == ["--router-policy: no sglang-router of slimeflow's would get it (with one engine no router "
                          "is started); remove it"]


def test_external_engines_and_their_router():
    c = config("--rollout-external-engine-addrs", "10.0.0.1:30000", "http://10.0.0.2:30000",
               "--sglang-mem-fraction-static", "0.7", "--router-policy", "random")
    assert c.placement.rollout_external_engine_addrs == ["10.0.0.1:30000", "http://10.0.0.2:30000"]
    problems = flag_problems(c, SGLANG_ARGS)
    assert problems[0].startswith("--sglang-mem-fraction-static: an SGLang server argument, but no SGLang server is "
                                  "launched here")
    assert problems[1].startswith("external SGLang servers need --sglang-weights-dir DIR") and len(problems) == 2
    both = config("--rollout-external-engine-addrs", "a:1", "--sglang-worker-urls", "http://a:1",
                  "--sglang-weights-dir", "/w")
    assert flag_problems(both, None)[0].startswith("--rollout-external-engine-addrs and --sglang-worker-urls both")
    theirs = config("--rollout-external-engine-addrs", "a:1", "b:2", "--sglang-weights-dir", "/w",
                    "--sglang-router-ip", "r", "--sglang-router-port", "1", "--router-policy", "random")
    assert flag_problems(theirs, None) == ["--router-policy: no sglang-router of slimeflow's would get it (the "
                                            "router is yours (--sglang-router-ip)); remove it"]
    launched = flag_problems(config("--sglang-router-ip", "r", "--sglang-router-port", "1"), None)
    assert launched[0].startswith("--sglang-router-ip/--sglang-router-port name a router of yours, but the engines "
                                  "are launched here")

    from slimeflow.stages.train.engines import EngineSet

    ok = config("--rollout-external-engine-addrs", "10.0.0.1:30000", "http://10.0.0.2:30000/",
                "--sglang-weights-dir", "/w")
    launch = EngineSet.launch("hf", ok.sglang.args, 1, external_addrs=ok.placement.rollout_external_engine_addrs)
    assert launch.external.worker_urls == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert launch.router["policy"] == "round_robin"  # a router of ours goes in front of the two (at ready())
    with pytest.raises(ValueError, match="external engine address 'nohost': write it as host:port"):
        EngineSet.launch("hf", ok.sglang.args, 1, external_addrs=["nohost"])



def test_sglang_flags_are_checked_against_the_installed_servers_arguments():
    assert server_arg_problems({"mem_fraction_static": "0.7", "max_running_request": "8", "tp_size": "2"},
                               SGLANG_ARGS) == [
        "--sglang-max-running-request: the installed SGLang's server has no --max-running-request argument; did you "
        "mean --sglang-max-running-requests?"]  # tp_size is refused on its own (set by slimeflow)


def test_the_weights_reach_sglang_servers_launched_here_only_in_sglangs_formats():
    """Colocated SGLang servers take SGLang's /update_weights_from_tensor body (handles, node-local: refused for
    engines on other nodes than trainer rank 0); disaggregated ones its broadcast group (nccl) or disk
    (--sglang-weights-dir); the embedded engine reads no weights directory, so that flag is refused there rather
    than ignored."""
    from slimeflow.stages.train.placement_plan import sglang_weight_problems

    default, nccl = config(), config("--update-weight-transport", "nccl")
    on_disk = config("--sglang-weights-dir", "/shared/weights")
    assert "--update-weight-transport nccl" in sglang_weight_problems(default, sglang_engines=True)[0]
    colocated = config("--colocate", "--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "4")
    assert sglang_weight_problems(colocated, sglang_engines=True) == []
    two_nodes = config("--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4",
                       "--num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2")
    assert "engines [2, 3] run on other nodes than trainer rank 0" in sglang_weight_problems(
        two_nodes, sglang_engines=True)[0]
    assert sglang_weight_problems(nccl, sglang_engines=True) == []
    assert sglang_weight_problems(on_disk, sglang_engines=True) == []
    both = config("--sglang-weights-dir", "/w", "--update-weight-transport", "nccl")
    assert "give one" in sglang_weight_problems(both, sglang_engines=True)[0]
    assert sglang_weight_problems(default, sglang_engines=False) == []
    assert "--sglang-weights-dir: read for SGLang servers" in sglang_weight_problems(on_disk, sglang_engines=False)[0]
    external = config("--sglang-worker-urls", "http://10.0.0.1:30000", "--sglang-weights-dir", "/w")
    assert sglang_weight_problems(external, sglang_engines=True) == []


def test_the_trainer_picks_the_transport_slime_uses_for_its_engines():
    """Colocated: SGLang servers take SGLang's tensor body of IPC handles, embedded engines a /dev/shm segment;
    apart: HTTP (embedded), or the flag's nccl; TP ranks per engine from --rollout-num-gpus-per-engine."""
    from types import SimpleNamespace

    from slimeflow.stages.train.engines import WeightTargets
    from slimeflow.stages.train.trainer import Trainer

    def chosen(sglang: bool, *flags: str) -> tuple[str, int]:
        actor = SimpleNamespace(config=config(*flags), hooks=SimpleNamespace(args=None))
        Trainer.connect_engines(actor, WeightTargets(("http://127.0.0.1:1",), "hf", sglang=sglang))
        actor.loop.close()
        return actor.weight_sync.transport, actor.weight_sync.tp_size

    colocated = ("--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus-per-engine", "2")
    assert chosen(True, *colocated) == ("ipc", 2)
    assert chosen(False, *colocated) == ("shared_memory", 2)
    assert chosen(False)[0] == "tensor" and chosen(True, "--update-weight-transport", "nccl")[0] == "distributed"


def test_engines_on_the_trainers_ray_node_take_shared_memory_by_default_and_others_http():
    """The default rests on the Ray node ids the engines were started on: all on trainer rank 0's node, the /dev/shm
    segment (colocated or not); one elsewhere, or a node not known, HTTP; colocation and external servers as before."""
    from slimeflow.stages.train.engines import WeightTargets
    from slimeflow.stages.train.weight_sync import default_transport

    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")

    def pick(node_ids: tuple[str, ...], colocate: bool = False, trainer: str | None = "n1", **more) -> str:
        return default_transport(WeightTargets(urls, "hf", node_ids=node_ids, **more), colocate, trainer)[0]

    assert pick(("n1", "n1")) == "shared_memory"
    assert pick(("n1", "n2")) == "tensor"  # one engine on another host
    assert pick(()) == "tensor" and pick(("n1", "n1"), trainer=None) == "tensor"  # not known: never guessed
    assert pick(("n1", "n1"), sglang=True) == "tensor"  # SGLang servers read no /dev/shm segment
    assert pick((), colocate=True) == "shared_memory" and pick((), colocate=True, sglang=True) == "ipc"
    assert pick(("n1", "n1"), weights_dir="/w") == "disk"
    why = default_transport(WeightTargets(urls, "hf", node_ids=("n1", "n2")), False, "n1")[1]
    assert "http://127.0.0.1:2" in why and "n1" in why


def test_the_transport_flag_overrides_the_default_and_the_choice_is_returned(monkeypatch, caplog):
    from types import SimpleNamespace

    from slimeflow.stages.train import trainer
    from slimeflow.stages.train.engines import WeightTargets
    from slimeflow.stages.train.placement_plan import sglang_weight_problems

    monkeypatch.setattr(trainer, "ray_node_id", lambda: "n1")
    here = WeightTargets(("http://10.0.0.5:1",), "hf", node_ids=("n1",))  # a node address, but this node

    def connect(*flags: str) -> dict[str, str]:
        actor = SimpleNamespace(config=config(*flags), hooks=SimpleNamespace(args=None))
        with caplog.at_level("INFO", logger=trainer.__name__):
            chosen = trainer.Trainer.connect_engines(actor, here)
        actor.loop.close()
        assert actor.weight_sync.transport == chosen["transport"]
        return chosen

    default = connect()
    assert default["transport"] == "shared_memory" and "n1" in default["reason"]
    assert f"weight sync: shared_memory ({default['reason']})" in caplog.text
    assert connect("--update-weight-transport", "http") == {"transport": "tensor",
                                                            "reason": "--update-weight-transport http"}
    assert connect("--update-weight-transport", "shared_memory")["transport"] == "shared_memory"
    monkeypatch.setattr(trainer, "ray_node_id", lambda: "n2")
    assert connect()["transport"] == "tensor"
    with pytest.raises(ValueError, match="trainer rank 0's host"):  # forced, with the engine on another node
        connect("--update-weight-transport", "shared_memory")
    assert sglang_weight_problems(config("--update-weight-transport", "http"), sglang_engines=True)
    assert not sglang_weight_problems(config("--update-weight-transport", "http"), sglang_engines=False)


def test_a_default_shared_memory_push_without_room_in_dev_shm_goes_over_http(monkeypatch):
    """Only a default choice falls back (logged); a shared_memory the flag asked for raises with the fix."""
    import asyncio

    from slimeflow.stages.train import weight_sync
    from slimeflow.stages.train.engines import WeightTargets

    def full(self, named_tensors):
        raise OSError(28, "/dev/shm has no room for a weight segment")

    sent = []

    async def send_tensors(self, part, version):
        sent.append((self.transport, version))

    monkeypatch.setattr(weight_sync.SegmentWriter, "begin", full)
    monkeypatch.setattr(weight_sync.WeightSync, "_send_tensors", send_tensors)
    targets = WeightTargets(("http://127.0.0.1:1",), "hf", node_ids=("n1",))
    sync = weight_sync.WeightSync(targets, transport="shared_memory", node_id="n1", fallback="tensor")
    assert asyncio.run(sync.push({"w": torch.ones(2)}, "1")) == "1"
    assert sent == [("tensor", "1")] and sync.transport == "tensor"
    forced = weight_sync.WeightSync(targets, transport="shared_memory", node_id="n1")
    with pytest.raises(OSError, match="no room"):
        asyncio.run(forced.push({"w": torch.ones(2)}, "1"))


def test_sglang_servers_launched_here_take_the_weights_directory_into_their_weight_targets():
    from types import SimpleNamespace

    from slimeflow.stages.train.engines import EngineSet

    served = SimpleNamespace(url="http://127.0.0.1:30000", wait_ready=lambda path, timeout: None, stop=lambda: None)
    for kind, expected in (("sglang", "/shared/weights"), ("embedded", None)):
        placed = SimpleNamespace(kind=kind, start=lambda hf, key, threads: [served])
        engines = EngineSet.launch("hf", {"weights_dir": "/shared/weights"}, 1, placed=placed).ready()
        assert engines.weight_targets().weights_dir == expected
        assert engines.weight_targets().sglang == (kind == "sglang")


def test_an_api_key_starting_with_a_dash_reaches_the_sglang_server_as_its_key(monkeypatch):
    """token_urlsafe draws a key starting with "-" once in 64; as `--api-key KEY` argparse took it for a flag (a
    fresh-clone run failed so: "argument --api-key: expected one argument")."""
    import argparse
    import runpy
    import sys

    from slimeflow.engine import sglang_launch

    monkeypatch.setenv(sglang_launch.SGLANG_API_KEY_ENV, "-dash-key")
    monkeypatch.setattr(sys, "argv", ["-c", "--port", "1"])
    seen = {}
    monkeypatch.setattr(runpy, "run_module", lambda name, run_name: seen.update(module=name, argv=list(sys.argv)))
    exec(sglang_launch._SGLANG_WITH_KEY)  # what `python -c` runs before SGLang's own argument parser
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    parser.add_argument("--port")
    assert seen["module"] == "sglang.launch_server" and parser.parse_args(seen["argv"][1:]).api_key == "-dash-key"
