"""The HTTP server: SGLang's native API (the subset slime uses) over the continuous batcher.

One uvicorn event loop parses requests and awaits futures; the model lives only in the scheduler thread.
Endpoints answer as SGLang does. `POST /update_weights_from_tensor` takes SGLang's JSON body (tensor_ipc.py:
`serialized_named_tensors` of handles to the sender's memory, load_format null or "flattened_bucket", read through
a restricted unpickler; or slimeflow's /dev/shm segment) and, beside it, the safetensors serialisation of HF-named
tensors (a full or partial state dict; `weight_version` a query parameter) from senders on other hosts;
`GET /get_weights_snapshot` (no SGLang twin) answers the served tensors in that form, for a restarted peer. Bad requests answer 400 with {"error": {"message"}, "message", "success": false}, never a stack trace.

Callers need the `--api-key` (guard.py: SGLang's Bearer scheme, every path but /health*); disk updates load only
from inside `--weights-dir`; request bodies are capped, and weight updates with NaN/Inf values are refused.

    python -m slimeflow.engine.server --model-path DIR [--host 127.0.0.1] [--port P] ...
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import orjson
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from slimeflow.engine import tensor_ipc
from slimeflow.engine.batcher import ADMISSION_WINDOW_S, Batcher, GenerateRequest
from slimeflow.engine.control import add_control_routes
from slimeflow.engine.guard import API_KEY_ENV, BodyTooLargeError, Guard
from slimeflow.engine.protocol import PromptLimits, parse_generate, to_response
from slimeflow.engine.sampling import BadRequestError, SamplingParams
from slimeflow.engine.shared_segment import LOAD_FORMAT, SegmentUpdate, read_segment
from slimeflow.engine.weights import (
    ForbiddenError,
    LoadedModel,
    load_model,
    read_checkpoint,
    update_body_limit,
)
from slimeflow.supervise import die_with_parent

log = logging.getLogger("slimeflow.engine")
HEALTH_GENERATE_TIMEOUT_S = 30.0
DEFAULT_MAX_BODY_MB = 64.0
DEFAULT_MAX_QUEUED = 16384
"""Requests waiting at once (each holds its prompt and a generator until it starts); a rollout keeps at most
--sglang-server-concurrency (512) in flight."""
"""A /generate of 4096 prompts of 2k token ids is ~50 MB; sglang-router's own cap is 512 MB."""


class QueueFullError(Exception):
    """More requests than --max-queued-requests would wait (answered 503: retry later)."""


@dataclass
class EngineState:
    """What the routes share: the model (read-only here), its scheduler and request counters."""

    loaded: LoadedModel
    batcher: Batcher
    model_path: str
    dtype: str
    max_batch_size: int
    limits: PromptLimits
    weights_dir: str | None = None
    """The only directory /update_weights_from_disk loads from (None: it loads nothing)."""
    model_path_version: str = "default"
    """The weight version of the checkpoint at `model_path` (what /resume_memory_occupation reloads)."""
    host: str = "127.0.0.1"
    """The address this engine serves on (and joins weight-update groups from)."""
    requests_received: int = 0
    segments: dict[str, torch.Tensor] = field(default_factory=dict)
    """The trainer's shared-memory segments (its two slots), each mapped once (shared_segment.read_segment)."""
    # Tokenising a long `text` takes seconds: done here, never on the event loop that answers /health.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize"))

    def stop(self) -> None:
        self.batcher.stop()
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


# What each refusal answers; the message says what to change.
_STATUSES: dict[type[Exception], int] = {BadRequestError: 400, ForbiddenError: 403, BodyTooLargeError: 413,
                                         QueueFullError: 503}


async def _answer(status: int, _: Request, err: Exception) -> JSONResponse:
    return _error(status, str(err))


