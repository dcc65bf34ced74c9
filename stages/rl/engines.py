"""The rollout engines of a run: embedded engines started here (the real sglang-router in front of two or more),
or external SGLang servers (`--sglang-worker-urls URL ...`, optionally `--sglang-router-ip/--sglang-router-port`).

Rollouts go to one URL (the router's, or the only engine's). Weights go from the trainer straight to every engine
(a `WeightSync` in the TrainActor that holds them, as slime's actor pushes to its engines), in buckets of at most
--update-weight-buffer-size bytes: embedded engines take the tensors over HTTP (`/update_weights_from_tensor`), or,
with --update-weight-transport nccl, by broadcast in a process group of the trainer and every engine
(`/init_weights_update_group` + `/update_weights_from_distributed`; gloo on CPU); external SGLang servers load an HF
directory written to `--sglang-weights-dir` (a path every server can read) through `/update_weights_from_disk`.
HTTP clients are kept for the life of the run (a new one per call cost a TLS context and a TCP connection every
rollout).

Every client carries the run's API key: a new one for the embedded engines (and the router) of each run, or
`--sglang-api-key` for external SGLang servers and router started with `--api-key`.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slimeflow.stages.rl.engine.client import EngineClient, EngineRequestError


@dataclass(frozen=True)
class WeightTargets:
    """Where a trainer pushes its weights: every engine's URL and, for external SGLang servers, the directory they
    load from (None: embedded engines, which take tensors over HTTP). Small and picklable, for a Ray call."""

    worker_urls: tuple[str, ...]
    hf_checkpoint: str
    weights_dir: str | None = None
    api_key: str | None = field(default=None, repr=False)


DEFAULT_BUFFER_SIZE = 512 * 1024**2
"""slime's --update-weight-buffer-size default (bytes per bucket)."""
TRANSPORTS = ("tensor", "distributed", "disk")


def buckets(named_tensors: Mapping[str, Any], limit: int) -> Iterator[dict[str, Any]]:
    """The tensors in order, in groups of at most `limit` bytes (a larger tensor goes alone), as slime's buffer."""
    bucket: dict[str, Any] = {}
    size = 0
    for name, tensor in named_tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


