"""The engine's forward pass: a native one for the decoder families it knows, transformers' model for the rest.

`NativeForward` runs transformers' arithmetic straight on the model's own parameter tensors (so weight
updates, which copy into them in place, reach it; nothing is fused: fused copies would double the memory of
most weights for no gain measured on CPU): no per-call mask or rotary construction (one boolean mask shared by every layer, cos/sin from a precomputed
table), no module dispatch, lm_head on the last position only. On a CPU two calls go to faster kernels than
transformers' own: decode attention to slimeflow's C kernel (`decode_kernel`; SDPA, with each key/value head's
query heads as its query rows, where it cannot be built), and each linear layer to MKL or oneDNN, whichever a short
timing at load found faster for its shape on this machine (`calibrate_linear`).
`HFForward` calls the model itself: the fallback for anything else.

Both take the same arguments: ids [B, T], attention_mask [B, L] (1 = real token, the last T columns are the
new tokens), positions [B, T] and the cache to extend (transformers' `Cache` API; only `layers[i].update` is
used here), and return the logits of the last position only, [B, V].
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import Cache, PreTrainedModel

from slimeflow.engine.decode_kernel import DecodeAttention, load_decode_attention
from slimeflow.families import BY_MODEL_TYPE, FAMILIES

log = logging.getLogger(__name__)


STATIC_ROPE_TYPES = ("default", "linear", "llama3")
"""Rope types whose inverse frequencies do not depend on the sequence length, so one table serves every step."""


class ModelForward(Protocol):
    model: PreTrainedModel

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                 cache: Cache) -> torch.Tensor: ...

    def refresh(self) -> None:
        """Re-read the model's parameters after they were changed in place."""


class HFForward:
    """The loaded transformers model, called as `generate` would: any architecture, at its per-step cost."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                 cache: Cache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def refresh(self) -> None:
        pass


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why `NativeForward` cannot run `model` exactly as transformers does, or None when it can."""
    config = model.config
    family = BY_MODEL_TYPE.get(config.model_type)
    if family is None or not family.native_forward:
        native = sorted(f.model_type for f in FAMILIES.values() if f.native_forward)
        return f"model_type {config.model_type!r} is not one of {native} (the families with a native forward)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False) or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return "it uses sliding-window attention"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} is not one of {STATIC_ROPE_TYPES} (its frequencies change with length)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"pretraining_tp is {config.pretraining_tp}, not 1"
    return None


def select_forward(model: PreTrainedModel, num_threads: int | None = None) -> ModelForward:
    """`NativeForward` when it covers `model`, else `HFForward` (logged, with the reason). `num_threads`: the torch
    threads the forward passes will run with (its linear kernels are timed with them); None: this thread's."""
    reason = unsupported_reason(model)
    if reason is None:
        return NativeForward(model, num_threads=num_threads)
    log.warning("the engine runs the transformers forward pass (slower per step): the native one does not "
                "cover this model because %s", reason)
    return HFForward(model)


_Linear = tuple[torch.Tensor, torch.Tensor | None]
"""A linear layer's weight and bias (None: no bias)."""


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parameters: the model's own tensors, which weight updates change in place."""

    input_norm: torch.Tensor
    q: _Linear
    k: _Linear
    v: _Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: _Linear
    post_norm: torch.Tensor
    gate: _Linear
    up: _Linear
    down: _Linear


def _linear(module: torch.nn.Linear) -> _Linear:
    return module.weight, module.bias


def _layer(block: torch.nn.Module) -> _Layer:
    attn, mlp = block.self_attn, block.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return _Layer(
        input_norm=block.input_layernorm.weight,
        q=_linear(attn.q_proj), k=_linear(attn.k_proj), v=_linear(attn.v_proj),
        q_norm=q_norm.weight if q_norm is not None else None,
        k_norm=k_norm.weight if k_norm is not None else None,
        o=_linear(attn.o_proj),
        post_norm=block.post_attention_layernorm.weight,
        gate=_linear(mlp.gate_proj), up=_linear(mlp.up_proj), down=_linear(mlp.down_proj),
    )