def create_app(state: EngineState) -> FastAPI:
    """The FastAPI app serving `state`; the caller starts and stops `state.batcher`."""
    app = FastAPI(title="slimeflow embedded rollout engine")

    for error, status in _STATUSES.items():
        app.add_exception_handler(error, functools.partial(_answer, status))

    @app.exception_handler(Exception)
    async def internal(_: Request, err: Exception) -> JSONResponse:
        log.exception("request failed")
        return _error(500, f"internal engine error: {err!r}; see the engine log")

    @app.post("/generate")
    async def generate(request: Request):
        body = await _json(request)
        requests, is_batch = await _parse(state, body)
        _check_queue(state, len(requests))
        state.requests_received += len(requests)
        pending = state.batcher.submit_batch(requests) if is_batch else state.batcher.submit(requests[0])
        results = await asyncio.wrap_future(pending)
        results = results if is_batch else [results]
        logprob = bool(body.get("return_logprob", False))
        responses = [to_response(r, return_logprob=logprob) for r in results]
        # Serialised directly: FastAPI's default walks every item through jsonable_encoder first, ~0.6 ms for one
        # 128-token response with logprobs against ~5 us here, and 64 responses all finish on the same step.
        return Response(orjson.dumps(responses if is_batch else responses[0]), media_type="application/json")

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/health_generate")
    async def health_generate():
        if state.batcher.released:
            return _error(503, f"memory released ({sorted(state.batcher.released)}): POST /resume_memory_occupation")
        probe = GenerateRequest(rid=f"health-{time.monotonic_ns()}", input_ids=[_probe_token(state.loaded)],
                                params=SamplingParams(temperature=0.0, max_new_tokens=1))
        try:
            await asyncio.wait_for(asyncio.wrap_future(state.batcher.probe(probe)), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return _error(503, f"no token generated within {HEALTH_GENERATE_TIMEOUT_S}s (paused or overloaded?)")
        return PlainTextResponse("")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # There is no prefix cache to flush: every request's KV cache is freed when it finishes.
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _json(request)
        rid, everything = body.get("rid"), bool(body.get("abort_all", False))
        if not everything and not (isinstance(rid, str) and rid):
            raise BadRequestError('abort_request needs {"rid": "<request id>"} or {"abort_all": true}')
        aborted = await asyncio.wrap_future(state.batcher.abort(None if everything else rid))
        return {"success": True, "aborted": aborted}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        # SGLang's modes: abort (its default) returns every request with finish_reason abort; in_place keeps them.
        mode = (await _json(request)).get("mode", "abort")
        if mode not in ("abort", "in_place"):
            raise BadRequestError(f"pause_generation mode {mode!r} is not supported by the embedded engine; use "
                                  "'abort' (the default) or 'in_place' ('retract' is not built)")
        await asyncio.wrap_future(state.batcher.pause())
        if mode == "abort":
            await asyncio.wrap_future(state.batcher.abort(None))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        await asyncio.wrap_future(state.batcher.resume())
        return {"message": "Generation continued successfully.", "status": "ok"}

    _add_weight_routes(app, state)
    add_control_routes(app, state, _json)
    return app


def _add_weight_routes(app: FastAPI, state: EngineState) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequestError('update_weights_from_disk needs {"model_path": "<HF checkpoint dir>"}')
        tensors = await asyncio.to_thread(read_checkpoint, path, state.weights_dir)
        aborted = await asyncio.wrap_future(state.batcher.update_weights(tensors, body.get("weight_version")))
        state.model_path, state.model_path_version = path, state.batcher.weight_version
        return {"success": True, "message": f"loaded {len(tensors)} tensors from {path}; aborted {aborted} "
                                            "running requests", "num_paused_requests": 0}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request, weight_version: str | None = None):
        shared = finite = False
        if request.headers.get("content-type", "").startswith("application/json"):
            body = await _json(request)
            if body.get("load_format") == LOAD_FORMAT:
                segment = await asyncio.to_thread(_segment_update, body, state)
                tensors, shared, finite = segment.tensors, True, segment.finite
            else:
                tensors = await asyncio.to_thread(tensor_ipc.named_tensors, body, tp_rank=0)
            weight_version = body.get("weight_version", weight_version)
        else:
            payload = await request.body()
            try:
                tensors = await asyncio.to_thread(load_safetensors, payload)
            except (SafetensorError, ValueError) as err:
                raise BadRequestError(
                    f"the body is not safetensors bytes ({err}); send safetensors.torch.save(named_tensors)"
                ) from None
        # The trainer never writes the slot of a segment an engine serves from (shared_segment.py): serve from it.
        # It checked every value of a segment it marks finite as it wrote it: no second read of the bytes here.
        aborted = await asyncio.wrap_future(state.batcher.update_weights(tensors, weight_version, adopt=shared,
                                                                         checked_finite=finite))
        return {"success": True, "message": f"updated {len(tensors)} tensors; aborted {aborted} running requests"}

    @app.get("/get_weights_snapshot")
    async def get_weights_snapshot():
        # slimeflow's own (SGLang has no such endpoint): a restarted engine is given its live peers' weights with it
        # (fault_tolerance.py), as safetensors bytes that /update_weights_from_tensor reads back.
        from safetensors.torch import save as save_safetensors

        tensors, version = await asyncio.wrap_future(state.batcher.snapshot_weights())
        payload = await asyncio.to_thread(save_safetensors, tensors)
        return Response(payload, media_type="application/octet-stream", headers={"x-weight-version": version})

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": state.batcher.weight_version}

    # sglang-router asks /server_info and /model_info (newer SGLang names) when it registers a worker.
    @app.get("/get_model_info")
    @app.get("/model_info")
    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_model_info():
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "weight_version": state.batcher.weight_version, "requests_received": state.requests_received,
                "max_batch_size": state.max_batch_size, "dtype": state.dtype,
                "device": str(state.loaded.device), "admission_rounds": state.batcher.admission_rounds,
                # SGLang's server arguments that slime reads to size an external engine: one device, no parallelism.
                "tp_size": 1, "pp_size": 1, "ep_size": 1, "dp_size": 1, "disaggregation_mode": "null",
                **state.batcher.load()}