class WeightSync:
    """Pushes HF-named tensors to every engine of `targets` as one weight version, on kept HTTP clients.

    `transport`: "tensor" (HTTP bodies) or "distributed" (a process group) for embedded engines, "disk" for external
    servers (the default follows `targets`). A push of several buckets pauses the engines (SGLang's abort mode:
    running requests return with finish_reason abort) so that no answer mixes two versions, and continues them after.
    """

    def __init__(self, targets: WeightTargets, buffer_size: int = DEFAULT_BUFFER_SIZE, transport: str | None = None):
        transport = transport or ("tensor" if targets.weights_dir is None else "disk")
        if transport not in TRANSPORTS:
            raise ValueError(f"weight transport {transport!r} is not one of {TRANSPORTS}")
        if (transport == "disk") != (targets.weights_dir is not None):
            raise ValueError("--update-weight-transport: external SGLang servers (--sglang-worker-urls) load weights "
                             "from --sglang-weights-dir only; the embedded engines take them over HTTP (the default) "
                             "or by broadcast (nccl: a gloo group on CPU)")
        remote = [url for url in targets.worker_urls if urlsplit(url).hostname not in ("127.0.0.1", "localhost")]
        if transport == "distributed" and remote:
            raise ValueError(f"--update-weight-transport nccl: the gloo group is made on loopback, for engines on "
                             f"trainer rank 0's host; {remote} are elsewhere (use the default HTTP transport)")
        self.targets, self.buffer_size, self.transport = targets, buffer_size, transport
        self.clients = [EngineClient(url, api_key=targets.api_key) for url in targets.worker_urls]
        self.group: Any = None  # the WeightGroup of the distributed transport, made at the first push
        self.buckets_sent = 0

    async def push(self, named_tensors: Mapping[str, Any], version: str) -> str:
        """Every engine serves `version` afterwards; raises naming the engine that did not take it."""
        if self.transport != "disk":
            # An embedded engine answers once it serves `version` (and every rollout answer is checked against the
            # rollout's version), so asking it again would only cost a round trip (~1 ms of a ~12 ms update).
            parts = list(buckets(named_tensors, self.buffer_size))
            send = self._send_tensors if self.transport == "tensor" else self._send_distributed
            if len(parts) > 1:
                await self._all("/pause_generation")
            for part in parts:
                await send(part, version)
            if len(parts) > 1:
                await self._all("/continue_generation")
            self.buckets_sent += len(parts)
            return version
        path = self._write_hf(named_tensors, version)
        await asyncio.gather(*(c.update_weights_from_disk(path, version) for c in self.clients))
        served = await asyncio.gather(*(c.weight_version() for c in self.clients))
        wrong = {url: v for url, v in zip(self.targets.worker_urls, served, strict=True) if v != version}
        if wrong:
            raise RuntimeError(f"after pushing weight version {version!r}, engines serve {wrong}")
        return version

    async def _all(self, path: str, body: dict[str, Any] | None = None) -> list[Any]:
        return await asyncio.gather(*(c.control(path, body) for c in self.clients))

    async def _send_tensors(self, part: dict[str, Any], version: str) -> None:
        await asyncio.gather(*(c.update_weights_from_tensor(part, version) for c in self.clients))

    async def _send_distributed(self, part: dict[str, Any], version: str) -> None:
        """SGLang's protocol: each engine gets the names, dtypes and shapes, then every tensor by broadcast."""
        group = self.group or await self._connect()
        tensors = [t.detach().cpu().contiguous() for t in part.values()]
        body = {"names": list(part), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "group_name": group.name, "weight_version": version,
                "flush_cache": False}
        answers = asyncio.gather(*(c.control("/update_weights_from_distributed", body) for c in self.clients))
        sending = asyncio.ensure_future(asyncio.to_thread(lambda: [group.broadcast(t) for t in tensors]))
        # An engine that refuses the bucket fails its request at once: raise that, not the broadcast's timeout.
        done, _ = await asyncio.wait([answers, sending], return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
        await answers
        await sending

    async def _connect(self) -> Any:
        """Make the group: this trainer is rank 0 and hosts the rendezvous; engine i joins as rank i + 1."""
        from slimeflow.stages.rl.engine.launch import free_port
        from slimeflow.stages.rl.engine.weight_group import WeightGroup

        port, world = free_port(), len(self.clients) + 1
        name = f"slimeflow-weights-{uuid.uuid4().hex[:8]}"
        joining = [c.control("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": i + 1, "world_size": world,
            "group_name": name, "backend": "gloo"}) for i, c in enumerate(self.clients)]
        own = asyncio.to_thread(WeightGroup.join, master_address="127.0.0.1", master_port=port, rank=0,
                                world_size=world, group_name=name)
        *_, self.group = await asyncio.gather(*joining, own)
        return self.group

    def _write_hf(self, named_tensors: Mapping[str, Any], version: str) -> str:
        from safetensors.torch import save_file

        assert self.targets.weights_dir is not None
        target = Path(self.targets.weights_dir) / f"v{version}"
        target.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in named_tensors.items()}, str(target / "model.safetensors"))
        for item in Path(self.targets.hf_checkpoint).iterdir():
            if item.is_file() and not item.name.endswith((".safetensors", ".bin")) and item.name != "model.safetensors.index.json":
                shutil.copy2(item, target / item.name)
        return str(target)

    async def aclose(self) -> None:
        if self.group is not None:
            await self._all("/destroy_weights_update_group", {"group_name": self.group.name})
            self.group.close()
            self.group = None
        await asyncio.gather(*(c.aclose() for c in self.clients))


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
    _client: RoutedClient | None = field(default=None, init=False, repr=False)

    @classmethod
    def start(cls, hf_checkpoint: str, sglang_args: Mapping[str, Any], num_engines: int,
              threads: int | None = None) -> EngineSet:
        """External servers when --sglang-worker-urls is given, else `num_engines` embedded engines."""
        return cls.launch(hf_checkpoint, sglang_args, num_engines, threads).ready()

    @classmethod
    def launch(cls, hf_checkpoint: str, sglang_args: Mapping[str, Any], num_engines: int,
               threads: int | None = None, in_process: bool = False) -> EngineLaunch:
        """`start` in two halves: this one checks the flags and starts every embedded engine's process without
        waiting; the returned launch's `ready()` waits for them (and starts the router). The caller's own set-up
        can run in between, while the engines import and load. `in_process`: a single embedded engine serves
        from a thread of this process instead (launch.launch_engine_thread)."""
        external = sglang_args.get("worker_urls")
        if external:
            # The command line gives one string (several URLs joined by spaces), YAML a string or a list.
            urls = external.split() if isinstance(external, str) else [str(u) for u in external]
            weights_dir = sglang_args.get("weights_dir")
            if not weights_dir:
                raise ValueError("--sglang-worker-urls needs --sglang-weights-dir DIR: a directory every SGLang "
                                 "server can read, where the trainer writes the weights it pushes")
            key = sglang_args.get("api_key")
            return EngineLaunch(hf_checkpoint, external=cls(urls, _router_url(sglang_args) or urls[0], hf_checkpoint,
                                                            str(weights_dir), api_key=str(key) if key else None))
        from slimeflow.stages.rl.engine.launch import launch_engine, launch_engine_thread, new_api_key

        launching = EngineLaunch(hf_checkpoint, api_key=new_api_key())
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
            self._client = RoutedClient(EngineClient(self.rollout_url, api_key=self.api_key),
                                        [EngineClient(url, api_key=self.api_key) for url in self.worker_urls])
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
            raise EngineDiedError("a rollout engine process of this run is gone (--use-fault-tolerance, which would "
                                  "restart it, is not built yet):\n" + "\n".join(reports))

    def weight_targets(self) -> WeightTargets:
        return WeightTargets(tuple(self.worker_urls), self.hf_checkpoint, self.weights_dir, self.api_key)

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

    def __init__(self, hf_checkpoint: str, external: EngineSet | None = None, api_key: str | None = None):
        """`api_key`: the one the embedded engines are launched with (an external EngineSet holds its own)."""
        self.hf_checkpoint, self.external, self.api_key = hf_checkpoint, external, api_key
        self.processes: list[Any] = []

    def ready(self) -> EngineSet:
        """The EngineSet once every embedded engine answers /health (and the router, with two or more, lists
        them all), or once every external server answers; a failure stops what was started and raises."""
        from slimeflow.stages.rl.engine.launch import ENGINE_READY_TIMEOUT_S, start_router

        if self.external is not None:
            asyncio.run(self.external.check_health())
            return self.external
        try:
            for process in self.processes:
                process.wait_ready("/health", ENGINE_READY_TIMEOUT_S)
            urls = [p.url for p in self.processes]
            if len(urls) > 1:
                self.processes.append(start_router(urls, api_key=self.api_key))
        except BaseException:
            self.cancel()
            raise
        return EngineSet(urls, self.processes[-1].url, self.hf_checkpoint, processes=self.processes,
                         api_key=self.api_key)

    def cancel(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes = []


class RoutedClient:
    """What the rollout function talks to: `generate` through the router (or the only engine), `abort` to every
    engine, because sglang-router does not forward /abort_request. Batched generates issued together are sent as
    one request (see `Coalescer`)."""

    def __init__(self, rollout: EngineClient, workers: list[EngineClient]):
        self.rollout, self.workers = rollout, workers
        self.batches = Coalescer(rollout)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *, return_logprob: bool = True,
                       rid: str | None = None) -> dict[str, Any]:
        return await self.rollout.generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid)

    async def generate_batch(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], *,
                             return_logprob: bool = True, rids: list[str] | None = None) -> list[dict[str, Any]]:
        return await self.batches.generate_batch(input_ids, sampling_params, return_logprob=return_logprob, rids=rids)

    async def abort(self, rid: str | None = None) -> None:
        await asyncio.gather(*(worker.abort(rid) for worker in self.workers))

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in dict.fromkeys([self.rollout, *self.workers])))


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

    def __init__(self, client: EngineClient):
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


def _router_url(args: Mapping[str, Any]) -> str | None:
    ip, port = args.get("router_ip"), args.get("router_port")
    if ip is None and port is None:
        return None
    if ip is None or port is None:
        raise ValueError("give both --sglang-router-ip and --sglang-router-port (or neither)")
    return f"http://{ip}:{port}"
