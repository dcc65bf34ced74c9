"""The rollout engines of a run: embedded engines started here (the real sglang-router in front of two or more),
or external SGLang servers (`--sglang-worker-urls URL ...`, optionally `--sglang-router-ip/--sglang-router-port`).

Rollouts go to one URL (the router's, or the only engine's). Weights go from the trainer straight to every engine
(weight_sync.WeightSync in the TrainActor that holds them, as slime's actor pushes to its engines; `WeightTargets`
says where). HTTP clients are kept for the life of the run (a new one per call cost a TLS context and a TCP
connection every rollout).

Every client carries the run's API key: a new one for the embedded engines (and the router) of each run, or
`--sglang-api-key` for external SGLang servers and router started with `--api-key`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from slimeflow.engine.client import EngineClient, EngineRequestError, EngineUnavailableError
from slimeflow.engine.launch import (
    ENGINE_READY_TIMEOUT_S,
    launch_engine,
    launch_engine_thread,
    new_api_key,
    start_router,
)
from slimeflow.engine.sglang_launch import router_options

if TYPE_CHECKING:
    from slimeflow.stages.train.placement_group import EnginePlacement


@dataclass(frozen=True)
class WeightTargets:
    """Where a trainer pushes its weights: every engine's URL and, for external SGLang servers, the directory they
    load from (None: embedded engines, which take tensors over HTTP). Small and picklable, for a Ray call."""

    worker_urls: tuple[str, ...]
    hf_checkpoint: str
    weights_dir: str | None = None
    api_key: str | None = field(default=None, repr=False)
    sglang: bool = False
    """The engines are SGLang servers launched here: they read SGLang's weight formats only."""
    node_ids: tuple[str, ...] = ()
    """The Ray node each engine runs on, in worker_urls' order (empty: not known, as for external servers); the
    weight sync's choice of a same-host transport rests on it."""


class EngineDiedError(RuntimeError):
    """An engine (or router) process this run started has exited; the message names it and its log tail."""