def _segment_update(body: dict, state: EngineState) -> SegmentUpdate:
    """The JSON form with slimeflow's /dev/shm segment (shared_segment.py); SGLang's own (tensor_ipc.py: handles
    to the sender's memory, load_format null or "flattened_bucket"; this engine is TP rank 0) is read apart."""
    entries = body.get("serialized_named_tensors")
    if not (isinstance(entries, list) and len(entries) == 1 and isinstance(entries[0], str)):
        raise BadRequestError(f"load_format {LOAD_FORMAT!r} takes one segment description in serialized_named_tensors")
    return read_segment(entries[0], state.segments)


async def _parse(state: EngineState, body: dict) -> tuple[list[GenerateRequest], bool]:
    """parse_generate; on the tokenizer pool when there is text to tokenise (token ids are checked in place)."""
    parse = functools.partial(parse_generate, body, tokenizer=state.loaded.tokenizer, limits=state.limits)
    if body.get("text") is None:
        return parse()
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, parse)


def _check_queue(state: EngineState, count: int) -> None:
    """Refuse (503, which clients retry) `count` more requests when the queue would pass --max-queued-requests."""
    waiting, limit = state.batcher.load()["waiting"], state.limits.max_prompts
    if waiting + count > limit:
        raise QueueFullError(f"the engine's queue is full: {waiting} requests wait and {count} more would pass "
                             f"--max-queued-requests {limit}; retry later, or raise it")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}, "message": message, "success": False},
                        status_code=status)


async def _json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as err:
        raise BadRequestError(f"the request body is not valid JSON ({err}); send a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


def _probe_token(loaded: LoadedModel) -> int:
    bos = loaded.tokenizer.bos_token_id
    return bos if bos is not None else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m slimeflow.engine.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="HF causal-LM directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded together")
    parser.add_argument("--admission-window-ms", type=float, default=ADMISSION_WINDOW_S * 1000,
                        help="longest a request waits for others to share its prefill round, unless the batch "
                             "fills first (0: admit each request as soon as the scheduler sees it)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--seed", type=int, default=0, help="seeds requests that give no sampling_seed")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process, the one that starts the engine, is gone")
    parser.add_argument("--api-key", default=None,
                        help=f"callers must send 'Authorization: Bearer KEY' on every path but /health* (as SGLang's "
                             f"--api-key); default: ${API_KEY_ENV}, which keeps the key out of `ps`; none: no check")
    parser.add_argument("--weights-dir", default=None,
                        help="the only directory /update_weights_from_disk loads from (default: none, no disk updates)")
    parser.add_argument("--max-request-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                        help="largest JSON request body (413 above it); /update_weights_from_tensor takes up to the "
                             "served model's float32 size instead")
    parser.add_argument("--context-length", type=int, default=None,
                        help="most tokens per prompt, completion included (default and maximum: the model's "
                             "max_position_embeddings)")
    parser.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED,
                        help="most requests waiting to start: a larger /generate answers 400, one that would "
                             "overfill the queue 503")
    return parser.parse_args(argv)


