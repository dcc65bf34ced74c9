"""Per-family knowledge as data: which HF tensors make which Megatron tensor, and how they are fused.

A family is one table: the HF architectures it covers, the Megatron switches it sets, and its per-layer rules.
A rule names one Megatron tensor (its name inside `decoder.layers.<i>.`, as checkpoints spell it) and the HF
tensors (inside `model.layers.<i>.`) it is made of, joined by a fusion (stages/convert/mapping.py):

    copy     one HF tensor, unchanged
    qkv      q, k, v projections interleaved by KV group: per group its query heads, one K head, one V head
    gate_up  gate and up projections concatenated on dim 0 (Megatron's fc1 for SwiGLU)

Adding a family is adding a table here and a tiny model for it in the round-trip test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Fusion = Literal["copy", "qkv", "gate_up"]


@dataclass(frozen=True)
class Rule:
    """Megatron per-layer tensor `megatron` is `fusion` of the HF per-layer tensors `hf` (in that order)."""

    megatron: str
    hf: tuple[str, ...]
    fusion: Fusion = "copy"


@dataclass(frozen=True)
class Family:
    """One model family: HF architecture names, the Megatron switches it needs, and its per-layer rules."""

    name: str
    architectures: tuple[str, ...]
    add_qkv_bias: bool
    qk_layernorm: bool
    layer_rules: tuple[Rule, ...]


GLOBAL_RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",)),
)
"""Tensors outside the layers, the same in every family; `output_layer` is absent when embeddings are tied."""

VOCAB_PADDED = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})
"""Megatron tensors whose dim 0 is the (padded) vocabulary."""

_DENSE_RULES: tuple[Rule, ...] = (
    Rule("self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",)),
    Rule("self_attention.linear_qkv.weight",
         ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    Rule("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",)),
    Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",)),
)
_QKV_BIAS = Rule("self_attention.linear_qkv.bias",
                 ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv")
_QK_NORM = (
    Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
)

LLAMA = Family("llama", ("LlamaForCausalLM",), add_qkv_bias=False, qk_layernorm=False,
               layer_rules=_DENSE_RULES)
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), add_qkv_bias=True, qk_layernorm=False,
               layer_rules=(*_DENSE_RULES, _QKV_BIAS))
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), add_qkv_bias=False, qk_layernorm=True,
               layer_rules=(*_DENSE_RULES, *_QK_NORM))

FAMILIES: Mapping[str, Family] = {family.name: family for family in (LLAMA, QWEN2, QWEN3)}
BY_ARCHITECTURE: Mapping[str, Family] = {arch: f for f in FAMILIES.values() for arch in f.architectures}


def family_for(architectures: list[str] | None) -> Family | None:
    """The family of an HF config's `architectures` list, or None when no table covers it."""
    for arch in architectures or ():
        if arch in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[arch]
    return None


def supported_architectures() -> list[str]:
    return sorted(BY_ARCHITECTURE)
