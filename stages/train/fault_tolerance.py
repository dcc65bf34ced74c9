"""Engine health checks while a rollout or an evaluation runs, and recovery of a dead or hung engine, as slime's
RolloutHealthMonitor (slime/utils/health_monitor.py) with --use-fault-tolerance.

The monitor asks every engine this run started for `/health_generate` (one generated token) every
--rollout-health-check-interval seconds, after --rollout-health-check-first-wait, and gives each
--rollout-health-check-timeout seconds to answer. It runs only while the RolloutManager generates or evaluates
(`watching`), and once more at its end and before each weight push (`check_now`, as slime recovers its engines
before a push): weights are pushed between rollouts only, so the weights a live engine serves are the current ones.

An engine that does not answer (its process died, or it hangs: SIGSTOP, a stuck kernel) is:
- with --use-fault-tolerance: taken out of sglang-router, killed, started again on the same port (on its bundle,
  through its EngineActor when it has one), given the weight version the rollout runs on, and put back. The weights
  come, as slime's restarted engines get them, from the trainer (TrainActor.push_to: the weights it last pushed,
  through the transport in use; with the distributed one the engine joins a group of its own, and the trainer's
  next push makes a new group of every engine, as slime reconnects its new engines). One shortcut stays: a
  restarted embedded engine copies a live embedded peer that serves that version (GET /get_weights_snapshot, ours
  only), which needs no trainer (with --async the trainer is busy training while the rollout runs).
  Its requests in flight fail when it is killed and are sent again (engines.ReissuingClient) only to engines at the
  rollout's version: it joins the router again only once it serves it, and a lone engine (no router) takes no
  request until then. A request answered once is never sent again, so no sample is lost or counted twice.
- without: killed, and the rollout is cancelled and ends with EngineDiedError naming the engine, why and its log
  tail (never a hang: the router would otherwise wait on a stopped engine for hours).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from slimeflow.engine.client import EngineClient
from slimeflow.engine.launch import ENGINE_READY_TIMEOUT_S
from slimeflow.engine.sglang_launch import SGLANG_READY_TIMEOUT_S
from slimeflow.stages.train.engines import EngineDiedError

if TYPE_CHECKING:
    from slimeflow.config.train import FaultToleranceConfig
    from slimeflow.stages.train.engines import EngineSet

log = logging.getLogger("slimeflow.fault_tolerance")


@dataclass(frozen=True)
class Recovery:
    """One engine brought back: its rank and URL, why it was restarted, and the seconds from its failed check to
    serving again (back in the router, with the weight version the live engines serve)."""

    rank: int
    url: str
    reason: str
    seconds: float
    weight_version: str | None
    phases: dict[str, float]
    """Seconds of each step: router_out, restart (until /health answers), weights, router_in."""
    weights_from: str = "peer"
    """Where its weights came from: "peer" (a live embedded engine's copy), "trainer" (TrainActor.push_to) or "none"
    (no version to restore: nothing was pushed, it serves the checkpoint as every engine does)."""


class HealthMonitor:
    """Checks the engines of `engines` that this run started while `watching()`; restarts a failed one
    (`settings.use_fault_tolerance`) or kills it and calls `on_failure` with the reason (else)."""

    def __init__(self, engines: EngineSet, settings: FaultToleranceConfig,
                 on_failure: Callable[[str], None] | None = None):
        self.engines, self.settings, self.on_failure = engines, settings, on_failure
        self.recoveries: list[Recovery] = []
        self.weight_version: str | None = None
        """The version the engines serve (the rollout's; set by the RolloutManager): what a restarted one must get."""
        self.from_trainer: WeightSource | None = None
        """Pushes the trainer's last pushed weights to engine URLs as a version (None: no trainer, peers only)."""
        self.restarted: list[str] = []
        """Engines restarted since `take_restarted`: the trainer's next push regroups them (weight_sync.regroup)."""
        self.failure: str | None = None
        """Why the monitor gave up on an engine: killed without --use-fault-tolerance, or not restartable with it
        (None: it has not)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def reissue_patience_s(self) -> float:
        """How long a request whose engine died is sent again before the rollout gives up: a full check cycle plus
        an engine's start-up (what a recovery takes at worst; an SGLang server loads a large model for minutes)."""
        s = self.settings
        sglang = any(getattr(p, "engine_kind", "") == "sglang" for p in self.engines.processes)
        return s.rollout_health_check_first_wait + s.rollout_health_check_interval + \
            s.rollout_health_check_timeout * len(self.engines.worker_urls) + \
            (SGLANG_READY_TIMEOUT_S if sglang else ENGINE_READY_TIMEOUT_S)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Check the engines in a thread while the block runs; on leaving, wait for a recovery under way to end and
        check every engine once more (one lost after the last check is restarted, or named, now: the next weight
        push must find every engine up)."""
        if not self._restartable():
            yield
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="engine-health-monitor", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.check_now()

    def check_now(self) -> None:
        """Check every engine once, here and now, restarting (or naming) a failed one: as slime recovers its engines
        before each weight push, so that an engine lost between rollouts does not fail the push."""
        if self._restartable() and self.failure is None:
            with self._client() as http:
                self._check_all(http, final=True)

    def take_restarted(self) -> list[str]:
        """The URLs of the engines restarted since the last call (before each push, as slime's num_new_engines)."""
        restarted, self.restarted = self.restarted, []
        return restarted

    def _restartable(self) -> bool:
        """Whether this run started every engine as a process it can kill and restart (external servers, whose
        processes here are at most our router, and an engine in this process are left alone)."""
        handles = [p for p in self.engines.processes if getattr(p, "kind", "") == "engine" and hasattr(p, "restart")]
        return 0 < len(handles) == len(self.engines.worker_urls)

    def _client(self) -> httpx.Client:
        return httpx.Client(timeout=self.settings.rollout_health_check_timeout, headers=_auth(self.engines.api_key),
                            verify=False)

    def _loop(self) -> None:
        if self._stop.wait(self.settings.rollout_health_check_first_wait):
            return
        with self._client() as http:
            while self._check_all(http) and not self._stop.wait(self.settings.rollout_health_check_interval):
                pass

    def _check_all(self, http: httpx.Client, final: bool = False) -> bool:
        """Check every engine (restarting or naming a failed one); False once stopped or given up."""
        for rank, url in enumerate(self.engines.worker_urls):
            if self._stop.is_set() and not final:
                return False
            reason = check(http, url)
            if reason is not None:
                self._failed(rank, reason)
                if self.failure is not None:
                    return False
        return True

    def _failed(self, rank: int, reason: str) -> None:
        handle = self.engines.processes[rank]
        if not self.settings.use_fault_tolerance:
            handle.kill()  # a hung engine holds its requests for as long as the router waits: hours
            report = handle.exit_report(5.0) if hasattr(handle, "exit_report") else None
            self._give_up(f"rollout engine {rank} at {self.engines.worker_urls[rank]} failed its health check "
                          f"({reason}) and was killed (--use-fault-tolerance would restart it)"
                          + (f":\n{report}" if report else ""))
            return
        log.warning("rollout engine %d at %s failed its health check (%s): restarting it", rank,
                    self.engines.worker_urls[rank], reason)
        try:
            self.recoveries.append(recover(self.engines, rank, reason, self.weight_version, self.from_trainer))
            self.restarted.append(self.engines.worker_urls[rank])
        except Exception as err:  # the rollout must end with this reason, not wait for the engine
            self._give_up(f"rollout engine {rank} at {self.engines.worker_urls[rank]} failed its health check "
                          f"({reason}) and could not be restarted: {type(err).__name__}: {err}")
            return
        log.warning("rollout engine %d is serving again after %.1f s", rank, self.recoveries[-1].seconds)

    def _give_up(self, failure: str) -> None:
        self.failure = failure
        log.error(failure)
        if self.on_failure is not None:
            self.on_failure(failure)


def check(http: httpx.Client, url: str) -> str | None:
    """None when the engine at `url` generates a token in time, else why not."""
    try:
        response = http.get(url + "/health_generate")
    except httpx.TimeoutException:
        return f"no answer to /health_generate within {http.timeout.read} s: hung"
    except httpx.HTTPError as err:
        return f"/health_generate failed: {type(err).__name__}: {err}"
    if response.status_code != 200:
        return f"/health_generate answered {response.status_code}: {response.text[:200]}"
    return None


WeightSource = Callable[[list[str], str], str]
"""(engine URLs, version) -> the version they serve after the trainer pushed to them."""


def recover(engines: EngineSet, rank: int, reason: str, version: str | None = None,
            from_trainer: WeightSource | None = None) -> Recovery:
    """Take engine `rank` out of the router, restart it at its URL, give it weight `version` (restore_weights), and
    put it back. While it runs, a lone engine's rollout client holds its requests (`engines.recovering`)."""
    started = time.monotonic()
    phases: dict[str, float] = {}

    def step(name: str) -> None:
        phases[name] = time.monotonic() - started - sum(phases.values())

    url, handle = engines.worker_urls[rank], engines.processes[rank]
    engines.recovering = True
    try:
        if engines.routed:
            _leave_router(engines, url)
        step("router_out")
        handle.restart()
        handle.wait_ready("/health", ENGINE_READY_TIMEOUT_S)
        step("restart")
        served, source = restore_weights(engines, rank, reason, version, from_trainer)
        step("weights")
        if engines.routed:
            _join_router(engines, url)
        step("router_in")
    finally:
        engines.recovering = False
    return Recovery(rank, url, reason, time.monotonic() - started, served, phases, source)


def restore_weights(engines: EngineSet, rank: int, reason: str, version: str | None,
                    from_trainer: WeightSource | None) -> tuple[str | None, str]:
    """Give restarted engine `rank` weight `version`: a live embedded peer's copy when one serves it (no trainer
    involved: the quickest mid-rollout), else the trainer's push. (served version, "peer" | "trainer" | "none");
    raises EngineDiedError when neither can. `version` None: nothing was pushed, so the checkpoint it loaded is what
    every engine serves, unless a peer says otherwise (its copy is taken then)."""
    url = engines.worker_urls[rank]
    embedded = [getattr(p, "engine_kind", "embedded") == "embedded" for p in engines.processes[:len(engines.worker_urls)]]
    peers = [u for i, u in enumerate(engines.worker_urls) if u != url and embedded[i]] if embedded[rank] else []
    copied = asyncio.run(_copy_weights(peers, url, engines.api_key, version)) if peers else None
    if copied is not None:
        return copied, "peer"
    if version is None:
        return None, "none"
    if from_trainer is None:
        raise EngineDiedError(f"rollout engine {rank} at {url} was restarted ({reason}), but no live engine serves "
                              f"weight version {version} to copy and no trainer is connected to push it")
    return from_trainer([url], version), "trainer"


async def _copy_weights(peers: list[str], target: str, api_key: str | None, version: str | None) -> str | None:
    """The weights and version of the first peer that answers with `version` (any, when None), into `target`; None
    when none does."""
    async with EngineClient(target, api_key=api_key) as into:
        for peer in peers:
            async with EngineClient(peer, api_key=api_key, retries=0) as source:
                try:
                    tensors, served = await source.weights_snapshot()
                except (ConnectionError, RuntimeError) as err:
                    log.warning("could not copy weights from %s: %s", peer, err)
                    continue
            if version is not None and served != version:
                log.warning("not copying weights from %s: it serves version %s, not %s", peer, served, version)
                continue
            await into.update_weights_from_tensor(tensors, served)
            return served
    return None


def _leave_router(engines: EngineSet, worker_url: str) -> None:
    """Take `worker_url` out of sglang-router (DELETE /workers/{id}) and wait until it is no longer listed."""
    with _router_client(engines) as http:
        for worker in _listed(http, worker_url):
            http.delete(f"/workers/{worker['id']}").raise_for_status()
        _wait_listed(http, worker_url, False)


def _join_router(engines: EngineSet, worker_url: str) -> None:
    """Put `worker_url` back into sglang-router (POST /workers) and wait until it is listed."""
    with _router_client(engines) as http:
        if not _listed(http, worker_url):
            http.post("/workers", json={"url": worker_url}).raise_for_status()
        _wait_listed(http, worker_url, True)


def _router_client(engines: EngineSet) -> httpx.Client:
    return httpx.Client(base_url=engines.rollout_url, headers=_auth(engines.api_key), timeout=10.0, verify=False)


def _listed(http: httpx.Client, worker_url: str) -> list[dict[str, Any]]:
    response = http.get("/workers")
    response.raise_for_status()
    return [w for w in response.json().get("workers", []) if w.get("url") == worker_url]


def _wait_listed(http: httpx.Client, worker_url: str, listed: bool, timeout_s: float = 30.0) -> None:
    """The router adds and removes workers in the background: poll its list until it shows the change."""
    deadline = time.monotonic() + timeout_s
    while bool(_listed(http, worker_url)) != listed:
        if time.monotonic() > deadline:
            raise RuntimeError(f"sglang-router at {http.base_url} still {'lacks' if listed else 'lists'} worker "
                               f"{worker_url} after {timeout_s:.0f} s")
        time.sleep(0.05)


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