ROTARY_ROWS = 4096
"""Positions the cos/sin table starts with; it doubles when a batch goes past them. A table for all of a model's
max_position_embeddings would hold 134 MB (fp32) for 131k positions that short rollouts never reach."""


Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


CPU_KERNELS: dict[str, Linear] = {"mkl": F.linear, "onednn": _onednn_linear}
"""The CPU matrix products a linear layer may run on: torch's F.linear (MKL) and oneDNN. Which is faster depends
on the machine and the shape: on an AMD EPYC oneDNN took half of MKL's time (64 x 256 x 512, one thread: 89 against
169 us); on an Intel Xeon (AVX-512), in SmolLM2-135M's decode steps of 64 rows, MKL took 5-50% less time than
oneDNN on each layer weight and the same on the output layer (a step: 303 against 332 ms), while at 8 rows oneDNN
took half of MKL's time on that output layer. So they are timed, per machine and shape (`calibrate_linear`)."""

CALIBRATION_ROWS = (1, 8, 64, 512)
"""Row counts (tokens in one call) each weight shape is timed at: decode batches of one to tens of sequences, and a
prefill's hundreds of tokens. A call runs the kernel chosen at the nearest of them (log scale)."""

CALIBRATION_FLOP = 8e9
"""A row count whose one call would cost more floating-point operations than this is not timed (the output layer of
a 49k vocabulary at 512 rows: 29 GFLOP, ~0.4 s a call); it takes the choice of the largest count timed. The output
layer only ever sees a row per sequence."""

_BUCKET_EDGES = tuple((a * b) ** 0.5 for a, b in itertools.pairwise(CALIBRATION_ROWS))
_MEASURED: dict[tuple, str] = {}
"""Kernel names chosen so far in this process, by (kernels, dtype, out, in, bias, rows, threads): each shape is timed
once per process however many forwards are built (tests, the benchmark's in-process engine)."""