@dataclass
class EngineSet:
    """Engine URLs, the URL rollouts use, and the processes this run started (stopped by `stop`)."""

    worker_urls: list[str]
    rollout_url: str
    hf_checkpoint: str
    weights_dir: str | None = None
    processes: list[Any] = field(default_factory=list)
    api_key: str | None = field(default=None, repr=False)
    sglang: bool = False
    """SGLang servers launched here (WeightTargets.sglang)."""
    reissue_s: float | None = None
    """With --use-fault-tolerance: for how long a generate whose engine died is sent again (ReissuingClient)."""
    recovering: bool = False
    """An engine is being restarted and given the current weights (fault_tolerance.recover): a lone engine, which
    rollouts reach without a router, must take no request until it has them."""
    _client: RoutedClient | None = field(default=None, init=False, repr=False)

    @classmethod
    def start(cls, hf_checkpoint: str, sglang_args: Mapping[str, Any], num_engines: int,
              threads: int | None = None) -> EngineSet:
        """External servers when --sglang-worker-urls is given, else `num_engines` embedded engines."""
        return cls.launch(hf_checkpoint, sglang_args, num_engines, threads).ready()

    @classmethod
    def launch(cls, hf_checkpoint: str, sglang_args: Mapping[str, Any], num_engines: int,
               threads: int | None = None, in_process: bool = False, *, placed: EnginePlacement | None = None,
               router_args: Mapping[str, Any] | None = None, external_addrs: list[str] | None = None) -> EngineLaunch:
        """`start` in two halves: this one checks the flags and starts every embedded engine's process without
        waiting; the returned launch's `ready()` waits for them (and starts the router). The caller's own set-up
        can run in between, while the engines import and load. `in_process`: a single embedded engine serves
        from a thread of this process instead (launch.launch_engine_thread). `placed`: the engines are Ray actors
        on placement-group bundles instead (placement_group.EnginePlacement), as many as it has bundles.
        `router_args`: the --router-* flags of the sglang-router started in front of two or more engines.
        `external_addrs`: --rollout-external-engine-addrs, servers started elsewhere (as --sglang-worker-urls)."""
        router = router_options(router_args or {}, sglang_args.get("router_request_timeout_secs"))
        external = external_addrs or sglang_args.get("worker_urls")
        if external:
            # The command line gives one string or a list, YAML a string or a list.
            urls = [_engine_url(u) for u in (external.split() if isinstance(external, str) else external)]
            weights_dir = sglang_args.get("weights_dir")
            if not weights_dir:
                raise ValueError("--sglang-worker-urls needs --sglang-weights-dir DIR: a directory every SGLang "
                                 "server can read, where the trainer writes the weights it pushes")
            key = sglang_args.get("api_key")
            given_router = _router_url(sglang_args)
            external_set = cls(urls, given_router or urls[0], hf_checkpoint, str(weights_dir),
                               api_key=str(key) if key else None)
            # As slime: a router of ours in front of several servers, unless one is given.
            return EngineLaunch(hf_checkpoint, external=external_set, router=router if not given_router else None)

        key = sglang_args.get("api_key")
        launching = EngineLaunch(hf_checkpoint, api_key=str(key) if key else new_api_key(), router=router)
        if placed is not None:
            launching.processes = placed.start(hf_checkpoint, launching.api_key, threads)
            if placed.kind == "sglang":  # SGLang servers launched here load each version from there (disk sync)
                launching.weights_dir = sglang_args.get("weights_dir")
                launching.sglang = True
            return launching
        options: dict[str, Any] = {"api_key": launching.api_key, **({"num_threads": threads} if threads else {})}
        start = launch_engine_thread if in_process and num_engines == 1 else launch_engine
        try:
            for _ in range(num_engines):
                launching.processes.append(start(hf_checkpoint, **options))
        except BaseException:
            launching.cancel()
            raise
        return launching

    @property
    def routed(self) -> bool:
        """Whether rollouts go through sglang-router, which takes one request per sample: its batch form allows
        only one sampling_params for every prompt, and each sample needs its own seed."""
        return self.rollout_url not in self.worker_urls

    async def check_health(self) -> None:
        """Every engine and the rollout URL answer /health (EngineUnavailableError names the one that does not)."""
        urls = dict.fromkeys([*self.worker_urls, self.rollout_url])
        await asyncio.gather(*(EngineClient(url, api_key=self.api_key, retries=2).health() for url in urls))

    def client(self) -> RoutedClient:
        """The rollout's client (the same one every call, so its connections are reused)."""
        if self._client is None:
            rollout: Any = EngineClient(self.rollout_url, api_key=self.api_key)
            if self.reissue_s is not None:
                # Behind a router a restarted engine is back only once it serves the current weights; a lone one is
                # reached directly, so its requests wait for the end of its recovery.
                gate = None if self.routed else (lambda: not self.recovering)
                rollout = ReissuingClient(rollout, self.reissue_s, gate=gate)
            self._client = RoutedClient(rollout, [EngineClient(url, api_key=self.api_key) for url in self.worker_urls],
                                        tolerate_down=self.reissue_s is not None)
        return self._client

    def check_alive(self, grace_s: float = 1.0) -> None:
        """Raise EngineDiedError naming every engine or router process of this run that has exited, or exits within
        `grace_s` (how, and its log tail); nothing for external servers or an in-process engine, which have no
        process here."""
        deadline = time.monotonic() + grace_s
        reports = [p.exit_report(max(0.0, deadline - time.monotonic())) for p in self.processes
                   if hasattr(p, "exit_report")]
        reports = [r for r in reports if r]
        if reports:
            raise EngineDiedError("a rollout engine process of this run is gone (--use-fault-tolerance would "
                                  "restart it):\n" + "\n".join(reports))

    def weight_targets(self) -> WeightTargets:
        return WeightTargets(tuple(self.worker_urls), self.hf_checkpoint, self.weights_dir, self.api_key, self.sglang)

    async def aclose(self) -> None:
        """Close the rollout client's connections (on the event loop they were opened on)."""
        if self._client is not None:
            await self._client.aclose()

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes = []


