"""The rollout engines of a run: embedded engines started here (the real sglang-router in front of two or more),
or external SGLang servers (`--sglang-worker-urls URL ...`, optionally `--sglang-router-ip/--sglang-router-port`).

Rollouts go to one URL (the router's, or the only engine's). Weights go to every engine: embedded engines take
the trainer's tensors over HTTP (`/update_weights_from_tensor`); external SGLang servers load an HF directory
written to `--sglang-weights-dir` (a path every server can read) through `/update_weights_from_disk`.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimeflow.stages.rl.engine.client import EngineClient


@dataclass
class EngineSet:
    """Engine URLs, the URL rollouts use, and the processes this run started (stopped by `stop`)."""

    worker_urls: list[str]
    rollout_url: str
    hf_checkpoint: str
    weights_dir: str | None = None
    processes: list[Any] = field(default_factory=list)

    @classmethod
    def start(cls, hf_checkpoint: str, sglang_args: Mapping[str, Any], num_engines: int,
              threads: int | None = None) -> EngineSet:
        """External servers when --sglang-worker-urls is given, else `num_engines` embedded engines."""
        external = sglang_args.get("worker_urls")
        if external:
            urls = [external] if isinstance(external, str) else [str(u) for u in external]
            router = _router_url(sglang_args)
            weights_dir = sglang_args.get("weights_dir")
            if not weights_dir:
                raise ValueError("--sglang-worker-urls needs --sglang-weights-dir DIR: a directory every SGLang "
                                 "server can read, where the trainer writes the weights it pushes")
            engines = cls(urls, router or urls[0], hf_checkpoint, str(weights_dir))
            asyncio.run(engines.check_health())
            return engines
        from slimeflow.stages.rl.engine.launch import start_engine, start_router

        options = {"num_threads": threads} if threads else {}
        processes: list[Any] = []
        try:
            for _ in range(num_engines):
                processes.append(start_engine(hf_checkpoint, **options))
            urls = [p.url for p in processes]
            rollout_url = urls[0]
            if num_engines > 1:
                processes.append(start_router(urls))
                rollout_url = processes[-1].url
        except BaseException:
            for process in processes:
                process.stop()
            raise
        return cls(urls, rollout_url, hf_checkpoint, None, processes)

    @property
    def routed(self) -> bool:
        """Whether rollouts go through sglang-router, which takes one request per sample: its batch form allows
        only one sampling_params for every prompt, and each sample needs its own seed."""
        return self.rollout_url not in self.worker_urls

    async def check_health(self) -> None:
        """Every engine and the rollout URL answer /health (EngineUnavailableError names the one that does not)."""
        urls = dict.fromkeys([*self.worker_urls, self.rollout_url])
        await asyncio.gather(*(EngineClient(url, retries=2).health() for url in urls))

    def client(self) -> RoutedClient:
        return RoutedClient(EngineClient(self.rollout_url), [EngineClient(url) for url in self.worker_urls])

    async def update_weights(self, named_tensors: Mapping[str, Any], version: str) -> str:
        """Every engine serves `version` afterwards; raises naming the engine that did not take it."""
        clients = [EngineClient(url) for url in self.worker_urls]
        if self.weights_dir is None:
            await asyncio.gather(*(c.update_weights_from_tensor(dict(named_tensors), version) for c in clients))
        else:
            path = self._write_hf(named_tensors, version)
            await asyncio.gather(*(c.update_weights_from_disk(path, version) for c in clients))
        served = await asyncio.gather(*(c.weight_version() for c in clients))
        wrong = {url: v for url, v in zip(self.worker_urls, served, strict=True) if v != version}
        if wrong:
            raise RuntimeError(f"after pushing weight version {version!r}, engines serve {wrong}")
        return version

    def _write_hf(self, named_tensors: Mapping[str, Any], version: str) -> str:
        from safetensors.torch import save_file

        target = Path(self.weights_dir) / f"v{version}"
        target.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in named_tensors.items()}, str(target / "model.safetensors"))
        for item in Path(self.hf_checkpoint).iterdir():
            if item.is_file() and not item.name.endswith((".safetensors", ".bin")) and item.name != "model.safetensors.index.json":
                shutil.copy2(item, target / item.name)
        return str(target)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes = []


class RoutedClient:
    """What the rollout function talks to: `generate` through the router (or the only engine), `abort` to every
    engine, because sglang-router does not forward /abort_request."""

    def __init__(self, rollout: EngineClient, workers: list[EngineClient]):
        self.rollout, self.workers = rollout, workers

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *, return_logprob: bool = True,
                       rid: str | None = None) -> dict[str, Any]:
        return await self.rollout.generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid)

    async def generate_batch(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], *,
                             return_logprob: bool = True, rids: list[str] | None = None) -> list[dict[str, Any]]:
        return await self.rollout.generate_batch(input_ids, sampling_params, return_logprob=return_logprob, rids=rids)

    async def abort(self, rid: str | None = None) -> None:
        await asyncio.gather(*(worker.abort(rid) for worker in self.workers))


def _router_url(args: Mapping[str, Any]) -> str | None:
    ip, port = args.get("router_ip"), args.get("router_port")
    if ip is None and port is None:
        return None
    if ip is None or port is None:
        raise ValueError("give both --sglang-router-ip and --sglang-router-port (or neither)")
    return f"http://{ip}:{port}"
