"""Per-request sampling parameters (SGLang's names) and one vectorised sampling step over a batch of logits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default when a request gives no max_new_tokens."""

# Parameters SGLang accepts that this engine does not implement: accepted only at their neutral value, so a
# request that relies on them fails loudly instead of being sampled differently from what it asked for.
_NEUTRAL_ONLY: dict[str, Any] = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
}
# Accepted and honoured by the text detokenisation only (they never change the sampled tokens).
_TEXT_OPTIONS = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


class BadRequestError(ValueError):
    """A request the engine cannot serve as given; the message says what is wrong and how to fix it (HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 is greedy; top_k -1 and top_p 1 are off.

    Generation stops at `max_new_tokens`, at any id in `stop_token_ids` (and the model's EOS ids unless
    `ignore_eos`), or when the decoded output contains one of `stop` (trimmed from the text unless
    `no_stop_trim`). `sampling_seed` makes sampled output reproducible; None draws a seed from the engine's RNG.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


def parse_sampling_params(raw: Mapping[str, Any] | None, *, room: int, vocab_size: int) -> SamplingParams:
    """Validate a request's `sampling_params` dict; `room` is how many tokens fit after the prompt.

    Raises BadRequestError naming the parameter, its value and what is allowed.
    """
    raw = dict(raw or {})
    known = {f for f in SamplingParams.__dataclass_fields__}
    unknown = sorted(set(raw) - known - set(_NEUTRAL_ONLY))
    if unknown:
        raise BadRequestError(
            f"unknown sampling_params {unknown}; supported: {sorted(known)} "
            f"(and {sorted(_NEUTRAL_ONLY)} at their neutral values only)"
        )
    for name, neutral in _NEUTRAL_ONLY.items():
        if name in raw and raw.pop(name) != neutral:
            raise BadRequestError(
                f"sampling_params.{name} is not supported by the embedded engine; omit it or set it to {neutral!r}"
            )
    if raw.get("max_new_tokens") is None:
        raw["max_new_tokens"] = min(DEFAULT_MAX_NEW_TOKENS, room)
    params = SamplingParams(
        temperature=_number(raw, "temperature", 1.0, low=0.0),
        top_p=_number(raw, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=_integer(raw, "top_k", -1),
        max_new_tokens=_integer(raw, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
        stop=_stop_strings(raw.get("stop")),
        stop_token_ids=_token_ids(raw.get("stop_token_ids"), vocab_size),
        ignore_eos=bool(raw.get("ignore_eos", False)),
        sampling_seed=None if raw.get("sampling_seed") is None else _integer(raw, "sampling_seed", 0),
        **{name: bool(raw[name]) for name in _TEXT_OPTIONS if name in raw},
    )
    _check_limits(params, room)
    return params


def _check_limits(params: SamplingParams, room: int) -> None:
    if params.top_k == 0 or params.top_k < -1:
        raise BadRequestError(f"sampling_params.top_k must be -1 (off) or >= 1, got {params.top_k}")
    if params.max_new_tokens < 0:
        raise BadRequestError(f"sampling_params.max_new_tokens must be >= 0, got {params.max_new_tokens}")
    if params.max_new_tokens > room:
        raise BadRequestError(
            f"sampling_params.max_new_tokens={params.max_new_tokens} does not fit: the prompt leaves room for "
            f"{room} tokens within the engine's context length (--context-length, at most the model's "
            "max_position_embeddings); lower max_new_tokens or shorten the prompt"
        )


def _number(raw: dict, name: str, default: float, *, low: float, high: float | None = None,
            low_open: bool = False) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequestError(f"sampling_params.{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
        raise BadRequestError(f"sampling_params.{name} must be in {bounds}, got {value!r}")
    return float(value)


def _integer(raw: dict, name: str, default: int) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"sampling_params.{name} must be an integer, got {value!r}")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequestError(f"sampling_params.stop must be a non-empty string or a list of them, got {value!r}")
    return tuple(items)


def _token_ids(value: Any, vocab_size: int) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in value):
        raise BadRequestError(
            f"sampling_params.stop_token_ids must be a list of token ids in [0, {vocab_size}), got {value!r}"
        )
    return tuple(value)


@dataclass(frozen=True)
class SampleStep:
    """The tokens drawn for each row and their log-probs under the distribution sampled from: the logits divided
    by the row's temperature (1 for greedy rows), before top-k/top-p."""

    tokens: list[int]
    logprobs: list[float]


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> SampleStep:
    """Draw one token per row of `logits` [B, V] with row i's `params[i]`, by inverse CDF at `uniforms[i]`.

    One uniform per row (drawn from that request's own generator) keeps each request reproducible whatever
    else shares its batch. Greedy rows take the argmax. The returned log-probs are log_softmax of the logits
    over the temperature, as SGLang returns them and as the trainer recomputes them (logits / rollout
    temperature), so rollout and training log-probs agree; top-k/top-p truncation does not change them.
    """
    logits = logits.float()
    device = logits.device
    if all(p.temperature == 0 for p in params):  # an evaluation's batch: no softmax, CDF or search to draw with
        tokens = logits.argmax(dim=-1)
        return SampleStep(tokens=tokens.tolist(), logprobs=_chosen_logprobs(logits, tokens).tolist())
    temps = torch.tensor([p.temperature for p in params], device=device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        probs, order = _truncated_sorted_probs(scaled, params)
    else:  # nothing to truncate: skip the sort, sample in vocabulary order
        probs, order = scaled.softmax(dim=-1), None
    cdf = probs.cumsum(-1)
    target = uniforms.to(device)[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).clamp(max=logits.shape[-1] - 1)
    tokens = (order.gather(1, picked) if order is not None else picked).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return SampleStep(tokens=tokens.tolist(), logprobs=_chosen_logprobs(scaled, tokens).tolist())


def _chosen_logprobs(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(scaled)[i, tokens[i]] (one fused pass: torch's logsumexp, which would write no [B, V] result,
    took longer on CPU)."""
    return scaled.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)


def _truncated_sorted_probs(scaled: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities sorted descending with top-k/top-p cut tokens zeroed (not renormalised), and the sort order."""
    device, vocab = scaled.device, scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    ranks = torch.arange(vocab, device=device)[None, :]
    # Keep a token while the mass strictly before it is under top_p: the most likely token is always kept.
    keep = (ranks < top_k[:, None]) & ((probs.cumsum(-1) - probs) < top_p[:, None])
    return probs * keep, order
