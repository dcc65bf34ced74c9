"""The engine's forward pass: a native one for the decoder families it knows, transformers' model for the rest.

`NativeForward` runs transformers' arithmetic straight on the model's own parameter tensors (so weight
updates, which copy into them in place, reach it; nothing is fused: fused copies would double the memory of
most weights for no gain measured on CPU): no per-call mask or rotary construction (one boolean mask shared by every layer, cos/sin from a precomputed
table), no module dispatch, lm_head on the last position only. On a CPU two calls go to faster kernels than
transformers' own: decode attention to slimeflow's C kernel (`decode_kernel`; SDPA, with each key/value head's
query heads as its query rows, where it cannot be built), and the linear layers to oneDNN (`_cpu_linear`).
`HFForward` calls the model itself: the fallback for anything else.

Both take the same arguments: ids [B, T], attention_mask [B, L] (1 = real token, the last T columns are the
new tokens), positions [B, T] and the cache to extend (transformers' `Cache` API; only `layers[i].update` is
used here), and return the logits of the last position only, [B, V].
"""

from __future__ import annotations

import logging
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


def select_forward(model: PreTrainedModel) -> ModelForward:
    """`NativeForward` when it covers `model`, else `HFForward` (logged, with the reason)."""
    reason = unsupported_reason(model)
    if reason is None:
        return NativeForward(model)
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


def _cpu_linear(model: PreTrainedModel) -> Linear:
    """oneDNN's matrix product for a CPU model in float32 or bfloat16, else F.linear.

    torch's F.linear goes to MKL, whose kernels on the AMD EPYC measured run at about half of oneDNN's speed
    (engine shapes, 64 x 256 x 512, one thread: 169 us against 89 us; 100 against 188 GFLOP/s); both read the
    weight tensors as they are, so in-place weight updates reach either.
    """
    usable = (model.device.type == "cpu" and model.dtype in (torch.float32, torch.bfloat16)
              and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    return _onednn_linear if usable else F.linear


class NativeForward:
    """Llama/Qwen2/Qwen3 decoding on the model's parameters, matching transformers' logits to float rounding."""

    def __init__(self, model: PreTrainedModel, decode_attention: DecodeAttention | None | bool = True) -> None:
        """`decode_attention`: the kernel to run decode steps' attention with on a CPU; True loads it (None when it
        cannot be built), False or None runs SDPA."""
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
        self.linear = _cpu_linear(model)
        if decode_attention is True:
            decode_attention = load_decode_attention() if model.device.type == "cpu" else None
        self.decode_attention = decode_attention or None
        self.refresh()

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
        cos, sin = self.rotary[positions].unsqueeze(2).chunk(2, dim=-1)  # [B, T, 1, D] each
        hidden = F.embedding(ids, self.model.model.embed_tokens.weight)
        linear = self.linear
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            hidden = self._attention(hidden, layer, kv, attention_mask, mask, cos, sin)
            x = _rms_norm(hidden, layer.post_norm, self.eps)
            hidden = hidden + linear(F.silu(linear(x, *layer.gate)) * linear(x, *layer.up), *layer.down)
        last = _rms_norm(hidden[:, -1], self.model.model.norm.weight, self.eps)
        return linear(last, self.model.lm_head.weight, getattr(self.model.lm_head, "bias", None))

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