class CalibratedLinear:
    """A linear layer on whichever of `kernels` measured fastest for its weight's shape at the nearest row count."""

    def __init__(self, by_shape: dict[tuple[int, int], tuple[Linear, ...]], names: dict[tuple[int, int], tuple[str, ...]]
                 ) -> None:
        self.by_shape = by_shape  # one kernel per CALIBRATION_ROWS
        self.names = names

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kernels = self.by_shape[weight.shape[0], weight.shape[1]]
        return kernels[bisect.bisect_right(_BUCKET_EDGES, x.numel() // x.shape[-1])](x, weight, bias)


def calibrate_linear(weights: list[_Linear], kernels: dict[str, Linear] = CPU_KERNELS,
                     threads: int | None = None) -> CalibratedLinear:
    """Time every kernel on each distinct weight shape of `weights` (the model's own tensors, read only) at each of
    CALIBRATION_ROWS, and keep the fastest of each; results are cached for the process.

    Each shape runs every kernel once to warm up, then three rounds alternating between them, each call on another
    of the shape's tensors (another layer's), so that the weight comes from memory as in a forward pass: on the
    same tensor again, a 576 x 1536 weight stays in cache and oneDNN looked 8% faster where a decode step found
    MKL 5% faster. The least of each kernel's times counts (a neighbour's load only ever adds time). With one
    torch thread the time is the thread's CPU time, which a busy machine's preemptions do not inflate; with more,
    wall time.
    """
    threads = threads or torch.get_num_threads()
    shapes: dict[tuple[int, int], list[_Linear]] = {}
    for weight, bias in weights:
        shapes.setdefault((weight.shape[0], weight.shape[1]), []).append((weight, bias))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        names = {shape: _calibrate_shape(kernels, tensors, threads) for shape, tensors in shapes.items()}
    finally:
        torch.set_num_threads(before)
    log.info("linear kernels by weight shape at %s rows (measured): %s", CALIBRATION_ROWS,
             {f"{o}x{i}": "/".join(n) for (o, i), n in names.items()})
    return CalibratedLinear({shape: tuple(kernels[name] for name in chosen) for shape, chosen in names.items()},
                            names)


def _calibrate_shape(kernels: dict[str, Linear], tensors: list[_Linear], threads: int) -> tuple[str, ...]:
    """The fastest kernel's name at each of CALIBRATION_ROWS for weights like `tensors` (all of one shape)."""
    weight, bias = tensors[0]
    chosen: list[str] = []
    for rows in CALIBRATION_ROWS:
        if chosen and 2 * rows * weight.numel() > CALIBRATION_FLOP:
            chosen.append(chosen[-1])
            continue
        key = (tuple(kernels), weight.dtype, *weight.shape, bias is not None, rows, threads)
        if key not in _MEASURED:
            _MEASURED[key] = _fastest(kernels, tensors, rows, threads)
        chosen.append(_MEASURED[key])
    return tuple(chosen)


def _fastest(kernels: dict[str, Linear], tensors: list[_Linear], rows: int, threads: int) -> str:
    clock = time.thread_time if threads == 1 else time.perf_counter
    weights = itertools.cycle(tensors)
    x = torch.randn(rows, tensors[0][0].shape[1], generator=torch.Generator().manual_seed(0)).to(tensors[0][0])
    best = dict.fromkeys(kernels, float("inf"))
    with torch.inference_mode():
        for kernel in kernels.values():
            kernel(x, *tensors[0])
        for _ in range(3):
            for name, kernel in kernels.items():
                weight, bias = next(weights)
                start = clock()
                kernel(x, weight, bias)
                best[name] = min(best[name], clock() - start)
    return min(best, key=best.__getitem__)  # ties: the first (F.linear)


def _cpu_linear(model: PreTrainedModel, layers: list[_Layer], threads: int | None) -> Linear:
    """For a CPU model in float32 or bfloat16, each weight shape's fastest of CPU_KERNELS (`calibrate_linear`), else
    F.linear. Both read the weight tensors as they are, so in-place weight updates reach either."""
    usable = (model.device.type == "cpu" and model.dtype in (torch.float32, torch.bfloat16)
              and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    if not usable:
        return F.linear
    weights = [linear for layer in layers for linear in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up,
                                                         layer.down)]
    weights.append((model.lm_head.weight, getattr(model.lm_head, "bias", None)))
    return calibrate_linear(weights, threads=threads)


class NativeForward:
    """Llama/Qwen2/Qwen3 decoding on the model's parameters, matching transformers' logits to float rounding."""

    def __init__(self, model: PreTrainedModel, decode_attention: DecodeAttention | None | bool = True,
                 num_threads: int | None = None) -> None:
        """`decode_attention`: the kernel to run decode steps' attention with on a CPU; True loads it (None when it
        cannot be built), False or None runs SDPA. `num_threads`: the torch threads the calls will run with, which
        the linear kernels are timed with on a CPU (None: this thread's)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"NativeForward cannot run this model: {reason}; use HFForward")
        config = model.config
        self.model = model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.qk_norm = BY_MODEL_TYPE[config.model_type].qk_norm
        self.max_positions = config.max_position_embeddings
        self.rotary = _rotary_table(model, min(self.max_positions, ROTARY_ROWS), self.head_dim)
        if decode_attention is True:
            decode_attention = load_decode_attention() if model.device.type == "cpu" else None
        self.decode_attention = decode_attention or None
        self.refresh()
        self.linear = _cpu_linear(model, self.layers, num_threads)

    def refresh(self) -> None:
        """Re-read the parameters from the model (updates copy in place, so this matters only if they were
        replaced, e.g. by `load_state_dict(assign=True)`)."""
        self.layers = [_layer(block) for block in self.model.model.layers]

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                 cache: Cache) -> torch.Tensor:
        batch, new = ids.shape
        mask = _attention_mask(attention_mask, new)  # the kernel reads `attention_mask` itself
        if attention_mask.shape[-1] > self.rotary.shape[0]:  # positions are below the mask's width: grow first
            rows = min(self.max_positions, max(attention_mask.shape[-1], 2 * self.rotary.shape[0]))
            self.rotary = _rotary_table(self.model, rows, self.head_dim)
        if new > 1:
            return self._prefill(ids, positions, cache, attention_mask, mask)
        cos, sin = self.rotary[positions].unsqueeze(2).chunk(2, dim=-1)  # [B, T, 1, D] each
        hidden = F.embedding(ids, self.model.model.embed_tokens.weight)
        linear = self.linear
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            hidden = self._attention(hidden, layer, kv, attention_mask, mask, cos, sin)
            x = _rms_norm(hidden, layer.post_norm, self.eps)
            hidden = hidden + linear(F.silu(linear(x, *layer.gate)) * linear(x, *layer.up), *layer.down)
        last = _rms_norm(hidden[:, -1], self.model.model.norm.weight, self.eps)
        return linear(last, self.model.lm_head.weight, getattr(self.model.lm_head, "bias", None))

    def _prefill(self, ids: torch.Tensor, positions: torch.Tensor, cache: Cache, attention_mask: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """Several new tokens a row. The tokens go through the layers packed, [tokens, hidden], with the left padding
        left out (prompts prefilled together pad to the longest: 13% of the columns when 64 chat prompts' tails of
        11-13 tokens follow a shared system prompt), and unpacked only where attention needs rows; the last layer
        runs its queries, output projection and MLP on each row's last token only, the one whose logits are used."""
        packing = _Packing.of(attention_mask[:, -ids.shape[1]:].bool())
        cos, sin = self.rotary[packing.pack(positions.reshape(-1))].unsqueeze(1).chunk(2, dim=-1)  # [N, 1, D] each
        hidden = F.embedding(packing.pack(ids.reshape(-1)), self.model.model.embed_tokens.weight)
        linear, last = self.linear, len(self.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, cache.layers, strict=True)):
            hidden = self._prefill_attention(hidden, layer, kv, mask, cos, sin, packing, last_only=i == last)
            x = _rms_norm(hidden, layer.post_norm, self.eps)
            hidden = hidden + linear(F.silu(linear(x, *layer.gate)) * linear(x, *layer.up), *layer.down)
        hidden = _rms_norm(hidden, self.model.model.norm.weight, self.eps)  # [B, hidden]: the last tokens
        return linear(hidden, self.model.lm_head.weight, getattr(self.model.lm_head, "bias", None))

    def _prefill_attention(self, hidden: torch.Tensor, layer: _Layer, kv, mask: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, packing: _Packing, last_only: bool) -> torch.Tensor:
        """A decoder layer's attention on packed tokens [N, hidden]; with `last_only`, keys and values for every
        token (the cache needs them) but queries and output for each row's last token only ([B, hidden])."""
        heads, kv_heads, dim, linear = self.heads, self.kv_heads, self.head_dim, self.linear
        x = _rms_norm(hidden, layer.input_norm, self.eps)
        k = linear(x, *layer.k).view(-1, kv_heads, dim)
        v = linear(x, *layer.v).view(-1, kv_heads, dim)
        if self.qk_norm:
            k = _rms_norm(k, layer.k_norm, self.eps)
        keys, values = kv.update(packing.unpack(_rope(k, cos, sin)).transpose(1, 2),
                                 packing.unpack(v).transpose(1, 2))
        if last_only:
            x, hidden, cos, sin = (t.index_select(0, packing.last) for t in (x, hidden, cos, sin))
            mask = mask[:, :, -1:]
        q = linear(x, *layer.q).view(-1, heads, dim)
        if self.qk_norm:
            q = _rms_norm(q, layer.q_norm, self.eps)
        q = _rope(q, cos, sin)
        q = q.view(packing.batch, 1, heads, dim) if last_only else packing.unpack(q)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=dim ** -0.5,
                                             enable_gqa=heads != kv_heads)
        out = out.transpose(1, 2).reshape(-1, heads * dim)
        return hidden + linear(out if last_only else packing.pack(out), *layer.o)

    def _attention(self, hidden: torch.Tensor, layer: _Layer, kv, attention_mask: torch.Tensor,
                   mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, new, _ = hidden.shape
        heads, kv_heads, dim, linear = self.heads, self.kv_heads, self.head_dim, self.linear
        x = _rms_norm(hidden, layer.input_norm, self.eps)
        q = linear(x, *layer.q).view(batch, new, heads, dim)
        k = linear(x, *layer.k).view(batch, new, kv_heads, dim)
        v = linear(x, *layer.v).view(batch, new, kv_heads, dim)
        if self.qk_norm:
            q, k = _rms_norm(q, layer.q_norm, self.eps), _rms_norm(k, layer.k_norm, self.eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys, values = kv.update(k.transpose(1, 2), v.transpose(1, 2))
        if new == 1:
            # One query per row: the query heads that share a key/value head go in as that head's query
            # positions ([B, kv_heads, group, D]), which CPU attention runs in half the blocks of enable_gqa.
            grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
            kernel = self.decode_attention
            if kernel is not None and kernel.supports(grouped, keys, values, attention_mask):
                out = kernel.attend(grouped, keys, values, attention_mask, dim ** -0.5)
            else:
                out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=dim ** -0.5)
            return hidden + linear(out.reshape(batch, 1, heads * dim), *layer.o)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             scale=dim ** -0.5, enable_gqa=heads != kv_heads)
        out = out.transpose(1, 2).reshape(batch, new, heads * dim)
        return hidden + linear(out, *layer.o)