class EngineLaunch:
    """Engines on their way up (EngineSet.launch): the embedded engines' `processes`, starting, or the `external`
    servers' EngineSet. `ready()` waits for them, `cancel()` stops what was started."""

    def __init__(self, hf_checkpoint: str, external: EngineSet | None = None, api_key: str | None = None,
                 router: Mapping[str, Any] | None = None):
        """`api_key`: the one the embedded engines are launched with (an external EngineSet holds its own);
        `router`: the options of the sglang-router started in front of two or more engines (None: none started)."""
        self.hf_checkpoint, self.external, self.api_key, self.router = hf_checkpoint, external, api_key, router
        self.processes: list[Any] = []
        self.weights_dir: str | None = None
        """--sglang-weights-dir for SGLang servers launched here: the trainer writes each version there."""
        self.sglang = False
        """The engines are SGLang servers (placement_group.EnginePlacement of kind "sglang")."""

    def ready(self) -> EngineSet:
        """The EngineSet once every embedded engine answers /health (and the router, with two or more, lists
        them all), or once every external server answers; a failure stops what was started and raises."""
        if self.external is not None:
            asyncio.run(self.external.check_health())
            if self.router is not None and len(self.external.worker_urls) > 1:
                router = start_router(self.external.worker_urls, api_key=self.external.api_key, options=self.router)
                self.external.processes.append(router)
                self.external.rollout_url = router.url
            return self.external
        try:
            for process in self.processes:
                process.wait_ready("/health", ENGINE_READY_TIMEOUT_S)
            urls = [p.url for p in self.processes]
            if len(urls) > 1:
                self.processes.append(start_router(urls, api_key=self.api_key, options=self.router))
        except BaseException:
            self.cancel()
            raise
        return EngineSet(urls, self.processes[-1].url, self.hf_checkpoint, self.weights_dir, processes=self.processes,
                         api_key=self.api_key, sglang=self.sglang)

    def cancel(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes = []


class RoutedClient:
    """What the rollout function talks to: `generate` through the router (or the only engine), `abort` to every
    engine, because sglang-router does not forward /abort_request. Batched generates issued together are sent as
    one request (see `Coalescer`)."""

    def __init__(self, rollout: EngineClient | ReissuingClient, workers: list[EngineClient],
                 tolerate_down: bool = False):
        """`tolerate_down`: an engine that does not answer /abort_request is being restarted (it holds no request
        then), not an error."""
        self.rollout, self.workers, self.tolerate_down = rollout, workers, tolerate_down
        self.batches = Coalescer(rollout)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *, return_logprob: bool = True,
                       rid: str | None = None) -> dict[str, Any]:
        return await self.rollout.generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid)

    async def generate_batch(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], *,
                             return_logprob: bool = True, rids: list[str] | None = None) -> list[dict[str, Any]]:
        return await self.batches.generate_batch(input_ids, sampling_params, return_logprob=return_logprob, rids=rids)

    async def abort(self, rid: str | None = None) -> None:
        answers = await asyncio.gather(*(worker.abort(rid) for worker in self.workers),
                                       return_exceptions=self.tolerate_down)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, EngineUnavailableError):
                raise answer

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in dict.fromkeys([self.rollout, *self.workers])))


class ReissuingClient:
    """The rollout's client under --use-fault-tolerance: a generate that fails because its engine died under it (the
    connection broke) is sent again until `patience_s` has passed, and reaches a live engine (the router's others, or
    the restarted one); one answered 5xx (the router lost its worker, or the engine failed) at most
    `server_errors` times, so that an engine error that repeats still reaches the rollout. A request that was
    answered is never sent again. `gate`: while it returns False (an engine reached directly is being recovered, and
    may serve stale weights), nothing is sent."""

    server_errors = 3

    def __init__(self, client: EngineClient, patience_s: float, pause_s: float = 0.2,
                 gate: Callable[[], bool] | None = None):
        self.client, self.patience_s, self.pause_s, self.gate = client, patience_s, pause_s, gate
        self.url = client.url
        self.reissued = 0

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *, return_logprob: bool = True,
                       rid: str | None = None) -> dict[str, Any]:
        return await self._again(lambda: self.client.generate(input_ids, sampling_params,
                                                              return_logprob=return_logprob, rid=rid))

    async def generate_batch(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], *,
                             return_logprob: bool = True, rids: list[str] | None = None) -> list[dict[str, Any]]:
        return await self._again(lambda: self.client.generate_batch(input_ids, sampling_params,
                                                                    return_logprob=return_logprob, rids=rids))

    async def _again(self, send: Any) -> Any:
        deadline, answered_5xx = time.monotonic() + self.patience_s, 0
        while True:
            while self.gate is not None and not self.gate() and time.monotonic() < deadline:
                await asyncio.sleep(self.pause_s)
            try:
                return await send()
            except EngineUnavailableError:
                if time.monotonic() > deadline:
                    raise
            except EngineRequestError as err:
                answered_5xx += err.status >= 500
                if err.status < 500 or answered_5xx > self.server_errors or time.monotonic() > deadline:
                    raise
            self.reissued += 1
            await asyncio.sleep(self.pause_s)

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclass
class _Part:
    input_ids: list[list[int]]
    sampling_params: list[dict[str, Any]]
    rids: list[str] | None
    answer: asyncio.Future


