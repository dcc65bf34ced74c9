"""Continuous batching: one scheduler thread owns the model and serves every request with shared forward passes.

Each loop turn: run the commands that arrived (new requests, aborts, pause, weight updates), prefill the
waiting requests that fit under `max_batch_size` and merge them into the running batch, decode one token for
every running sequence, and retire the finished ones. Weight updates run between decode steps; the sequences
running at that moment are finished with `abort` (their partial output returned), so no response mixes two
weight versions. Requests still queued are not aborted: they start later, on the new weights.

Requests that arrive together over HTTP reach the scheduler spread over tens of milliseconds (64 fresh
connections: 10-30 ms on a busy CPU). Admitting whatever has arrived splits them into several prefill rounds,
each merged into the batch with a copy of its cache. So waiting requests are admitted once they fill the batch
or the oldest has waited `admission_window_s` (TGI's max-waiting-tokens plays the same part); the running
batch keeps decoding meanwhile, and no request waits longer than the window for a free slot. Prompts that come
in one batched /generate (`submit_batch`) are all there at once: nothing is waited for when they are the newest.

Each call's requests wait in a lane of their own and are admitted round-robin between calls (lanes.py), so one
huge call does not hold back the calls after it; health probes (`probe`) need no slot and start at the next turn.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from slimeflow.engine import kv_batch
from slimeflow.engine.lanes import Lanes
from slimeflow.engine.native import select_forward
from slimeflow.engine.sampling import BadRequestError, SamplingParams, sample_rows
from slimeflow.engine.weights import (
    LoadedModel,
    UpdateNames,
    apply_update,
    check_finite,
    check_update,
    free_weights,
    restore_weights,
)

log = logging.getLogger(__name__)

ADMISSION_WINDOW_S = 0.02
"""How long a waiting request may be held for others to join its prefill round, unless the batch fills first:
two decode steps of the benchmark's batch of 64, ~1.5% of the time its 128-token responses take."""


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to complete; `rid` is the id abort_request names it by."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    logprob_start_len: int | None = None
    """Return the log-probs of the input tokens from this position (SGLang's input_token_logprobs); only with
    max_new_tokens 0 here: a teacher scoring a sequence, as slime's on-policy distillation asks."""


@dataclass(frozen=True)
class GenerateResult:
    """A finished request. `output_logprobs[i]` is log p(output_ids[i]) under the logits over the request's
    temperature (greedy: temperature 1).

    `finish_reason` is SGLang's {"type": "stop"|"length"|"abort", "matched": id | str | None}; `weight_version`
    is the version every output token was generated with.
    """

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict[str, Any]
    weight_version: str
    input_token_logprobs: list[list[Any]] | None = None
    """SGLang's [[logprob, token id, None], ...] of the input tokens from logprob_start_len (the first token's
    logprob None), under the logits over the request's temperature; None unless asked for."""