@dataclass(frozen=True)
class _Packing:
    """Where a prefill's real tokens sit among its [B, T] columns (left padding: each row's tokens end at T - 1)."""

    batch: int
    new: int
    index: torch.Tensor | None
    """The real tokens' flat column indexes [N] into B * T, in order; None: every column is packed (no padding,
    or a row whose last column is padding, which keeps the padded layout)."""
    last: torch.Tensor
    """[B]: each row's last token, as an index into the packed tokens."""

    @classmethod
    def of(cls, real: torch.Tensor) -> _Packing:
        batch, new = real.shape
        ends = torch.arange(1, batch + 1, device=real.device) * new - 1  # each row's last column, flat
        if real.all() or not real[:, -1].all():
            return cls(batch, new, None, ends)
        flat = real.reshape(-1)
        return cls(batch, new, flat.nonzero().squeeze(1), flat.long().cumsum(0)[ends] - 1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B * T, ...] -> [N, ...]: the real tokens' rows."""
        return x if self.index is None else x.index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...], zeros in the padding (attention reads it with weight 0: it must be finite)."""
        if self.index is not None:
            x = x.new_zeros((self.batch * self.new, *x.shape[1:])).index_copy_(0, self.index, x)
        return x.view(self.batch, self.new, *x.shape[1:])


def _rotary_table(model: PreTrainedModel, max_positions: int, head_dim: int) -> torch.Tensor:
    """[max_positions, 2 * head_dim]: cos then sin with its first half negated, as transformers computes them.

    The negation lets `_rope` rotate halves with `roll` instead of negating and concatenating every step.
    """
    rotary = model.model.rotary_emb
    positions = torch.arange(max_positions, device=rotary.inv_freq.device, dtype=torch.float32)
    freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling
    sin[:, : head_dim // 2] *= -1
    return torch.cat([cos, sin], dim=-1).to(model.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = roll(x) * sign folded into `sin`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, cast back, then scaled (in one op when all is float32)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _attention_mask(attention_mask: torch.Tensor, new: int) -> torch.Tensor:
    """Boolean [B, 1, T, L]: real keys at or before each query's column, and always the query itself.

    The diagonal keeps padding queries (left padding, whose outputs nobody reads) from attending to nothing,
    which would make softmax NaN.
    """
    real = attention_mask.bool()[:, None, None, :]
    if new == 1:  # the new token is the last column: nothing to hide from it but padding
        return real
    length = attention_mask.shape[1]
    columns = torch.arange(length, device=attention_mask.device)
    rows = columns[length - new:, None]
    return (real & (columns <= rows)) | (columns == rows)
