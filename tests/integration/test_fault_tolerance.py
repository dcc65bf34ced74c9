"""Engine fault tolerance (issue 20, item 4): a RolloutManager (plain Python here, no Ray) with two embedded engines
behind sglang-router; one engine is SIGKILLed or SIGSTOPped mid-rollout.

With --use-fault-tolerance the rollout completes with every row exactly once, and the engine comes back at its URL
serving the weights the trainer last pushed. Without it, the rollout ends with an error naming the engine (never a
hang). One manager serves the slow tests (each engine's start-up costs ~5 CPU seconds; a restart another), which
run in file order; the quick tests after them need no engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import Counter

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from slimeflow.config.train import FaultToleranceConfig, TrainConfig
from slimeflow.engine.client import EngineClient, EngineRequestError, EngineUnavailableError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.rollout import rollout as rollout_module
from slimeflow.stages.train.engines import EngineDiedError, EngineSet, ReissuingClient, RoutedClient
from slimeflow.stages.train.fault_tolerance import HealthMonitor, recover, restore_weights
from slimeflow.stages.train.rollout_manager import RolloutSetup
from slimeflow.stages.train.rollouts import Rollouts
from slimeflow.stages.train.weight_sync import WeightSync

GROUPS, SAMPLES = 4, 2
CHECKS = {"rollout_health_check_interval": 0.5, "rollout_health_check_timeout": 5.0}


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    model = build_tiny_model(root / "tiny", TinyModelSpec(seed=3))
    rows = [{"row_id": f"row-{i}", "prompt": f"count to {i}:", "label": str(i), "metadata": "{}", "tools": None,
             "prompt_tokens": None} for i in range(GROUPS * 3)]
    pq.write_table(pa.Table.from_pylist(rows), root / "prompts.parquet")
    config = TrainConfig.model_validate({
        "batch": {"rollout_batch_size": GROUPS, "n_samples_per_prompt": SAMPLES, "num_rollout": 3},
        "rollout": {"rollout_max_response_len": 48}, "reward": {"rm_type": "prefix_match"},
        "placement": {"rollout_num_gpus": 2},
        "fault_tolerance": {"use_fault_tolerance": True, **CHECKS}})
    rollouts = Rollouts(config, RolloutSetup(str(model), str(root / "prompts.parquet"), {}, num_engines=2,
                                             engine_threads=1, concurrency=64))
    try:
        yield rollouts
    finally:
        rollouts.shutdown()


def push(manager, version: str) -> dict[str, torch.Tensor]:
    """The trainer's push: every engine serves `version`, weights nudged off the checkpoint's."""
    async def once():
        snapshot, _ = await EngineClient(manager.engines.worker_urls[1], api_key=manager.engines.api_key
                                         ).weights_snapshot()
        nudged = {name: t + 1e-3 for name, t in snapshot.items()}
        sync = WeightSync(manager.weight_targets())
        await sync.push(nudged, version)
        await sync.aclose()
        return nudged
    return asyncio.run(once())


def strike(manager, rank: int, sig: signal.Signals, monkeypatch) -> threading.Thread:
    """Send `sig` to engine `rank`'s process once it has requests running (from a thread: the rollout runs here).

    The rollout cannot return before the signal is sent and the health checks have seen it: under load, engine
    `rank` could otherwise finish its share (and the rollout end) between the busy check and the signal, or before a
    check, and no health check would see the engine lost. And the signal goes at once when the rollout has generated
    everything before a poll saw the engine busy (a fast share), rather than after the poll's deadline."""
    engine = manager.engines.processes[rank]
    headers = {"Authorization": f"Bearer {manager.engines.api_key}"}
    sent, generated = threading.Event(), threading.Event()
    recovered = len(manager.monitor.recoveries)

    def noticed() -> bool:
        """The health checks saw the engine lost: restarted it (with fault tolerance) or failed the rollout."""
        return manager.monitor.failure is not None or len(manager.monitor.recoveries) > recovered

    def when_busy():
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline and not generated.is_set():
                info = httpx.get(engine.url + "/get_model_info", headers=headers, timeout=5).json()
                if info["running"] > 0:
                    break
                time.sleep(0.005)
            os.kill(engine.process.pid, sig)
        finally:
            sent.set()

    unsent = rollout_module.generate_rollout

    async def until_sent(*args, **kwargs):
        result = await unsent(*args, **kwargs)
        generated.set()
        # Held open, as a longer rollout would be, until the health checks have seen the strike: a fast engine can
        # finish its share before the signal lands (cancellable: a failed health check cancels the rollout here).
        deadline = time.monotonic() + 60
        while not sent.is_set() or (not noticed() and time.monotonic() < deadline):
            await asyncio.sleep(0.01)
        return result

    monkeypatch.setattr(rollout_module, "generate_rollout", until_sent)
    thread = threading.Thread(target=when_busy, daemon=True)
    thread.start()
    return thread


