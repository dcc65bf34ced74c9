"""SGLang's /generate wire format: request bodies into GenerateRequests, GenerateResults into response dicts."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from slimeflow.engine.batcher import GenerateRequest, GenerateResult
from slimeflow.engine.sampling import BadRequestError, SamplingParams, parse_sampling_params

if TYPE_CHECKING:
    from slimeflow.engine.weights import LoadedModel

# Top-level /generate fields SGLang accepts (sglang-router fills them all in) that change nothing here at these
# values; any other value asks for a feature this engine lacks, so it is refused rather than ignored.
_NEUTRAL_FIELDS = {"stream": False, "return_text_in_logprobs": False, "top_logprobs_num": 0,
                   "return_hidden_states": False, "background": False, "return_bytes": False,
                   "return_entropy": False}
# Fields that only steer logging, routing or input logprobs (not returned here): any value is fine.
_INFORMATIONAL_FIELDS = {"model", "log_metrics", "no_logs"}
_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "logprob_start_len"}
# No token of a vocabulary is this many times longer than its vocabulary entry: a margin for normalisers (NFC
# composes two or three characters into one) in the bound on a text's length below.
_NORMALISER_MARGIN = 4


@dataclass(frozen=True)
class PromptLimits:
    """What a /generate may hold: at most `max_prompts` prompts (--max-queued-requests); token ids below
    `vocab_size`; fewer than `max_positions` tokens per prompt, completion included (--context-length); and, for
    text, at most `max_text_chars` characters, past which it cannot tokenise into fewer than `max_positions` tokens
    (so it is refused without tokenising)."""

    max_positions: int
    vocab_size: int
    max_text_chars: int
    max_prompts: int

    @classmethod
    def of(cls, loaded: LoadedModel, *, context_length: int | None, max_prompts: int) -> PromptLimits:
        """Raises ValueError when `context_length` (None: the model's) is beyond the model's positions."""
        positions = context_length or loaded.max_positions
        if not 0 < positions <= loaded.max_positions:
            raise ValueError(f"--context-length {positions} is not in [1, {loaded.max_positions}] (the model's "
                             "max_position_embeddings): the model attends to no position past that")
        longest = max((len(token) for token in loaded.tokenizer.get_vocab()), default=1)
        return cls(positions, int(loaded.model.config.vocab_size), _NORMALISER_MARGIN * longest * positions,
                   max_prompts)


def parse_generate(body: Any, *, tokenizer: PreTrainedTokenizerBase,
                   limits: PromptLimits) -> tuple[list[GenerateRequest], bool]:
    """The requests of a /generate body and whether it was a batch (input_ids a list of lists, or text a list).

    Raises BadRequestError naming the field and how to fix it.
    """
    if not isinstance(body, dict):
        raise BadRequestError("the /generate body must be a JSON object with input_ids or text")
    _check_fields(body)
    max_positions, vocab_size = limits.max_positions, limits.vocab_size
    prompts, is_batch = _prompts(body, tokenizer, limits)
    if len(prompts) > limits.max_prompts:
        raise BadRequestError(f"a /generate of {len(prompts)} prompts is more than the engine queues "
                              f"(--max-queued-requests {limits.max_prompts}); send fewer per request or raise it")
    params = _per_item(body.get("sampling_params"), len(prompts), "sampling_params", dict)
    rids = _per_item(body.get("rid"), len(prompts), "rid", str)
    if is_batch and isinstance(body.get("rid"), str):
        rids = _distinct(body["rid"], len(prompts))
    start = _logprob_start(body)
    requests = []
    parsed: dict[tuple, SamplingParams] = {}  # a batch's items mostly differ in their seed only: check once
    for prompt, raw, rid in zip(prompts, params, rids, strict=True):
        room = max_positions - len(prompt)
        if room <= 0:
            raise BadRequestError(
                f"the prompt has {len(prompt)} tokens, at or beyond the engine's context length ({max_positions}: "
                "--context-length, at most the model's max_position_embeddings); shorten it"
            )
        sampling = _sampling(raw, room, vocab_size, parsed)
        if start is not None and (sampling.max_new_tokens != 0 or start >= len(prompt)):
            raise BadRequestError(
                f"logprob_start_len {start} with return_logprob: the embedded engine returns input-token log-probs "
                "only with max_new_tokens 0 (a teacher scoring a sequence, as slime's on-policy distillation asks) "
                f"and a start inside the prompt ({len(prompt)} tokens); send max_new_tokens 0, or logprob_start_len -1")
        requests.append(GenerateRequest(rid=rid or uuid.uuid4().hex, input_ids=prompt, params=sampling,
                                        logprob_start_len=start))
    return requests, is_batch


def _logprob_start(body: dict) -> int | None:
    """The position input-token log-probs start at, or None: SGLang returns them with return_logprob and a
    logprob_start_len >= 0 (-1, its default, asks for none)."""
    start = body.get("logprob_start_len")
    if start is not None and (type(start) is not int or start < -1):
        raise BadRequestError(f"logprob_start_len must be an integer >= -1, got {start!r}")
    return start if body.get("return_logprob") and start is not None and start >= 0 else None


def _sampling(raw: dict | None, room: int, vocab_size: int, parsed: dict[tuple, SamplingParams]) -> SamplingParams:
    """parse_sampling_params, reusing the checked parameters of an earlier item that differs only in its seed."""
    seed = None if raw is None else raw.get("sampling_seed")
    if not (seed is None or (isinstance(seed, int) and not isinstance(seed, bool))):
        return parse_sampling_params(raw, room=room, vocab_size=vocab_size)  # raises, naming the field
    try:
        key = (room, *sorted((k, type(v).__name__, v) for k, v in (raw or {}).items() if k != "sampling_seed"))
        hash(key)
    except TypeError:  # a list value (stop strings, stop_token_ids): check this item on its own
        return parse_sampling_params(raw, room=room, vocab_size=vocab_size)
    if key not in parsed:
        parsed[key] = parse_sampling_params({**(raw or {}), "sampling_seed": None}, room=room, vocab_size=vocab_size)
    return dataclasses.replace(parsed[key], sampling_seed=seed)


def _check_fields(body: dict) -> None:
    unknown = sorted(set(body) - _FIELDS - set(_NEUTRAL_FIELDS) - _INFORMATIONAL_FIELDS)
    if unknown:
        raise BadRequestError(f"unknown /generate fields {unknown}; supported: {sorted(_FIELDS)}")
    for name, neutral in _NEUTRAL_FIELDS.items():
        if body.get(name) not in (neutral, None):
            raise BadRequestError(f"/generate field {name}={body[name]!r} is not supported by the embedded "
                                  f"engine; omit it or set it to {neutral!r}")


def _prompts(body: dict, tokenizer: PreTrainedTokenizerBase, limits: PromptLimits) -> tuple[list[list[int]], bool]:
    ids, text, vocab_size = body.get("input_ids"), body.get("text"), limits.vocab_size
    if (ids is None) == (text is None):
        raise BadRequestError("/generate needs exactly one of input_ids (token ids) or text")
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequestError("/generate text must be a non-empty string or a non-empty list of them")
        longest = max(len(t) for t in texts)
        if longest > limits.max_text_chars:
            raise BadRequestError(
                f"a /generate text has {longest} characters: more than {limits.max_text_chars}, so more tokens than "
                f"the engine's context length ({limits.max_positions}, --context-length); shorten it"
            )
        return [tokenizer(t).input_ids for t in texts], isinstance(text, list)
    is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if is_batch else [ids]
    for i, prompt in enumerate(prompts):
        where = f"input_ids[{i}]" if is_batch else "input_ids"
        if not isinstance(prompt, list) or not prompt:
            raise BadRequestError(f"{where} is empty or not a list; send at least one token id")
        if not all(type(t) is int and 0 <= t < vocab_size for t in prompt):  # JSON ints: bool is not one
            raise BadRequestError(f"{where} must hold integer token ids in [0, {vocab_size})")
    return prompts, is_batch


def _per_item(value: Any, count: int, name: str, kind: type) -> list[Any]:
    """A field given once (applies to every prompt) or as a list with one entry per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * count
    if isinstance(value, list) and len(value) == count and all(v is None or isinstance(v, kind) for v in value):
        return value
    raise BadRequestError(f"/generate {name} must be one {kind.__name__} or a list of {count} of them")


def _distinct(rid: str, count: int) -> list[str]:
    # One rid for a batch names the whole batch: items get rid-0, rid-1, ... so abort by item still works.
    return [f"{rid}-{i}" for i in range(count)]


def to_response(result: GenerateResult, *, return_logprob: bool) -> dict[str, Any]:
    """The SGLang response dict of one finished request."""
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": result.weight_version,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None]
                                         for lp, tok in zip(result.output_logprobs, result.output_ids, strict=True)]
        if result.input_token_logprobs is not None:
            meta["input_token_logprobs"] = result.input_token_logprobs
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}
