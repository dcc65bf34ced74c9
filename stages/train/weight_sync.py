"""The trainer's side of weight sync: HF-named tensors to every engine of a run, as one weight version, in buckets.

Embedded engines take the tensors over HTTP (`/update_weights_from_tensor`), colocated ones through a /dev/shm
segment they then serve from (shared_segment.py: one copy in all, the trainer's), or, with --update-weight-transport
nccl, by broadcast in a process group of trainer rank 0 and every engine (`/init_weights_update_group` +
`/update_weights_from_distributed`, SGLang's protocol; gloo on CPU); external SGLang servers load an HF directory
written to `--sglang-weights-dir` through `/update_weights_from_disk`. SGLang servers colocated with the trainer
take SGLang's own /update_weights_from_tensor body ("ipc": each bucket one flattened bucket of handles to the
trainer's memory, CUDA IPC on GPUs, /dev/shm on CPUs; engine/tensor_ipc.py), as slime's --colocate sends it.
Buckets hold at most --update-weight-buffer-size bytes, as slime's; the shared segment, which holds a whole version
anyway, takes it in one request.

Without --update-weight-transport, embedded engines whose Ray node is trainer rank 0's take the /dev/shm segment
whether colocated or not (`default_transport`): the host is known from the node ids the engines were started on,
never guessed from a URL. HTTP bodies cost ~30 passes over the bytes (safetensors in, parse, copy), the segment one
(the trainer's copy into it, which checks for NaN/Inf as it goes; shared_segment.py).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from safetensors.torch import save_file

from slimeflow.engine.client import EngineClient
from slimeflow.engine.launch import free_port
from slimeflow.engine.shared_segment import LOAD_FORMAT, SegmentWriter
from slimeflow.engine.tensor_ipc import SendBuffer, update_body
from slimeflow.engine.weight_group import WeightGroup
from slimeflow.stages.train.engines import WeightTargets

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_SIZE = 512 * 1024**2
"""slime's --update-weight-buffer-size default (bytes per bucket)."""
TRANSPORTS = ("tensor", "shared_memory", "distributed", "disk", "ipc")


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


def remote_engines(targets: WeightTargets, node_id: str | None) -> list[str]:
    """The engine URLs not on the host of the Ray node `node_id` (trainer rank 0's): by node id where the targets
    know each engine's, else by URL (anything but a loopback address)."""
    if node_id is not None and len(targets.node_ids) == len(targets.worker_urls):
        return [url for url, node in zip(targets.worker_urls, targets.node_ids, strict=True) if node != node_id]
    return [url for url in targets.worker_urls if urlsplit(url).hostname not in ("127.0.0.1", "localhost")]


def default_transport(targets: WeightTargets, colocate: bool, node_id: str | None) -> tuple[str, str]:
    """(transport, why) when --update-weight-transport is not given: external servers load from disk; colocated
    engines take tensors in place (SGLang's IPC body for SGLang servers, as slime; a /dev/shm segment for embedded
    engines); embedded engines all on trainer rank 0's Ray node (`node_id`) the /dev/shm segment too; others HTTP."""
    if targets.weights_dir is not None:
        return "disk", "external SGLang servers load each version from --sglang-weights-dir"
    if colocate:
        return ("ipc" if targets.sglang else "shared_memory"), "the engines are colocated with the trainer"
    known = node_id is not None and len(targets.node_ids) == len(targets.worker_urls) > 0
    remote = remote_engines(targets, node_id) if known else None
    if not targets.sglang and known and not remote:
        return "shared_memory", f"every engine runs on trainer rank 0's Ray node {node_id}"
    if targets.sglang:
        return "tensor", "SGLang servers apart from the trainer"
    where = "unknown" if not known else f"{remote} on other nodes than {node_id}"
    return "tensor", f"engines not all on trainer rank 0's host (where they run: {where})"