class _Batch:
    """The results of one submit_batch, and the one future that gets them when the last member finishes."""

    def __init__(self, size: int) -> None:
        self.future: Future = Future()
        self.results: list[GenerateResult | None] = [None] * size
        self.left = size
        if not size:
            self.future.set_result([])

    def fail(self, err: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(err)


class _BatchMember:
    """What a member of a submit_batch has where a lone request has its Future (the same three methods)."""

    __slots__ = ("batch", "position")

    def __init__(self, batch: _Batch, position: int) -> None:
        self.batch, self.position = batch, position

    def done(self) -> bool:
        return self.batch.results[self.position] is not None or self.batch.future.done()

    def set_result(self, result: GenerateResult) -> None:
        batch = self.batch
        if batch.results[self.position] is None:
            batch.results[self.position] = result
            batch.left -= 1
            if not batch.left and not batch.future.done():
                batch.future.set_result(batch.results)

    def set_exception(self, err: BaseException) -> None:
        self.batch.fail(err)


@dataclass(eq=False)  # compared by identity: two identical requests are still two sequences
class _Sequence:
    request: GenerateRequest
    future: Future | _BatchMember
    generator: random.Random  # this request's uniforms: one per sampled token, whatever shares the batch
    arrived: float  # time.monotonic() at submit
    ends_batch: bool = False  # the last prompt of a submit_batch: the requests that came with it are all here
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    input_token_logprobs: list[list[Any]] | None = None


class Batcher:
    """The scheduler thread and its queue; all public methods are thread-safe and return futures."""

    def __init__(self, loaded: LoadedModel, *, max_batch_size: int = 64, weight_version: str = "default",
                 seed: int = 0, admission_window_s: float = ADMISSION_WINDOW_S, num_threads: int | None = None,
                 share_prefixes: bool = True) -> None:
        """`num_threads`: torch threads of the scheduler thread, which runs every forward pass; None takes the
        count of the thread that builds the batcher (torch.set_num_threads applies to the thread that calls it
        only: a new thread starts with one per core). `share_prefixes`: prompts prefilled together run their
        common first tokens once (kv_batch.prefill; SGLang's prefix cache, within one prefill)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if admission_window_s < 0:
            raise ValueError(f"admission_window_s must be >= 0, got {admission_window_s}")
        self._admission_window_s = admission_window_s
        self._share_prefixes = share_prefixes
        self._num_threads = num_threads or torch.get_num_threads()
        self.admission_rounds = 0  # prefill rounds so far (each merges its requests into the running batch)
        self._loaded = loaded
        self._forward = select_forward(loaded.model, self._num_threads)
        self._names = UpdateNames(loaded.model)  # checkpoint names in updates and snapshots
        self._max_batch_size = max_batch_size
        self._weight_version = weight_version
        self._seeds = random.Random(seed)  # seeds requests that give no sampling_seed
        self._inbox: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._waiting: Lanes[_Sequence] = Lanes()
        self._probes: list[_Sequence] = []  # one-token requests: finished at their first token, they need no slot
        self._running: list[_Sequence] = []
        self._kv: kv_batch.KVBatch | None = None
        self._paused = False
        self._released: frozenset[str] = frozenset()  # MEMORY_TAGS whose memory is freed (release_memory)
        self._freed_shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._borrowed: frozenset[int] = frozenset()  # ids of parameters that are views of a trainer's segment
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def released(self) -> frozenset[str]:
        """The memory tags released and not resumed yet (while any is, requests wait)."""
        return self._released

    def load(self) -> dict[str, int]:
        """How many sequences are running and waiting (a snapshot; may be stale by the time it is read)."""
        return {"running": len(self._running), "waiting": len(self._waiting)}

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the scheduler thread; requests not finished are failed with RuntimeError."""
        self._stopping.set()
        self._thread.join(timeout_s)
        for seq in [*self._running, *self._waiting, *self._probes]:
            if not seq.future.done():
                seq.future.set_exception(RuntimeError("the engine stopped before the request finished"))

    # ---- commands (called from any thread, run on the scheduler thread) -----------------------------------

    def _call(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        if self._stopping.is_set():
            future.set_exception(RuntimeError("the engine is stopping; it accepts no more work"))
        else:
            self._inbox.put((fn, future))
        return future

    def submit(self, request: GenerateRequest) -> Future:
        """Queue a request; the future resolves to its GenerateResult."""
        result: Future = Future()
        arrived = time.monotonic()

        def enqueue() -> None:
            self._waiting.add([self._sequence(request, result, arrived)])

        self._call(enqueue).add_done_callback(lambda f: f.exception() and result.set_exception(f.exception()))
        return result

    def submit_batch(self, requests: list[GenerateRequest]) -> Future:
        """Queue requests that arrived together (one batched /generate); the future resolves to their results, in
        order, once all have finished (or fails with the first failure).

        They reach the scheduler in one command, so the admission window does not hold them for others; and they
        share one future, where a future per request cost the event loop a wake-up each (256 one-token samples:
        ~10 ms of a 25 ms round trip).
        """
        batch = _Batch(len(requests))
        arrived = time.monotonic()

        def enqueue() -> None:
            self._waiting.add([self._sequence(request, _BatchMember(batch, position), arrived,
                                              ends_batch=position == len(requests) - 1)
                               for position, request in enumerate(requests)])

        self._call(enqueue).add_done_callback(lambda f: f.exception() and batch.fail(f.exception()))
        return batch.future

    def probe(self, request: GenerateRequest) -> Future:
        """Generate one token for `request` ahead of every waiting request, without a batch slot (a liveness
        check: it answers at the next scheduler turn, however many requests wait); resolves to its result."""
        if request.params.max_new_tokens != 1:
            raise ValueError(f"a probe generates exactly one token, not max_new_tokens={request.params.max_new_tokens}")
        result: Future = Future()
        arrived = time.monotonic()
        self._call(lambda: self._probes.append(self._sequence(request, result, arrived))).add_done_callback(
            lambda f: f.exception() and result.set_exception(f.exception()))
        return result

    def _sequence(self, request: GenerateRequest, future: Future | _BatchMember, arrived: float,
                  ends_batch: bool = False) -> _Sequence:
        """A queued request with its own RNG: seeded by sampling_seed, else by the engine's seed stream (drawn on
        the scheduler thread, so the order of arrival decides it)."""
        seed = request.params.sampling_seed
        generator = random.Random(seed if seed is not None else self._seeds.getrandbits(63))
        return _Sequence(request=request, future=future, generator=generator, arrived=arrived, ends_batch=ends_batch)

    def abort(self, rid: str | None = None) -> Future:
        """Finish request `rid` (None: every request) with finish_reason abort; resolves to how many were hit."""
        return self._call(lambda: self._abort(lambda seq: rid is None or seq.request.rid == rid))

    def pause(self) -> Future:
        """Stop decoding; running requests stay in place and new ones queue until `resume`."""
        return self._call(lambda: setattr(self, "_paused", True))

    def resume(self) -> Future:
        """Decode again; fails with BadRequestError (and stays paused) when the push that paused the engine left a
        fused tensor incomplete (some of a MoE layer's experts): the push is over and cannot complete it."""

        def run() -> None:
            if self._names.held:
                raise BadRequestError(self._names.incomplete("the weight push ended"))
            self._paused = False

        return self._call(run)

    def update_weights(self, update: dict[str, torch.Tensor], weight_version: str | None,
                       adopt: bool = False, checked_finite: bool = False) -> Future:
        """Check checkpoint-named tensors and put them into the model between steps, aborting running sequences
        first. The pieces of a fused tensor (a MoE layer's experts) wait until the update that completes it.

        Resolves to the number of aborted sequences, or fails with BadRequestError (nothing changed) when a
        name or shape does not match the model or a value is NaN or Inf. `weight_version` None keeps the current version string. `adopt`:
        parameters become views of the tensors where dtypes match (a trainer's shared segment: weights.apply_update).
        `checked_finite`: the sender checked every value already (a trainer's segment marked so): no NaN/Inf pass.
        """

        def run() -> int:
            if "weights" in self._released:
                raise BadRequestError("the engine's weights are released: POST /resume_memory_occupation first")
            if not update:
                raise BadRequestError("the weight update holds no tensors; send at least one HF-named tensor")
            ready, held = self._names.convert(update, weight_version)
            if ready:
                check_update(self._loaded.model.state_dict(), ready)
            if not checked_finite:
                check_finite(update, self._weight_version)  # here, not on another thread: one wake-up per update
            self._names.hold(held, weight_version)
            aborted = self._abort(lambda seq: seq in self._running) if ready else 0
            self._borrowed = apply_update(self._loaded.model, ready, self._borrowed, adopt)
            self._forward.refresh()
            if weight_version is not None:
                self._weight_version = weight_version
            return aborted

        return self._call(run)

    def snapshot_weights(self) -> Future:
        """A copy of the served tensors under checkpoint names and their version, taken between steps (so no update
        is half applied): resolves to (tensors, weight_version)."""

        def run() -> tuple[dict[str, torch.Tensor], str]:
            if "weights" in self._released:
                raise BadRequestError("the engine's weights are released: POST /resume_memory_occupation first")
            with torch.no_grad():
                served = self._loaded.model.state_dict()
                named = self._names.to_checkpoint(served)  # pieces of fused tensors are copies already
                return {name: t.detach().clone() if served.get(name) is t else t for name, t in named.items()}, \
                    self._weight_version

        return self._call(run)

    def release_memory(self, tags: frozenset[str]) -> Future:
        """Free the model's parameters ('weights') and the KV cache ('kv_cache'), as SGLang's
        /release_memory_occupation: requests queue until `resume_memory`. Fails with BadRequestError while any
        request runs (SGLang releases idle engines only: pause with mode abort, or let them finish)."""

        def run() -> None:
            if self._running:
                raise BadRequestError(f"{len(self._running)} requests are running: release memory when the engine is "
                                      "idle (POST /pause_generation {\"mode\": \"abort\"} first, or let them finish)")
            if "kv_cache" in tags:
                self._kv = None
            if "weights" in tags and "weights" not in self._released:
                self._freed_shapes = free_weights(self._loaded.model)
                self._borrowed = frozenset()
            self._released = self._released | tags

        return self._call(run)

    def resume_memory(self, tags: frozenset[str], weights: dict[str, torch.Tensor] | None,
                      weight_version: str | None) -> Future:
        """Take back the memory of `tags`; for 'weights', allocate the parameters again and fill them from `weights`
        (every parameter, HF names), which then serve as `weight_version`."""

        def run() -> None:
            if "weights" in tags and "weights" in self._released:
                if weights is None:
                    raise BadRequestError("resuming the weights needs their tensors")
                restore_weights(self._loaded.model, self._freed_shapes, self._names.complete(weights, "the checkpoint"))
                self._forward.refresh()
                self._freed_shapes = {}
                if weight_version is not None:
                    self._weight_version = weight_version
            self._released = self._released - tags

        return self._call(run)

    # ---- the scheduler thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_num_threads(self._num_threads)
        with torch.inference_mode():
            while not self._stopping.is_set():
                self._run_commands(wait_s=self._idle_wait_s())
                if self._halted:
                    continue
                try:
                    self._admit()
                    if self._running:
                        self._step()
                except Exception as err:  # a failing forward pass fails its requests, not the engine
                    log.exception("engine step failed; failing %d running requests", len(self._running))
                    for seq in self._running:
                        seq.future.set_exception(RuntimeError(f"engine step failed: {err!r}"))
                    self._running, self._kv = [], None

    def _idle_wait_s(self) -> float:
        """How long to wait for a command before this turn: 0 while decoding, the rest of the admission window
        while only held requests wait, else a short wait (so that stop() is noticed without a wake-up)."""
        if self._running and not self._halted:
            return 0.0
        if (self._waiting or self._probes) and not self._halted:
            return max(0.0, self._admission_due() - time.monotonic())
        return 0.2

    @property
    def _halted(self) -> bool:
        """Paused, or some memory released: nothing is admitted or decoded."""
        return self._paused or bool(self._released)

    def _admission_due(self) -> float:
        """When the waiting requests must be admitted (now if they fill the batch's free slots)."""
        if (self._probes or len(self._waiting) >= self._max_batch_size - len(self._running)
                or self._waiting.newest_ends_batch()):
            return 0.0
        return self._waiting.oldest_arrival() + self._admission_window_s

    def _run_commands(self, wait_s: float) -> None:
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            try:
                future.set_result(fn())
            except Exception as err:
                future.set_exception(err)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self) -> None:
        room = self._max_batch_size - len(self._running)
        if not ((self._waiting and room) or self._probes) or time.monotonic() < self._admission_due():
            return
        self.admission_rounds += 1
        newcomers, self._probes = [*self._probes, *self._waiting.take(room)], []
        for seq in [s for s in newcomers if s.request.params.max_new_tokens == 0]:
            if seq.request.logprob_start_len is not None:
                seq.input_token_logprobs = self._input_logprobs(seq.request)
            self._finish(seq, {"type": "length", "length": 0})
        newcomers = [s for s in newcomers if s.finish is None]
        if not newcomers:
            return
        try:
            self._prefill(newcomers)
        except Exception:  # they are in neither queue now: fail them here, the loop fails the running ones
            for seq in newcomers:
                if not seq.future.done():
                    seq.future.set_exception(RuntimeError("the engine's prefill failed; see the engine log"))
            raise

    def _input_logprobs(self, request: GenerateRequest) -> list[list[Any]]:
        """log p(token i | tokens before it) for i >= logprob_start_len, over the request's temperature (greedy: 1),
        from one forward over the whole input (no cache kept)."""
        ids = request.input_ids
        logits = self._loaded.model(input_ids=torch.tensor([ids], device=self._loaded.device),
                                    use_cache=False).logits[0, :-1].float()
        temperature = request.params.temperature or 1.0
        targets = torch.tensor(ids[1:], device=logits.device)[:, None]
        chosen = torch.log_softmax(logits / temperature, -1).gather(-1, targets)[:, 0].tolist()
        logprobs = [None, *chosen]
        start = request.logprob_start_len or 0
        return [[logprobs[i], ids[i], None] for i in range(start, len(ids))]

    def _prefill(self, newcomers: list[_Sequence]) -> None:
        """Prefill and sample the newcomers' first tokens; those not finished join the running batch."""
        # Sequences with the same prompt (a GRPO group's n samples) share one prefill, as SGLang's prefix cache
        # shares it: each gets a copy of its rows. A group of 16 was 16 times the prefill's compute.
        prompts: dict[tuple[int, ...], list[_Sequence]] = {}
        for seq in newcomers:
            prompts.setdefault(tuple(seq.request.input_ids), []).append(seq)
        unique = list(prompts.values())
        batches = []
        for rows in kv_batch.prefill_groups([len(users[0].request.input_ids) for users in unique]):
            batch, logits = kv_batch.prefill(self._forward, [unique[i][0].request.input_ids for i in rows],
                                             self._loaded.device,
                                             headroom=max(s.request.params.max_new_tokens for i in rows
                                                          for s in unique[i]),
                                             share_prefix=self._share_prefixes)
            group = [s for i in rows for s in unique[i]]
            source = [k for k, i in enumerate(rows) for _ in unique[i]]  # the prefilled row of each of `group`
            self._sample(group, _rows(logits, source))
            alive = [k for k, s in enumerate(group) if s.finish is None]  # done at their first token: no cache
            if alive:
                needed = [source[k] for k in alive]
                batches.append(batch if needed == list(range(len(rows))) else kv_batch.gather_rows(batch, needed))
                self._running.extend(group[k] for k in alive)
        if batches:
            self._kv = kv_batch.merge(self._kv, *batches)

    def _step(self) -> None:
        logits = kv_batch.decode(self._forward, self._kv, [s.output_ids[-1] for s in self._running])
        self._sample(self._running, logits)
        self._retire()

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        # 24 random bits: a float32 in [0, 1) exactly, as torch.rand draws it, from Python's Mersenne Twister in
        # ~100 ns where a torch.Generator draw costs microseconds (64 a step).
        uniforms = torch.tensor([0.0 if s.request.params.temperature == 0
                                 else s.generator.getrandbits(24) * 2.0 ** -24 for s in seqs])
        step = sample_rows(logits, [s.request.params for s in seqs], uniforms)
        for seq, token, logprob in zip(seqs, step.tokens, step.logprobs, strict=True):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            reason = self._stop_reason(seq)
            if reason is not None:
                self._finish(seq, reason)

    def _stop_reason(self, seq: _Sequence) -> dict[str, Any] | None:
        params, token = seq.request.params, seq.output_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self._loaded.eos_token_ids):
            return {"type": "stop", "matched": token}
        if params.stop:
            # A match must end in the newest token (earlier ones were checked at earlier steps), so decoding a
            # tail of 4 tokens per character (UTF-8's worst case) plus a margin is enough.
            window = 4 * max(len(s) for s in params.stop) + 8
            tail = self._loaded.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=False)
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if len(seq.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def _abort(self, hit: Callable[[_Sequence], bool]) -> int:
        victims = [s for s in [*self._running, *self._waiting] if hit(s)]
        for seq in victims:
            self._finish(seq, {"type": "abort", "message": "aborted by abort_request or a weight update"})
        self._waiting.remove(lambda s: s.finish is not None)
        self._retire()
        return len(victims)

    def _retire(self) -> None:
        """Drop finished sequences from the running batch and its KV cache."""
        alive = [s.finish is None for s in self._running]
        if all(alive):
            return
        keep = kv_batch.compaction_order(alive)
        self._kv = kv_batch.select(self._kv, keep) if self._kv is not None else None
        self._running = [self._running[i] for i in keep]

    def _finish(self, seq: _Sequence, reason: dict[str, Any]) -> None:
        seq.finish = reason
        if not seq.future.done():
            seq.future.set_result(self._result(seq))

    def _result(self, seq: _Sequence) -> GenerateResult:
        params = seq.request.params
        text = self._loaded.tokenizer.decode(seq.output_ids, skip_special_tokens=params.skip_special_tokens)
        matched = seq.finish.get("matched")
        if isinstance(matched, str) and not params.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        return GenerateResult(
            rid=seq.request.rid, prompt_tokens=len(seq.request.input_ids), output_ids=list(seq.output_ids),
            output_logprobs=list(seq.logprobs), text=text, finish_reason=dict(seq.finish),
            weight_version=self._weight_version, input_token_logprobs=seq.input_token_logprobs,
        )


def _rows(logits: torch.Tensor, source: list[int]) -> torch.Tensor:
    """Row source[i] of `logits` as row i (no copy when that is every row once, in order)."""
    if source == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(source, device=logits.device))