def every_row_once(row_ids: list[list[str]]) -> None:
    counts = Counter(tuple(group) for group in row_ids)
    assert len(row_ids) == GROUPS and all(len(group) == SAMPLES and len(set(group)) == 1 for group in row_ids)
    assert all(n == 1 for n in counts.values()), counts


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_an_engine_lost_mid_rollout_is_restarted_with_the_pushed_weights_and_the_rollout_completes(manager, sig,
                                                                                                  monkeypatch):
    rollout_id = {signal.SIGKILL: 0, signal.SIGSTOP: 1}[sig]
    pushed = push(manager, str(rollout_id))
    old_pid = manager.engines.processes[0].process.pid
    striking = strike(manager, 0, sig, monkeypatch)
    before = len(manager.monitor.recoveries)
    _, metrics, row_ids = manager.generate(rollout_id)
    striking.join()
    every_row_once(row_ids)
    assert metrics["rollout/weight_version_min"] == metrics["rollout/weight_version_max"] == rollout_id
    recovery = manager.monitor.recoveries[before]
    assert len(manager.monitor.recoveries) == before + 1 and recovery.rank == 0 and recovery.weights_from == "peer"
    assert ("hung" in recovery.reason) == (sig == signal.SIGSTOP), recovery.reason
    assert manager.engines.processes[0].process.pid != old_pid
    # Back at its URL, in the router, serving the pushed weights and version (the trainer's, not a copy of itself).
    restarted = manager.engines.worker_urls[0]
    served, version = asyncio.run(EngineClient(restarted, api_key=manager.engines.api_key).weights_snapshot())
    assert version == str(rollout_id) and all(torch.equal(served[n], pushed[n]) for n in pushed)
    workers = httpx.get(manager.engines.rollout_url + "/workers", timeout=5,
                        headers={"Authorization": f"Bearer {manager.engines.api_key}"}).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(manager.engines.worker_urls)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["hung", "killed"])
def test_without_fault_tolerance_a_lost_engine_ends_the_rollout_with_an_error_naming_it(manager, sig, monkeypatch):
    """sglang-router would hide a killed engine (it re-sends the request elsewhere) and wait hours on a stopped one;
    the health checks end the rollout instead."""
    manager.monitor.settings = FaultToleranceConfig(use_fault_tolerance=False, **CHECKS)
    manager.monitor.failure = None
    if manager.engines.processes[1].exit_report() is not None:  # the hung case's engine: bring it back first
        recover(manager.engines, 1, "killed by the previous test")
    rollout_id = {signal.SIGSTOP: 2, signal.SIGKILL: 3}[sig]
    push(manager, str(rollout_id))
    url = manager.engines.worker_urls[1]
    striking = strike(manager, 1, sig, monkeypatch)
    started = time.monotonic()
    with pytest.raises(EngineDiedError) as died:
        manager.generate(rollout_id)
    striking.join()
    assert time.monotonic() - started < 60
    message = str(died.value)
    assert f"rollout engine 1 at {url} failed its health check" in message and "--use-fault-tolerance" in message
    assert ("hung" in message) == (sig == signal.SIGSTOP), message
    assert "was killed by signal 9" in message and "log tail" in message