class WeightSync:
    """Pushes HF-named tensors to every engine of `targets` as one weight version, on kept HTTP clients.

    `transport`: "tensor" (HTTP bodies), "shared_memory" (a /dev/shm segment) or "distributed" (a process group) for
    embedded engines, "ipc" (SGLang's own tensor body, handles to this process's memory; SGLang servers and embedded
    engines on this host) and "disk" for external servers (the default follows `targets`). `tp_size`: the engines'
    SGLang TP ranks, each of which reads an entry of an "ipc" body. A push of several buckets pauses the engines (SGLang's abort mode:
    running requests return with finish_reason abort) so that no answer mixes two versions, and continues them after.
    `post_write(version_dir)`: called after the disk transport wrote a version, before the engines load it
    (--custom-update-weight-post-write-path).
    """

    def __init__(self, targets: WeightTargets, buffer_size: int = DEFAULT_BUFFER_SIZE, transport: str | None = None,
                 post_write: Callable[[str], Any] | None = None, tp_size: int = 1, node_id: str | None = None,
                 fallback: str | None = None):
        transport = transport or ("tensor" if targets.weights_dir is None else "disk")
        if transport not in TRANSPORTS:
            raise ValueError(f"weight transport {transport!r} is not one of {TRANSPORTS}")
        if (transport == "disk") != (targets.weights_dir is not None):
            raise ValueError("--update-weight-transport: external SGLang servers (--sglang-worker-urls) load weights "
                             "from --sglang-weights-dir only; the embedded engines take them over HTTP (the default) "
                             "or by broadcast (nccl: a gloo group on CPU)")
        remote = remote_engines(targets, node_id)
        if transport in ("distributed", "shared_memory", "ipc") and remote:
            raise ValueError(f"weight transport {transport} reaches engines on trainer rank 0's host only (a loopback "
                             f"gloo group, a /dev/shm file, IPC handles); {remote} are elsewhere (use the default HTTP "
                             "transport, or --update-weight-transport nccl for SGLang servers)")
        self.targets, self.buffer_size, self.transport, self.tp_size = targets, buffer_size, transport, tp_size
        self.post_write, self.node_id = post_write, node_id
        self.fallback = fallback
        """The transport to use instead when /dev/shm has no room for the segment (a default choice, not a flag)."""
        self.clients = [EngineClient(url, api_key=targets.api_key) for url in targets.worker_urls]
        self.group: Any = None  # the WeightGroup of the distributed transport, made at the first push
        self.segment: Any = None  # the SegmentWriter of the shared_memory transport
        self.send_buffer: Any = None  # the tensor_ipc.SendBuffer of the ipc transport
        self.buckets_sent = 0
        self.paused = False  # the engines are paused: a push of several buckets is under way or failed part-way

    async def push(self, named_tensors: Mapping[str, Any], version: str) -> str:
        """Every engine serves `version` afterwards; raises naming the engine that did not take it."""
        if self.transport == "disk":
            return await self._push_disk(named_tensors, version)
        # An embedded engine answers once it serves `version` (and every rollout answer is checked against the
        # rollout's version), so asking it again would only cost a round trip (~1 ms of a ~12 ms update).
        # The segment holds a whole version whatever the bucket size (begin), so it goes in one request: buckets
        # would only add round trips and a pause of the engines around them.
        limit = self.buffer_size if self.transport != "shared_memory" else sum(
            t.numel() * t.element_size() for t in named_tensors.values())
        parts = list(buckets(named_tensors, limit))
        send = {"tensor": self._send_tensors, "shared_memory": self._send_shared,
                "distributed": self._send_distributed, "ipc": self._send_ipc}[self.transport]
        if self.transport == "shared_memory":
            try:
                self._segment().begin(named_tensors)
            except OSError as err:
                if self.fallback is None:
                    raise
                logger.warning("weight sync: %s; pushing over %s instead", err, self.fallback)
                self.transport, self.fallback = self.fallback, None
                return await self.push(named_tensors, version)
        if len(parts) > 1 and not self.paused:
            await self._all("/pause_generation")
            self.paused = True
        for i, part in enumerate(parts):
            try:
                await send(part, version)
            except Exception as err:
                if self.segment is not None:
                    self.segment.abandon()
                if len(parts) == 1:
                    raise  # each engine took all of it or none (its answer says which version it serves)
                raise RuntimeError(
                    f"weight version {version!r}: bucket {i + 1} of {len(parts)} failed with {i} applied before it, "
                    "so the engines' weights may mix two versions; they stay paused (no answer mixes versions) "
                    f"until a complete version is pushed: {err}") from err
        if self.segment is not None:
            self.segment.commit()
        if self.paused:
            await self._all("/continue_generation")
            self.paused = False
        self.buckets_sent += len(parts)
        return version

    async def _push_disk(self, named_tensors: Mapping[str, Any], version: str) -> str:
        path = self._write_hf(named_tensors, version)
        if self.post_write is not None:
            self.post_write(path)
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

    async def _send_ipc(self, part: dict[str, Any], version: str) -> None:
        """SGLang's body: one flattened bucket, its entry repeated for each TP rank; the bucket's buffer is not
        written again until every engine has answered (slime keeps its `long_live_tensors` so)."""
        self.send_buffer = self.send_buffer or SendBuffer()
        body, buffer = await asyncio.to_thread(update_body, part, tp_size=self.tp_size, version=version,
                                               buffers=self.send_buffer)
        await self._all("/update_weights_from_tensor", body)
        on_gpu = buffer["flattened_tensor"].is_cuda
        del buffer
        if on_gpu:  # give back the IPC handles' memory the engines have closed (slime's ipc_collect per bucket)

            torch.cuda.ipc_collect()

    def _segment(self) -> Any:
        self.segment = self.segment or SegmentWriter()
        return self.segment

    async def _send_shared(self, part: dict[str, Any], version: str) -> None:
        """Write the bucket once into the shared segment's free slot, checking its values (NaN/Inf: refused here,
        before any engine reads it); every engine serves from it after checking names and shapes."""
        body = {"serialized_named_tensors": [self.segment.write(part, version)], "load_format": LOAD_FORMAT,
                "weight_version": version, "flush_cache": False}
        await self._all("/update_weights_from_tensor", body)
        self.segment.mapped()

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
        port, world = free_port(), len(self.clients) + 1
        name = f"slimeflow-weights-{uuid.uuid4().hex[:8]}"
        joining = [c.control("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": i + 1, "world_size": world,
            "group_name": name, "backend": "gloo"}) for i, c in enumerate(self.clients)]
        own = asyncio.to_thread(WeightGroup.join, master_address="127.0.0.1", master_port=port, rank=0,
                                world_size=world, group_name=name)
        *_, self.group = await asyncio.gather(*joining, own)
        return self.group

    async def regroup(self) -> None:
        """Some engines were restarted (fault tolerance) and are no longer in the distributed transport's group: leave
        it (each live engine too; a restarted one knows no such group), so that the next push makes a new one of
        every engine, as slime reconnects its new engines. The shared segment's files are dropped too: their names
        are gone once the engines have mapped them, so a restarted engine could not map them; the next push writes new
        ones for every engine. Nothing to do for the other transports."""
        self.drop_segment()
        if self.group is not None:
            await asyncio.gather(*(c.control("/destroy_weights_update_group", {"group_name": self.group.name})
                                   for c in self.clients), return_exceptions=True)
            self.group.close()
            self.group = None

    def _write_hf(self, named_tensors: Mapping[str, Any], version: str) -> str:
        assert self.targets.weights_dir is not None
        target = Path(self.targets.weights_dir) / f"v{version}"
        target.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in named_tensors.items()}, str(target / "model.safetensors"))
        for item in Path(self.targets.hf_checkpoint).iterdir():
            if item.is_file() and not item.name.endswith((".safetensors", ".bin")) and item.name != "model.safetensors.index.json":
                shutil.copy2(item, target / item.name)
        return str(target)

    def drop_segment(self) -> None:
        """Unmap the shared segment (and the ipc transport's buffer) on this side (engines serving from it keep their
        own mappings); the next push writes new files."""
        if self.segment is not None:
            self.segment.close()
        self.send_buffer = None  # the ipc transport's /dev/shm buffer

    async def aclose(self) -> None:
        self.drop_segment()
        if self.group is not None:
            await self._all("/destroy_weights_update_group", {"group_name": self.group.name})
            self.group.close()
            self.group = None
        await asyncio.gather(*(c.aclose() for c in self.clients))
