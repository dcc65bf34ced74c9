"""The engine's control endpoints beyond generation, with SGLang's request and response shapes (io_struct.py):
memory release and resume, and weight updates through a process group.

- POST /release_memory_occupation {"tags": ["weights", "kv_cache"] | null}: frees the model's parameters and
  KV cache (null: both); requests queue until the memory is resumed. Answers null, as SGLang.
- POST /resume_memory_occupation {"tags": ...}: allocates them again; the weights are read back from the
  checkpoint the engine last loaded from disk (its --model-path, or the last /update_weights_from_disk), and
  serve that checkpoint's weight version until the trainer pushes newer ones.
- POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}:
  joins the trainer's group as rank `rank_offset` (gloo on CPU); {"success", "message"}.
- POST /update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version, flush_cache, ...}:
  receives each tensor by broadcast from rank 0, in order, then applies them as one update.
- POST /destroy_weights_update_group {"group_name"}.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import torch
from fastapi import FastAPI, Request

from slimeflow.engine.sampling import BadRequestError
from slimeflow.engine.weight_group import WeightGroup, parse_dtype
from slimeflow.engine.weights import read_own_checkpoint

if TYPE_CHECKING:
    from slimeflow.engine.server import EngineState

MEMORY_TAGS = frozenset({"weights", "kv_cache"})
# SGLang also releases its CUDA graphs; this engine captures none, so the tag is taken and frees nothing.
NEUTRAL_TAGS = frozenset({"cuda_graph"})

ReadJson = Callable[[Request], Awaitable[dict]]


def memory_tags(body: dict) -> frozenset[str]:
    """The tags of a release/resume body (None or absent: every tag); BadRequestError naming unknown ones."""
    tags = body.get("tags")
    if tags is None:
        return MEMORY_TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadRequestError('"tags" must be a list of strings, e.g. ["weights", "kv_cache"], or null for all')
    unknown = sorted(set(tags) - MEMORY_TAGS - NEUTRAL_TAGS)
    if unknown:
        raise BadRequestError(f"unknown memory tags {unknown}; the engine releases {sorted(MEMORY_TAGS | NEUTRAL_TAGS)}")
    return frozenset(tags) & MEMORY_TAGS


def add_control_routes(app: FastAPI, state: EngineState, read_json: ReadJson) -> None:
    groups: dict[str, WeightGroup] = {}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        tags = memory_tags(await read_json(request))
        await asyncio.wrap_future(state.batcher.release_memory(tags))
        if "weights" in tags:  # parameters that were views of a trainer's segment are gone: let its pages go too
            state.segments.clear()

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        tags = memory_tags(await read_json(request))
        weights = None
        if "weights" in tags and "weights" in state.batcher.released:
            weights = await asyncio.to_thread(read_own_checkpoint, state.model_path)
        await asyncio.wrap_future(state.batcher.resume_memory(tags, weights, state.model_path_version))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await read_json(request)
        name = str(body.get("group_name", "weight_update_group"))
        if name in groups:
            raise BadRequestError(f"weight-update group {name!r} exists; POST /destroy_weights_update_group first")
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank, world_size = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as err:
            raise BadRequestError(f"init_weights_update_group needs master_address, master_port, rank_offset and "
                                  f"world_size ({type(err).__name__}: {err})") from None
        backend = str(body.get("backend", "gloo"))
        try:
            groups[name] = await asyncio.to_thread(
                WeightGroup.join, master_address=address, master_port=port, rank=rank, world_size=world_size,
                group_name=name, backend=backend, host=state.host)
        except (ValueError, RuntimeError) as err:  # a bad backend or rank, or the rendezvous timed out
            raise BadRequestError(f"could not join weight-update group {name!r} at {address}:{port}: {err}") from None
        return {"success": True, "message": f"joined {name!r} as rank {rank} of {world_size}"}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        name = str((await read_json(request)).get("group_name", "weight_update_group"))
        group = groups.pop(name, None)
        if group is None:
            raise BadRequestError(f"no weight-update group {name!r}; joined: {sorted(groups)}")
        group.close()
        return {"success": True, "message": f"left {name!r}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await read_json(request)
        name = str(body.get("group_name", "weight_update_group"))
        if name not in groups:
            raise BadRequestError(f"no weight-update group {name!r}: POST /init_weights_update_group first")
        empty = _allocate(body)
        tensors = await asyncio.to_thread(_receive, groups[name], empty)
        version = body.get("weight_version")
        aborted = await asyncio.wrap_future(state.batcher.update_weights(tensors, version))
        return {"success": True, "message": f"updated {len(tensors)} tensors; aborted {aborted} running requests"}


def _allocate(body: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Empty tensors to receive into, from the body's names, dtypes and shapes (BadRequestError when they do not
    line up: the trainer's broadcast then times out, after the group's timeout, instead of corrupting a tensor)."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes) and names):
        raise BadRequestError("update_weights_from_distributed needs names, dtypes and shapes: lists of one entry "
                              "per tensor, in the order the tensors are broadcast")
    try:
        return {str(n): torch.empty([int(d) for d in s], dtype=parse_dtype(t))
                for n, t, s in zip(names, dtypes, shapes, strict=True)}
    except (TypeError, ValueError) as err:
        raise BadRequestError(f"update_weights_from_distributed: {err}") from None


def _receive(group: WeightGroup, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for tensor in tensors.values():
        group.broadcast(tensor)
    return tensors