class Flaky:
    """An engine client whose generate fails with `errors` in turn, then answers."""

    url = "http://127.0.0.1:1"

    def __init__(self, *errors: Exception):
        self.errors, self.calls = list(errors), 0

    async def generate(self, input_ids, params, *, return_logprob=True, rid=None):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return {"text": "ok", "rid": rid}

    async def abort(self, rid=None):
        if self.errors:
            raise self.errors.pop(0)
        return {}


def test_a_generate_whose_engine_died_is_sent_again_and_a_refused_one_is_not():
    died = Flaky(EngineUnavailableError("connection reset"), EngineRequestError(502, "no worker"))
    reissuing = ReissuingClient(died, patience_s=30, pause_s=0)
    assert asyncio.run(reissuing.generate([1], {}, rid="r")) == {"text": "ok", "rid": "r"}
    assert died.calls == 3 and reissuing.reissued == 2
    refused = Flaky(EngineRequestError(400, "bad prompt"))
    with pytest.raises(EngineRequestError, match="bad prompt"):
        asyncio.run(ReissuingClient(refused, patience_s=30, pause_s=0).generate([1], {}))
    assert refused.calls == 1
    failing = Flaky(*[EngineRequestError(500, "internal engine error")] * 10)
    with pytest.raises(EngineRequestError, match="internal"):  # an engine error that repeats is the rollout's
        asyncio.run(ReissuingClient(failing, patience_s=30, pause_s=0).generate([1], {}))
    assert failing.calls == 1 + ReissuingClient.server_errors
    gone = Flaky(*[EngineUnavailableError("down")] * 3)
    with pytest.raises(EngineUnavailableError):  # past its patience the rollout hears of it
        asyncio.run(ReissuingClient(gone, patience_s=0, pause_s=0).generate([1], {}))


def test_an_abort_skips_an_engine_being_restarted_only_under_fault_tolerance():
    workers = lambda: [Flaky(), Flaky(EngineUnavailableError("restarting"))]  # noqa: E731
    asyncio.run(RoutedClient(Flaky(), workers(), tolerate_down=True).abort())
    with pytest.raises(EngineUnavailableError):
        asyncio.run(RoutedClient(Flaky(), workers()).abort())
    with pytest.raises(EngineRequestError):
        asyncio.run(RoutedClient(Flaky(), [Flaky(EngineRequestError(500, "x"))], tolerate_down=True).abort())


def test_what_fault_tolerance_cannot_restart_is_refused_at_parse_and_the_rest_is_taken():
    base = {"batch": {"rollout_batch_size": 2, "num_rollout": 1}, "fault_tolerance": {"use_fault_tolerance": True}}
    external = {"placement": {"rollout_num_gpus": 2, "rollout_external_engine_addrs": ["127.0.0.1:1"]}}
    with pytest.raises(ValueError, match="--use-fault-tolerance with --rollout-external-engine-addrs / "
                                         "--sglang-worker-urls: servers started elsewhere"):
        TrainConfig.model_validate({**base, **external})
    assert TrainConfig.model_validate({**base, **external, "fault_tolerance": {}}).fault_tolerance.rollout_health_check_interval == 30
    # A restarted engine gets the trainer's weights: one engine, and a weight-update group, are fine.
    for flags in ({"placement": {"rollout_num_gpus": 1}}, {"weight_sync": {"update_weight_transport": "nccl"}}):
        assert TrainConfig.model_validate({**base, **flags}).fault_tolerance.use_fault_tolerance
    # ...as a process of its own, which can be killed and restarted (not a thread of the rollout manager)
    assert not TrainConfig.model_validate(base).placement.engine_in_process
    with pytest.raises(ValueError, match="--use-fault-tolerance with --engine-in-process: an engine serving from a"):
        TrainConfig.model_validate({**base, "placement": {"engine_in_process": True}})