class Coalescer:
    """Sends the `generate_batch` calls made in one turn of the event loop as one batched /generate, and hands each
    caller its own slice of the answer (a rollout's groups start together: 16 requests of 16 samples became one of
    256, one prefill in the engine instead of a merge per request). Only calls with the same return_logprob are
    merged. When the engine rejects a merged request (400: a bad prompt, say; 413: too large a body), each part is
    sent again on its own, so that only the bad one fails, as it would have alone."""

    def __init__(self, client: EngineClient | ReissuingClient):
        self.client = client
        self.waiting: dict[bool, list[_Part]] = {}
        self.sending: set[asyncio.Task] = set()  # referenced until done (the loop keeps only weak references)

    async def generate_batch(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], *,
                             return_logprob: bool = True, rids: list[str] | None = None) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        part = _Part(list(input_ids), list(sampling_params), None if rids is None else list(rids), loop.create_future())
        if return_logprob not in self.waiting:
            self.waiting[return_logprob] = []
            loop.call_soon(self._start_sending, return_logprob)  # after this turn's other calls
        self.waiting[return_logprob].append(part)
        return await part.answer

    def _start_sending(self, return_logprob: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._send(self.waiting.pop(return_logprob), return_logprob))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _send(self, parts: list[_Part], return_logprob: bool) -> None:
        try:
            outs = await self._request(parts, return_logprob)
        except EngineRequestError as err:
            if len(parts) == 1 or err.status not in (400, 413):  # a bad prompt, or too much in one request
                _fail(parts, err)
                return
            await asyncio.gather(*(self._send_alone(part, return_logprob) for part in parts))
            return
        except asyncio.CancelledError:
            for part in parts:
                part.answer.cancel()
            raise
        except Exception as err:  # every caller sees the failure, as with a request of its own
            _fail(parts, err)
            return
        start = 0
        for part in parts:
            if not part.answer.done():
                part.answer.set_result(outs[start : start + len(part.input_ids)])
            start += len(part.input_ids)

    async def _send_alone(self, part: _Part, return_logprob: bool) -> None:
        try:
            outs = await self._request([part], return_logprob)
        except Exception as err:
            _fail([part], err)
        else:
            if not part.answer.done():
                part.answer.set_result(outs)

    async def _request(self, parts: list[_Part], return_logprob: bool) -> list[dict[str, Any]]:
        input_ids = [ids for part in parts for ids in part.input_ids]
        outs = await self.client.generate_batch(
            input_ids, [params for part in parts for params in part.sampling_params], return_logprob=return_logprob,
            rids=[rid for part in parts for rid in part.rids or [f"batched-{uuid.uuid4().hex}" for _ in part.input_ids]])
        if len(outs) != len(input_ids):
            raise RuntimeError(f"the engine answered {len(outs)} of {len(input_ids)} prompts of a batched /generate")
        return outs


def _fail(parts: list[_Part], err: BaseException) -> None:
    for part in parts:
        if not part.answer.done():
            part.answer.set_exception(err)


def _engine_url(address: str) -> str:
    """host:port or http://host:port -> http://host:port (as slime reads --rollout-external-engine-addrs)."""
    url = (address if "://" in address else f"http://{address}").rstrip("/")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
        raise ValueError(f"external engine address {address!r}: write it as host:port or http://host:port")
    return url


def _router_url(args: Mapping[str, Any]) -> str | None:
    ip, port = args.get("router_ip"), args.get("router_port")
    if ip is None and port is None:
        return None
    if ip is None or port is None:
        raise ValueError("give both --sglang-router-ip and --sglang-router-port (or neither)")
    return f"http://{ip}:{port}"
