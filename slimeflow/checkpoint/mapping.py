"""HF <-> Megatron tensors: the model shape, the name map with its fusions, and vocabulary padding.

Megatron-side names are the names torch_dist checkpoints use, one layer at a time:
`decoder.layers.<i>.self_attention.linear_qkv.weight` is layer i's shard of the stacked global tensor
`decoder.layers.self_attention.linear_qkv.weight` (torch_dist.py does the stacking). Nothing here
touches a file or a process group, so a training backend maps its HF-named state dict through the same code.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from slimeflow.checkpoint.torch_dist import ExpertRows, RowBlocks
from slimeflow.families import (
    FAMILIES,
    FLAGS,
    GLOBAL_RULES,
    VOCAB_PADDED,
    YARN_DEFAULTS,
    FamilySpec,
    Flag,
    Rule,
    head_dim,
    mla_fields,
    moe_fields,
    query_groups,
    rope_setting,
)

HF_LAYER = "model.layers.{}."
MEGATRON_LAYER = "decoder.layers.{}."


@dataclass(frozen=True)
class ModelShape:
    """What the conversion needs to know about a model, in Megatron's terms."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    padded_vocab_size: int
    norm_epsilon: float
    rotary_base: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates (HF: partial_rotary_factor)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (HF: norm_topk_prob false); else over the top-k's logits."""
    dense_layers: tuple[int, ...] = ()
    """Layers of an MoE model whose MLP is dense (HF: mlp_only_layers, decoder_sparse_step, first_k_dense_replace;
    Megatron: moe_layer_freq as a list, 0 for dense)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (HF: n_group, topk_group): top-k among the best `group_topk` groups of experts."""
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    """HF: routed_scaling_factor (None: 1)."""
    moe_shared_expert_intermediate_size: int | None = None
    """HF: moe_intermediate_size x n_shared_experts (None: no shared experts)."""
    q_lora_rank: int | None = None
    """Multi-latent attention (Megatron's names; all 0/None without it): the query's low rank (None: a full
    q_proj), the key/value latent, each head's parts without and with RoPE (HF: qk_nope_head_dim,
    qk_rope_head_dim), and the value head."""
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    yarn: Mapping[str, float] | None = None
    """YaRN RoPE scaling in Megatron's names (rotary_scaling_factor, original_max_position_embeddings, beta_fast,
    beta_slow, mscale, mscale_all_dim); None: plain RoPE."""
    add_qkv_bias: bool = False
    """Megatron's flags of which tensors the layers have (families.FLAGS), from the HF config's switches."""
    qk_layernorm: bool = False
    add_bias_linear: bool = False
    unsupported: tuple[str, ...] = ()
    """What the HF config asks for that no Megatron model computes the same way (reported by `problems`)."""

    @property
    def info(self) -> FamilySpec:
        return FAMILIES[self.family]

    @property
    def q_head_dim(self) -> int:
        """Dimensions of one query (and key) head: with MLA its parts without and with RoPE."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.info.multi_latent_attention else self.kv_channels

    @property
    def homogeneous(self) -> bool:
        """Every layer has the same tensors, so a checkpoint stacks them (`decoder.layers.<name>` [layers, ...]);
        else each layer's are keyed `decoder.layers.<i>.<name>`, as megatron-core does with moe_layer_freq a list."""
        return not (self.num_experts and self.dense_layers)

    @property
    def flags(self) -> dict[Flag, bool]:
        return {flag: getattr(self, flag) for flag in FLAGS}

    def applies(self, rule: Rule, layer: int) -> bool:
        """Whether `rule` names a tensor of `layer` in this shape (its `only` and its `when`)."""
        return {None: True, "dense": layer in self.dense_layers, "moe": layer not in self.dense_layers,
                "q_lora": self.q_lora_rank is not None, "no_q_lora": self.q_lora_rank is None}[rule.only] and (
            rule.when is None or getattr(self, rule.when))

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], family: FamilySpec, make_vocab_size_divisible_by: int = 128,
                       tensor_model_parallel_size: int = 1) -> ModelShape:
        """The shape of an HF `config.json` (a dict); KeyError names a missing field."""
        moe = moe_fields(config, family) if family.has_experts else {}
        mla = mla_fields(config) if family.multi_latent_attention else {}
        unsupported = moe.pop("unsupported", ()) + mla.pop("unsupported", ()) + tuple(
            f"{name} is {value}: {reason}" for name, (value, reason) in family.refused_config.items()
            if config.get(name) == value) + tuple(family.switch_problems(config))
        return cls(
            family=family.name,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_query_groups=query_groups(config),
            kv_channels=config["v_head_dim"] if family.multi_latent_attention else head_dim(config),
            vocab_size=config["vocab_size"],
            padded_vocab_size=padded_vocab_size(config["vocab_size"], make_vocab_size_divisible_by,
                                                tensor_model_parallel_size),
            norm_epsilon=config.get("rms_norm_eps", 1e-6),
            rotary_base=rope_setting(config, "rope_theta", 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rotary_percent=rope_setting(config, "partial_rotary_factor", 1.0),
            **moe, **mla, **family.flags(config), unsupported=unsupported,
        )

    @classmethod
    def from_megatron_args(cls, args: argparse.Namespace, family: FamilySpec, vocab_size: int,
                           source: str = "common.pt") -> ModelShape:
        """The shape in a checkpoint's Megatron `args` (ours, slime's or Megatron-LM's); `vocab_size` is the true
        (unpadded) vocabulary. ValueError names `source` and every attribute that is missing."""
        read = _ArgsReader(args)
        heads = read("num_attention_heads")
        hidden = read("hidden_size")
        shape = cls(
            family=family.name, num_layers=read("num_layers"), hidden_size=hidden,
            ffn_hidden_size=read("ffn_hidden_size"), num_attention_heads=heads,
            # Megatron-LM leaves num_query_groups None without --group-query-attention and kv_channels None
            # until it derives hidden_size / heads.
            num_query_groups=read("num_query_groups", default=None) or heads,
            kv_channels=read("kv_channels", default=None) or (hidden // heads if hidden and heads else None),
            vocab_size=vocab_size, padded_vocab_size=read("padded_vocab_size"),
            norm_epsilon=read("norm_epsilon", "layernorm_epsilon"), rotary_base=read("rotary_base"),
            max_position_embeddings=read("max_position_embeddings"),
            tie_word_embeddings=not read("untie_embeddings_and_output_weights", default=False),
            rotary_percent=read("rotary_percent", default=1.0),
            num_experts=read("num_experts", default=None) or 0,
            moe_ffn_hidden_size=read("moe_ffn_hidden_size", default=None) or 0,
            moe_router_topk=read("moe_router_topk", default=None) or 0,
            moe_router_pre_softmax=bool(read("moe_router_pre_softmax", default=False)),
            dense_layers=_dense_layers(read("moe_layer_freq", default=1), read("num_layers")),
            moe_router_num_groups=read("moe_router_num_groups", default=None),
            moe_router_group_topk=read("moe_router_group_topk", default=None),
            moe_router_topk_scaling_factor=read("moe_router_topk_scaling_factor", default=None),
            moe_shared_expert_intermediate_size=read("moe_shared_expert_intermediate_size", default=None),
            **(_mla_args(read) if family.multi_latent_attention else {}), **_flag_args(read),
        )
        if read.missing:
            raise ValueError(f"{source}: the checkpoint's Megatron args lack {', '.join(read.missing)}; it was not "
                             "written by a Megatron-LM, slime or slimeflow converter that this version reads")
        unbuilt = shape.unmapped_flags()
        if unbuilt:
            raise ValueError(f"{source}: the checkpoint's Megatron args say {', '.join(unbuilt)}, which no {family.name} "
                             "HF model has; it is not a checkpoint of this family (or was trained with layers that "
                             "family lacks)")
        return shape

    def unmapped_flags(self) -> list[str]:
        """The flags this shape has that its family's name map cannot express (`<flag> <value>` each): one on that
        no rule needs (its tensors would be dropped), or one off that the family always has."""
        info = self.info
        needed = {rule.when for rule in info.layer_rules if rule.when} | set(info.fixed_flags)
        return [f"{flag} {on}" for flag, on in self.flags.items()
                if (on and flag not in needed) or (not on and flag in info.fixed_flags)]

    def problems(self) -> list[str]:
        """What makes this shape unconvertible (empty when it is fine)."""
        found = []
        if self.num_attention_heads % self.num_query_groups:
            found.append(f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                         f"num_key_value_heads ({self.num_query_groups}): query heads cannot be grouped by KV head")
        if self.padded_vocab_size < self.vocab_size:
            found.append(f"padded vocabulary {self.padded_vocab_size} is smaller than vocab_size {self.vocab_size}")
        if self.info.has_experts:
            found += self._moe_problems()
        return found + list(self.unsupported)

    def _moe_problems(self) -> list[str]:
        found = []
        if not 0 < self.moe_router_topk <= self.num_experts:
            found.append(f"num_experts_per_tok ({self.moe_router_topk}) must be between 1 and num_experts "
                         f"({self.num_experts})")
        groups, picked = self.moe_router_num_groups, self.moe_router_group_topk
        if groups and picked:
            if self.num_experts % groups or not 0 < picked <= groups:
                found.append(f"n_group ({groups}) must divide the {self.num_experts} experts and topk_group "
                             f"({picked}) must be between 1 and n_group")
            elif self.moe_router_topk // picked != 2:
                # HF scores a group by its best two experts; megatron-core by its best topk / group_topk.
                found.append(f"num_experts_per_tok ({self.moe_router_topk}) // topk_group ({picked}) is not 2: HF "
                             "scores each group by its two best experts, megatron-core by its best "
                             "num_experts_per_tok // topk_group, so the two would route differently")
        return found


def _mla_args(read: _ArgsReader) -> dict[str, Any]:
    """The MLA part of a shape from Megatron args (Megatron-LM's flag names)."""
    yarn = None
    if read("rope_type", default="yarn") == "yarn" and read("rotary_scaling_factor", default=1.0) != 1.0:
        yarn = {"rotary_scaling_factor": float(read("rotary_scaling_factor")),
                "original_max_position_embeddings": int(read("original_max_position_embeddings", default=4096)),
                **{name: float(read(name, default=default)) for name, default in YARN_DEFAULTS.items()}}
    return {"q_lora_rank": read("q_lora_rank", default=None), "kv_lora_rank": read("kv_lora_rank"),
            "qk_head_dim": read("qk_head_dim"), "qk_pos_emb_head_dim": read("qk_pos_emb_head_dim"),
            "v_head_dim": read("v_head_dim"), "yarn": yarn}


def _flag_args(read: _ArgsReader) -> dict[str, bool]:
    """The FLAGS from Megatron args (absent: off). megatron-core gives linear_qkv a bias with add_bias_linear too."""
    linear = bool(read("add_bias_linear", default=False))
    return {"add_qkv_bias": bool(read("add_qkv_bias", default=False)) or linear,
            "qk_layernorm": bool(read("qk_layernorm", default=False)), "add_bias_linear": linear}


def _dense_layers(moe_layer_freq: Any, num_layers: int | None) -> tuple[int, ...]:
    """Dense layers from Megatron's moe_layer_freq: a list (0 dense, 1 MoE) or every N-th layer an MoE layer."""
    if isinstance(moe_layer_freq, (list, tuple)):
        return tuple(i for i, moe in enumerate(moe_layer_freq) if not moe)
    if isinstance(moe_layer_freq, int) and moe_layer_freq > 1 and num_layers:
        return tuple(i for i in range(num_layers) if i % moe_layer_freq)
    return ()


_REQUIRED = object()


class _ArgsReader:
    """Attribute reads from a Megatron args Namespace that collect what is missing instead of failing at the
    first; several names are spellings of one setting (Megatron-LM renamed norm_epsilon to layernorm_epsilon)."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.missing = args, []

    def __call__(self, *names: str, default: Any = _REQUIRED) -> Any:
        for name in names:
            if getattr(self.args, name, None) is not None:
                return getattr(self.args, name)
        if default is _REQUIRED:
            self.missing.append(" or ".join(names))
            return None
        return default


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int = 1) -> int:
    """Megatron's padding: the next multiple of divisible_by x TP at or above `vocab_size`."""
    multiple = divisible_by * tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def megatron_args(shape: ModelShape, dtype: torch.dtype, make_vocab_size_divisible_by: int,
                  tensor_model_parallel_size: int) -> argparse.Namespace:
    """Megatron-LM's `args` for common.pt: the model shape under Megatron's flag names, so that readers that
    take the shape from `args` (Megatron-LM, slime's converter) build the right model."""
    info = shape.info
    return argparse.Namespace(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        group_query_attention=shape.num_query_groups != shape.num_attention_heads, kv_channels=shape.kv_channels,
        vocab_size=shape.vocab_size, padded_vocab_size=shape.padded_vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tensor_model_parallel_size=tensor_model_parallel_size, pipeline_model_parallel_size=1,
        # norm_epsilon under both spellings: Megatron-LM's newer (layernorm_epsilon) and older, which slime reads.
        normalization="RMSNorm", norm_epsilon=shape.norm_epsilon, layernorm_epsilon=shape.norm_epsilon,
        swiglu=True, **shape.flags, position_embedding_type="rope",
        rotary_base=shape.rotary_base, rotary_percent=shape.rotary_percent,
        rotary_interleaved=info.rotary_interleaved, max_position_embeddings=shape.max_position_embeddings,
        # GLM4's sandwich norms, under the flag names of slime's patched Megatron-LM.
        post_self_attn_layernorm=info.sandwich_norms, post_mlp_layernorm=info.sandwich_norms,
        untie_embeddings_and_output_weights=not shape.tie_word_embeddings,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype, ckpt_format="torch_dist",
        # Read by slime's converters for every model (None/False: no multi-latent attention, no experts).
        multi_latent_attention=info.multi_latent_attention, q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank or None, num_experts=shape.num_experts or None,
        **_moe_args(shape), **_mla_megatron_args(shape), model_family=shape.family,
    )


def _moe_args(shape: ModelShape) -> dict[str, Any]:
    if not shape.num_experts:
        return {}
    info = shape.info
    layer_freq = [int(i not in shape.dense_layers) for i in range(shape.num_layers)]
    return {"moe_ffn_hidden_size": shape.moe_ffn_hidden_size, "moe_router_topk": shape.moe_router_topk,
            "moe_router_pre_softmax": shape.moe_router_pre_softmax,
            "moe_router_score_function": info.router_score_function,
            "moe_router_enable_expert_bias": info.router_expert_bias,
            "moe_router_num_groups": shape.moe_router_num_groups, "moe_router_group_topk": shape.moe_router_group_topk,
            "moe_router_topk_scaling_factor": shape.moe_router_topk_scaling_factor,
            "moe_shared_expert_intermediate_size": shape.moe_shared_expert_intermediate_size,
            "moe_layer_freq": 1 if shape.homogeneous else layer_freq}


def _mla_megatron_args(shape: ModelShape) -> dict[str, Any]:
    """MLA's shape and RoPE under Megatron-LM's flag names (--qk-head-dim, --rotary-scaling-factor, ...)."""
    if not shape.info.multi_latent_attention:
        return {}
    yarn = shape.yarn or {"rotary_scaling_factor": 1.0, **YARN_DEFAULTS}
    return {"qk_head_dim": shape.qk_head_dim, "qk_pos_emb_head_dim": shape.qk_pos_emb_head_dim,
            "v_head_dim": shape.v_head_dim, "rope_type": "yarn" if shape.yarn else "rope", **yarn}


# ---------------------------------------------------------------------------------------------------------------
# Names and shapes
# ---------------------------------------------------------------------------------------------------------------

_HF_SHAPES: dict[str, Callable[[ModelShape], tuple[int, ...]]] = {
    "model.embed_tokens.weight": lambda s: (s.vocab_size, s.hidden_size),
    "model.norm.weight": lambda s: (s.hidden_size,),
    "lm_head.weight": lambda s: (s.vocab_size, s.hidden_size),
    "input_layernorm.weight": lambda s: (s.hidden_size,),
    "post_attention_layernorm.weight": lambda s: (s.hidden_size,),
    "self_attn.q_proj.weight": lambda s: (s.num_attention_heads * s.q_head_dim, s.hidden_size),
    "self_attn.k_proj.weight": lambda s: (s.num_query_groups * s.kv_channels, s.hidden_size),
    "self_attn.v_proj.weight": lambda s: (s.num_query_groups * s.kv_channels, s.hidden_size),
    "self_attn.q_proj.bias": lambda s: (s.num_attention_heads * s.kv_channels,),
    "self_attn.k_proj.bias": lambda s: (s.num_query_groups * s.kv_channels,),
    "self_attn.v_proj.bias": lambda s: (s.num_query_groups * s.kv_channels,),
    "self_attn.o_proj.weight": lambda s: (s.hidden_size, s.num_attention_heads * s.kv_channels),
    "self_attn.o_proj.bias": lambda s: (s.hidden_size,),
    "self_attn.q_norm.weight": lambda s: (s.kv_channels,),
    "self_attn.k_norm.weight": lambda s: (s.kv_channels,),
    "mlp.gate_proj.weight": lambda s: (s.ffn_hidden_size, s.hidden_size),
    "mlp.up_proj.weight": lambda s: (s.ffn_hidden_size, s.hidden_size),
    "mlp.down_proj.weight": lambda s: (s.hidden_size, s.ffn_hidden_size),
    "mlp.gate_proj.bias": lambda s: (s.ffn_hidden_size,),
    "mlp.up_proj.bias": lambda s: (s.ffn_hidden_size,),
    "mlp.down_proj.bias": lambda s: (s.hidden_size,),
    "mlp.gate_up_proj.weight": lambda s: (2 * s.ffn_hidden_size, s.hidden_size),
    "post_self_attn_layernorm.weight": lambda s: (s.hidden_size,),
    "post_mlp_layernorm.weight": lambda s: (s.hidden_size,),
    "mlp.gate.weight": lambda s: (s.num_experts, s.hidden_size),
    "mlp.experts.{e}.gate_proj.weight": lambda s: (s.moe_ffn_hidden_size, s.hidden_size),
    "mlp.experts.{e}.up_proj.weight": lambda s: (s.moe_ffn_hidden_size, s.hidden_size),
    "mlp.experts.{e}.down_proj.weight": lambda s: (s.hidden_size, s.moe_ffn_hidden_size),
    "mlp.gate.e_score_correction_bias": lambda s: (s.num_experts,),
    "mlp.shared_experts.gate_proj.weight": lambda s: (s.moe_shared_expert_intermediate_size, s.hidden_size),
    "mlp.shared_experts.up_proj.weight": lambda s: (s.moe_shared_expert_intermediate_size, s.hidden_size),
    "mlp.shared_experts.down_proj.weight": lambda s: (s.hidden_size, s.moe_shared_expert_intermediate_size),
    "self_attn.q_a_proj.weight": lambda s: (s.q_lora_rank, s.hidden_size),
    "self_attn.q_a_layernorm.weight": lambda s: (s.q_lora_rank,),
    "self_attn.q_b_proj.weight": lambda s: (s.num_attention_heads * s.q_head_dim, s.q_lora_rank),
    "self_attn.kv_a_proj_with_mqa.weight": lambda s: (s.kv_lora_rank + s.qk_pos_emb_head_dim, s.hidden_size),
    "self_attn.kv_a_layernorm.weight": lambda s: (s.kv_lora_rank,),
    "self_attn.kv_b_proj.weight": lambda s: (s.num_attention_heads * (s.qk_head_dim + s.v_head_dim), s.kv_lora_rank),
}
"""HF tensor shapes by name (per-layer names without their `model.layers.<i>.` prefix)."""


def global_rules(shape: ModelShape) -> tuple[Rule, ...]:
    return tuple(r for r in GLOBAL_RULES if not (shape.tie_word_embeddings and r.megatron == "output_layer.weight"))


def expected_hf_tensors(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model must have, with its shape."""
    expected = {name: _HF_SHAPES[name](shape) for rule in global_rules(shape) for name in rule.hf}
    for layer in range(shape.num_layers):
        for rule in shape.info.layer_rules:
            if not shape.applies(rule, layer):
                continue
            for names in _hf_names(rule, shape):
                expected.update({HF_LAYER.format(layer) + name: _HF_SHAPES[template](shape)
                                 for template, name in zip(rule.hf, names, strict=True)})
    return expected


def expert_rules(shape: ModelShape) -> tuple[str, ...]:
    """Megatron names of the per-layer rules that hold the routed experts (one row per expert)."""
    return tuple(r.megatron for r in shape.info.layer_rules if r.per_expert)


def dense_rules(shape: ModelShape) -> tuple[str, ...]:
    """Megatron names of every other per-layer rule (attention, norms, router, shared experts, dense MLPs)."""
    return tuple(r.megatron for r in shape.info.layer_rules if not r.per_expert)


def expert_hf_tensors(shape: ModelShape, layer: int, experts: Iterable[int]) -> list[str]:
    """The HF names of routed experts `experts` of `layer` (none for a dense layer or model)."""
    rules = [r for r in shape.info.layer_rules if r.per_expert and shape.applies(r, layer)]
    return [HF_LAYER.format(layer) + name.format(e=e) for e in experts for r in rules for name in r.hf]


def _hf_names(rule: Rule, shape: ModelShape) -> list[tuple[str, ...]]:
    """A rule's HF names: once, or for a per-expert rule once per expert (in expert order)."""
    if not rule.per_expert:
        return [rule.hf]
    return [tuple(name.format(e=expert) for name in rule.hf) for expert in range(shape.num_experts)]


def _placed(shape: ModelShape, layers: Iterable[int] | None, globals_: Iterable[str] | None,
            rules: Iterable[str] | None = None) -> list[tuple[str, Rule, str]]:
    """(megatron name, rule, HF prefix) of each wanted tensor: the chosen globals, then each layer's.

    Defaults: every layer, every global, every per-layer rule; `rules` names per-layer rules by Megatron name.
    """
    layers = range(shape.num_layers) if layers is None else layers
    wanted = {r.megatron for r in global_rules(shape)} if globals_ is None else set(globals_)
    layer_rules = [r for r in shape.info.layer_rules if rules is None or r.megatron in set(rules)]
    placed = [(r.megatron, r, "") for r in global_rules(shape) if r.megatron in wanted]
    for layer in layers:
        placed += [(MEGATRON_LAYER.format(layer) + r.megatron, r, HF_LAYER.format(layer)) for r in layer_rules
                   if shape.applies(r, layer)]
    return placed


# ---------------------------------------------------------------------------------------------------------------
# The conversion itself
# ---------------------------------------------------------------------------------------------------------------


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: ModelShape, layers: Iterable[int] | None = None,
                   globals_: Iterable[str] | None = None, rules: Iterable[str] | None = None,
                   experts: range | None = None, row_blocks: bool = False) -> dict[str, torch.Tensor | RowBlocks]:
    """HF tensors -> Megatron tensors for the chosen layers and globals (default: all), vocabulary padded.

    `hf` is read one tensor at a time (`hf[name]`), so a lazy mapping over safetensors files keeps only the
    tensors of the returned dict in memory. `rules` limits the per-layer tensors to those Megatron names;
    `experts` the per-expert tensors to those routed experts (default: all), stacked in that order: a rank's
    slice [experts.start, experts.stop) of the expert axis. `row_blocks`: each fused tensor (QKV, gate/up) is
    returned as the HF rows it is made of (RowBlocks, for torch_dist to write unassembled), not fused.
    """
    out = {}
    for name, rule, prefix in _placed(shape, layers, globals_, rules):
        if rule.per_expert:
            per_expert = _hf_names(rule, shape)
            chosen = per_expert if experts is None else [per_expert[e] for e in experts]
            tensor = _stacked_experts(rule, [[hf[prefix + part] for part in names] for names in chosen])
        elif row_blocks and rule.fusion != "copy":
            out[name] = RowBlocks(_fused_rows(rule, hf, prefix, shape))
            continue
        else:
            tensor = _fuse(rule, [hf[prefix + part] for part in rule.hf], shape)
        out[name] = _pad_vocab(tensor, shape.padded_vocab_size) if rule.megatron in VOCAB_PADDED else tensor
    return out


def _fused_rows(rule: Rule, hf: Mapping[str, torch.Tensor], prefix: str, shape: ModelShape) -> list[torch.Tensor]:
    """The HF row blocks whose concatenation on dim 0 is `_fuse(rule, ...)`: gate then up; or, per query group,
    its query heads' rows, its key's and its value's. Each block is read alone where `hf` can (`hf.rows`)."""
    names = [prefix + part for part in rule.hf]
    if rule.fusion == "gate_up":
        return [hf[name] for name in names]
    groups = shape.num_query_groups
    q, k, v = names
    per_group = [shape.num_attention_heads // groups * shape.kv_channels, shape.kv_channels, shape.kv_channels]
    return [_rows(hf, name, group * rows, (group + 1) * rows)
            for group in range(groups) for name, rows in zip((q, k, v), per_group, strict=True)]


def _rows(hf: Mapping[str, torch.Tensor], name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of HF tensor `name`: as a tensor of their own where the source can give one
    (worker.LazySafetensors.rows maps only them, so that the writer need not copy them out of the whole tensor),
    else a view."""
    rows = getattr(hf, "rows", None)
    return rows(name, start, stop) if rows is not None else hf[name][start:stop]


def expert_rows(hf: Mapping[str, torch.Tensor], shape: ModelShape, experts: range) -> dict[str, ExpertRows]:
    """Routed experts [experts.start, experts.stop) of every MoE layer, each Megatron expert tensor as the HF
    tensors whose concatenation on dim 0 is each expert's row (gate and up; down), left unfused: torch_dist writes
    each as a shard of its own. `hf` is read as in hf_to_megatron."""
    out = {}
    for name, rule, prefix in _placed(shape, None, (), expert_rules(shape)):
        _check_expert_fusion(rule)
        per_expert = _hf_names(rule, shape)
        out[name] = ExpertRows(experts.start, shape.num_experts,
                               [[hf[prefix + part] for part in per_expert[e]] for e in experts])
    return out


def _check_expert_fusion(rule: Rule) -> None:
    """Per-expert rules fuse by concatenation on dim 0 (a copy is one part), which is what lets an expert's row be
    written as its parts."""
    if rule.fusion not in ("copy", "gate_up"):
        raise ValueError(f"{rule.megatron}: per-expert rules fuse by copy or gate_up, not {rule.fusion}")


def _stacked_experts(rule: Rule, parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """Each expert's parts fused (copy or gate_up) straight into its row of one [experts, ...] tensor: one copy of
    the experts' bytes, where fusing then stacking made two (measured: benchmarks/README.md, MoE conversion)."""
    _check_expert_fusion(rule)
    first = parts[0]
    rows = sum(t.shape[0] for t in first)
    stacked = first[0].new_empty((len(parts), rows, *first[0].shape[1:]))
    for row, expert in zip(stacked, parts, strict=True):
        torch.cat(expert, dim=0, out=row)
    return stacked


def megatron_to_hf(megatron: Mapping[str, torch.Tensor], shape: ModelShape, layers: Iterable[int] | None = None,
                   globals_: Iterable[str] | None = None, rules: Iterable[str] | None = None
                   ) -> dict[str, torch.Tensor]:
    """Megatron tensors -> HF tensors for the chosen layers, globals and rules (default: all), vocabulary
    unpadded. The inverse of `hf_to_megatron`, bit for bit."""
    out = {}
    for name, rule, prefix in _placed(shape, layers, globals_, rules):
        tensor = megatron[name]
        if rule.megatron in VOCAB_PADDED:
            tensor = tensor[: shape.vocab_size]
        pieces = tensor.unbind(0) if rule.per_expert else (tensor,)
        for names, piece in zip(_hf_names(rule, shape), pieces, strict=True):
            for part, value in zip(names, _split(rule, piece, shape), strict=True):
                out[prefix + part] = value.contiguous()
    return out


def _fuse(rule: Rule, parts: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
    if rule.fusion == "copy":
        return parts[0]
    if rule.fusion == "gate_up":
        return torch.cat(parts, dim=0)
    q, k, v = parts  # grouped by KV group: each group's query heads, then its K head, then its V head
    groups = shape.num_query_groups
    grouped = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(grouped, dim=1).reshape(-1, *q.shape[1:])


def _split(rule: Rule, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    if rule.fusion == "copy":
        return [tensor]
    if rule.fusion == "gate_up":
        return list(torch.chunk(tensor, 2, dim=0))
    groups, head_dim = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups * head_dim
    grouped = tensor.reshape(groups, per_group + 2 * head_dim, *tensor.shape[1:])
    q, k, v = torch.split(grouped, [per_group, head_dim, head_dim], dim=1)
    return [t.reshape(-1, *tensor.shape[1:]) for t in (q, k, v)]


def _pad_vocab(tensor: torch.Tensor, padded: int) -> torch.Tensor:
    if tensor.shape[0] == padded:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(padded - tensor.shape[0], *tensor.shape[1:])], dim=0)