class Placed:
    """An engine handle as the monitor sees it (engine_actor.PlacedEngine's kind)."""

    kind = "engine"

    def __init__(self, engine_kind: str):
        self.engine_kind = engine_kind


def test_a_restarted_engine_without_an_embedded_peer_gets_the_trainers_weights():
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    sglang = EngineSet(urls, "http://127.0.0.1:3", "/model", processes=[Placed("sglang"), Placed("sglang")])
    asked = []

    def trainer(targets, version):
        asked.append((targets, version))
        return version

    # SGLang servers offer no snapshot to copy: the trainer pushes the rollout's version to the restarted one only.
    assert restore_weights(sglang, 1, "killed", "4", trainer) == ("4", "trainer") and asked == [([urls[1]], "4")]
    lone = EngineSet(urls[:1], urls[0], "/model", processes=[Placed("embedded")])
    assert restore_weights(lone, 0, "killed", "4", trainer) == ("4", "trainer")
    assert restore_weights(lone, 0, "killed", None, None) == (None, "none")  # nothing pushed: the checkpoint it is
    with pytest.raises(EngineDiedError, match="no live engine serves weight version 4 .* no trainer"):
        restore_weights(lone, 0, "killed", "4", None)


def test_a_lone_engines_requests_wait_for_its_recovery():
    """Without a router a restarted engine is reached directly: nothing is sent until it has the current weights."""
    engines = EngineSet(["http://127.0.0.1:1"], "http://127.0.0.1:1", "/model", reissue_s=30.0)
    engines.recovering = True
    client = engines.client().rollout
    sent = Flaky()
    client.client, client.pause_s = sent, 0.01

    async def recovered_later():
        waiting = asyncio.ensure_future(client.generate([1], {}, rid="r"))
        await asyncio.sleep(0.1)
        assert sent.calls == 0 and not waiting.done()
        engines.recovering = False
        return await waiting

    assert asyncio.run(recovered_later()) == {"text": "ok", "rid": "r"} and sent.calls == 1
    routed = EngineSet(["http://127.0.0.1:1", "http://127.0.0.1:2"], "http://127.0.0.1:3", "/model", reissue_s=30.0)
    assert routed.client().rollout.gate is None  # behind a router it rejoins only once it serves them


def test_the_monitor_leaves_servers_started_elsewhere_alone():
    """External servers (behind a router this run started) are not this run's to kill or restart."""
    class Router:
        kind = "router"

        def restart(self):
            raise AssertionError("the router is not an engine")

    engines = EngineSet(["http://127.0.0.1:1", "http://127.0.0.1:2"], "http://127.0.0.1:3", "/model",
                        processes=[Router()])
    monitor = HealthMonitor(engines, FaultToleranceConfig(rollout_health_check_interval=0.01))
    with monitor.watching():
        assert monitor._thread is None
    assert monitor.recoveries == [] and monitor.failure is None


def test_the_trainer_gives_a_restarted_engine_only_the_version_it_last_pushed():
    """TrainActor.push_to pushes its kept copy of the last push; asked for another version (its weights moved on, or
    nothing was pushed yet) it refuses rather than hand the engine weights the rollout did not run on."""
    from types import SimpleNamespace

    from slimeflow.stages.train.trainer import Trainer

    for pushed, last in ((None, "last pushed none"), (("3", {}), "last pushed version 3")):
        with pytest.raises(RuntimeError, match=f"needs weight version 4, but trainer rank 0 {last}"):
            Trainer.push_to(SimpleNamespace(pushed=pushed), ["http://127.0.0.1:1"], "4")