def build_server(args: argparse.Namespace) -> tuple[EngineState, uvicorn.Server]:
    """Load the model and build its batcher (not started) and HTTP server (not running), from the flags."""
    # The scheduler thread runs every forward pass with `threads`; the HTTP thread (weight parsing) keeps one.
    # Two OpenMP teams in one process count against each other: with more threads than cores, GNU OpenMP stops
    # spin-waiting, and the scheduler's small per-token ops slowed down 2-3x (a decode step at batch 64 took
    # 9.2 ms instead of 4.7 ms with 2 threads once this thread had run a 2-thread op).
    threads = args.num_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(args.model_path, dtype=args.dtype)
    batcher = Batcher(loaded, max_batch_size=args.max_batch_size, weight_version=args.weight_version,
                      seed=args.seed, admission_window_s=args.admission_window_ms / 1000, num_threads=threads)
    state = EngineState(loaded=loaded, batcher=batcher, model_path=args.model_path, dtype=args.dtype,
                        max_batch_size=args.max_batch_size,
                        limits=PromptLimits.of(loaded, context_length=args.context_length,
                                               max_prompts=args.max_queued_requests),
                        weights_dir=args.weights_dir, model_path_version=args.weight_version, host=args.host)
    if args.api_key is None:
        log.warning("serving without --api-key: any local process may update this engine's weights")
    app = Guard(create_app(state), api_key=args.api_key, max_body_bytes=int(args.max_request_body_mb * 2**20),
                limits={"/update_weights_from_tensor": update_body_limit(loaded.model)})
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=False))
    return state, server


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.api_key is None:  # popped: the processes this one starts (the C compiler) need not see it
        args.api_key = os.environ.pop(API_KEY_ENV, None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state, server = build_server(args)
    # What start-up allocated (modules, model, tokenizer) lives as long as the process: exempt it from garbage
    # collection, or every full collection walks it all (a ~250 ms stall every few dozen 256-sample requests).
    gc.freeze()
    if args.parent_pid is not None:  # shut down when the launcher is gone (so a killed test leaves no engine)
        die_with_parent(args.parent_pid, stop=lambda: setattr(server, "should_exit", True))
    state.batcher.start()
    log.info("serving %s on %s at http://%s:%d", args.model_path, state.loaded.device, args.host, args.port)
    try:
        server.run()
    finally:
        state.stop()
    sys.exit(0)


class EngineThread:
    """The engine served from a thread of the calling process: the same HTTP API at `.url`, without a process of
    its own (no second interpreter importing torch and transformers: 2.5-3 CPU seconds of a start-up). It loads
    the model on that thread, so the caller can go on meanwhile; `wait_ready` waits for it. For a process whose
    own work alternates with the engine's (the RolloutManager waits for its rollouts): both share one GIL.

    What EngineLaunch uses of launch.EngineProcess: `url`, `wait_ready(path, timeout_s)`, `stop()`.
    """

    def __init__(self, argv: list[str], api_key: str | None = None) -> None:
        self.args = parse_args(argv)
        if api_key is not None:
            self.args.api_key = api_key
        self.api_key = self.args.api_key
        self.url = f"http://{self.args.host}:{self.args.port}"
        self.state: EngineState | None = None
        self.server: uvicorn.Server | None = None
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.args.port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            state, server = build_server(self.args)
            state.batcher.start()
            self.state, self.server = state, server
            if self._stopping.is_set():
                return
            server.run()  # uvicorn installs no signal handlers off the main thread
        except BaseException as err:  # noqa: BLE001 - reported by wait_ready, in the caller's thread
            self.error = err
            log.exception("the in-process engine failed")
        finally:
            if self.state is not None:
                self.state.stop()

    def wait_ready(self, path: str = "/health", timeout_s: float = 120.0) -> None:
        """Until the server has started listening (`path` is EngineProcess's probe; in process, the server's own start
        is the sign); raises RuntimeError (why it failed) or TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.error is not None:
                self.stop()
                raise RuntimeError(f"the in-process engine for {self.args.model_path} failed to start: "
                                   f"{type(self.error).__name__}: {self.error}") from self.error
            if self.server is not None and self.server.started:
                return
            if not self._thread.is_alive():
                raise RuntimeError(f"the in-process engine for {self.args.model_path} stopped before serving")
            time.sleep(0.01)
        self.stop()
        raise TimeoutError(f"the in-process engine for {self.args.model_path} did not start serving within "
                           f"{timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and join the thread (idempotent)."""
        self._stopping.set()
        if self.server is not None:
            self.server.should_exit = True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


if __name__ == "__main__":
    main()
