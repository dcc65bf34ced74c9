"""megatron-core models of the families, built from a checkpoint's Megatron args (CPU-safe local layer spec).

The local spec names parameters as Transformer Engine's does in sharded state dicts (megatron-core maps
`input_layernorm.` onto `self_attention.linear_qkv.layer_norm_`), so a GPTModel built here loads the torch_dist
checkpoints that slime and Megatron-LM load on GPUs. Upstream megatron-core has no GLM4 sandwich norms; slime
gets them from a Megatron-LM patch. `SandwichNormLayer` adds them under that patch's names
(`post_self_attn_layernorm`, `post_mlp_layernorm`), so checkpoints are interchangeable with slime's. Multi-latent
attention (DeepSeek-V3) runs on the local spec with a core attention that takes MLA's key/value head sizes, its
latent norms keyed as TE fuses them; a model whose dense and expert layers differ gets one layer spec per layer.

Only the Megatron paths import this module (the backend registry imports the Megatron backend when a rank builds
it), so megatron-core is imported at its top.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch
from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from slimeflow.train.backends.megatron.shims import megatron_on_cpu


def _normed(bda: Callable[..., Any], norm: torch.nn.Module) -> Callable[..., Any]:
    """Megatron's bias-dropout-add factory, with `norm` applied to the branch output (plus its bias) first."""

    def factory(training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        add = bda(training, fused)

        def apply(output_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor,
                  prob: float) -> torch.Tensor:
            output, bias = output_with_bias
            return add((norm(output if bias is None else output + bias), None), residual, prob)

        return apply

    return factory


class TorchNorm:
    """torch's RMSNorm or LayerNorm (config.normalization), as megatron's WrappedTorchNorm builds it, without its
    refusal of sequence parallelism (a q/k norm sees whole sequences either way: the projection before it gathers
    them). megatron's tag on the parameters, `sequence_parallel`, is `TAG`."""

    TAG = False

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization {config.normalization!r}: the local layer spec builds {sorted(kinds)}")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = cls.TAG and config.sequence_parallel
        return norm


class SequenceParallelNorm(TorchNorm):
    """A norm of the hidden states between layers, which sequence parallelism splits along the sequence over the
    tensor-parallel ranks: each rank's weight gradient then covers its part of the tokens only, and the tag makes
    megatron's finalize_model_grads sum them over the tensor-parallel group (Transformer Engine's norms carry it)."""

    TAG = True


def sandwich_norm_layer(norm: Any = None) -> type:
    """A TransformerLayer with RMSNorm on the attention and MLP outputs before each residual add (GLM4); the norms
    are built as `norm` (None: as the layer's input norm, the local spec's; TE's spec fuses that one away)."""
    class SandwichNormLayer(TransformerLayer):
        def __init__(self, config, submodules, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
                setattr(self, name, build_module(norm or submodules.input_layernorm, config=config,
                                                 hidden_size=config.hidden_size, eps=config.layernorm_epsilon))
            self.self_attn_bda = _normed(self.self_attn_bda, self.post_self_attn_layernorm)
            self.mlp_bda = _normed(self.mlp_bda, self.post_mlp_layernorm)

    return SandwichNormLayer


def sdpa_attention() -> type:
    """megatron-core's local core attention, computed by torch's fused scaled_dot_product_attention (causal).

    The local DotProductAttention materialises the [batch, heads, s, s] scores, masks and softmaxes them in
    separate ops: on a CPU that made a training step ~1.35x the torch backend's (sdpa) CPU time. Same inputs,
    outputs and softmax scale; no parameters, so checkpoints are unchanged. Causal masks only, no dropout: the
    training backend's right-padded rows need no other mask (a causal position never sees the padding after it).
    """
    class SdpaAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal or attention_bias is not None \
                    or packed_seq_params is not None or self.config.attention_dropout:
                raise ValueError("SdpaAttention computes causal attention without dropout, bias or packed "
                                 "sequences only")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    return SdpaAttention


def mla_core_attention(sdpa: bool = False) -> type:
    """megatron-core's local DotProductAttention (with `sdpa`, sdpa_attention's), taking the key and value head sizes
    that MLA passes (Transformer Engine's attention takes them; the local one has no such arguments). Keys are as
    long as queries, values kv_channels long (the args set kv_channels to MLA's v_head_dim)."""
    class MLADotProductAttention(sdpa_attention() if sdpa else DotProductAttention):
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            if v_channels is not None and v_channels != config.kv_channels:
                raise ValueError(f"MLA's v_head_dim ({v_channels}) must equal kv_channels ({config.kv_channels})")
            super().__init__(config, *args, **kwargs)

    return MLADotProductAttention


_MLA_KEYS = {
    # Transformer Engine's MLA spec fuses the latent norms into the up projections that follow them.
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def key_map(args: argparse.Namespace, moe: bool | None = None, te: bool = False) -> dict[str, str]:
    """How a layer's parameter names map onto the checkpoint's, which are Transformer Engine's: nothing to map for
    TE's spec (`te`); the local spec's norms keyed as TE fuses them (see layer_spec)."""
    if te:
        return {}
    experts = getattr(args, "num_experts", None) if moe is not False else None
    mla = bool(getattr(args, "multi_latent_attention", False))
    # As for dense attention: TE fuses the input norm into linear_qkv and the pre-MLP norm into fc1. MLA keeps its
    # input norm (TE: TENorm), an MoE layer its pre-MLP norm (no fused fc1 to hold it).
    return {**({} if mla else {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}),
            **({} if experts else {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}), **(_MLA_KEYS if mla else {})}


def te_layer_spec(args: argparse.Namespace, moe: bool | None = None, grouped_gemm: bool = False):
    """Transformer Engine's layer spec for these args (GPUs with TE): megatron-core's, experts as TEGroupedMLP with
    `grouped_gemm`, GLM4's sandwich norms as TENorm. Its names are the checkpoint's (key_map: none)."""
    experts = getattr(args, "num_experts", None) if moe is not False else None
    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=args.qk_layernorm,
        multi_latent_attention=bool(getattr(args, "multi_latent_attention", False)))
    if getattr(args, "post_self_attn_layernorm", False):
        return ModuleSpec(module=sandwich_norm_layer(TENorm), submodules=spec.submodules)
    return spec


def layer_spec(args: argparse.Namespace, moe: bool | None = None, sdpa: bool = False):
    """The local layer spec for these args: megatron-core's, with sandwich norms when the args ask for them, and
    parameters keyed as Transformer Engine's specs key them (key_map). `moe`: an expert layer (None: whenever the
    args have experts); `sdpa`: torch's fused causal attention (`sdpa_attention`), for MLA too (mla_core_attention)."""
    experts = getattr(args, "num_experts", None) if moe is not False else None
    mla = bool(getattr(args, "multi_latent_attention", False))
    spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=args.qk_layernorm,
                                    multi_latent_attention=mla, normalization=args.normalization)
    submodules = replace(spec.submodules, sharded_state_dict_keys_map=key_map(args, moe))
    if mla:
        attention = spec.submodules.self_attention
        submodules = replace(submodules, self_attention=ModuleSpec(
            module=attention.module, params=attention.params,
            submodules=replace(attention.submodules, core_attention=mla_core_attention(sdpa),
                               **dict.fromkeys(("linear_q_down_proj", "linear_kv_down_proj"), _duplicated_linear()))))
    elif sdpa:
        attention = submodules.self_attention
        submodules = replace(submodules, self_attention=replace(
            attention, submodules=replace(attention.submodules, core_attention=sdpa_attention())))
    # MLA's latent norms follow its whole-on-each-rank down projections: under sequence parallelism they see this
    # rank's part of the sequence only, as the hidden-state norms do (dense q/k norms see whole sequences).
    submodules = replace(submodules, input_layernorm=SequenceParallelNorm, pre_mlp_layernorm=SequenceParallelNorm,
                         self_attention=_with_torch_norms(submodules.self_attention, SequenceParallelNorm if mla
                                                          else TorchNorm))
    post_attn, post_mlp = getattr(args, "post_self_attn_layernorm", False), getattr(args, "post_mlp_layernorm", False)
    if post_attn != post_mlp:
        raise ValueError(f"post_self_attn_layernorm={post_attn} with post_mlp_layernorm={post_mlp}: only both "
                         "(GLM4's sandwich norms) or neither are built; set both flags or neither")
    return ModuleSpec(module=sandwich_norm_layer() if post_attn else spec.module, submodules=submodules)


def _duplicated_linear() -> type:
    """MLA's down projections as Transformer Engine's spec builds them (TELinear, parallel_mode "duplicated"): whole
    on every tensor-parallel rank, their weights tagged `sequence_parallel` (megatron sums their gradients over the
    ranks, which saw a part of the sequence each). The local spec's ColumnParallelLinear splits them, and megatron-core
    then never sums the gradient of the shared RoPE key over the ranks' heads (Megatron-LM issue 1699, open in
    0.16.1): at TP 2 the weights drift from one process's. megatron-core's MLA takes this Linear as it takes TELinear."""
    return Linear


def _with_torch_norms(attention: Any, norm: type) -> Any:
    """The attention spec with its q/k (MLA: latent) norms built by `norm` (megatron's refuse sequence
    parallelism); identities stay identities."""
    norms = {f.name: norm for f in fields(attention.submodules)
             if getattr(attention.submodules, f.name) in (WrappedTorchNorm, FusedLayerNorm)}
    return replace(attention, submodules=replace(attention.submodules, **norms))


def block_spec(args: argparse.Namespace, config: Any, sdpa: bool = False, vp_stage: int | None = None,
               te: bool = False):
    """This pipeline stage's layer specs (one per layer: dense and expert layers alternate when moe_layer_freq is a
    list, DeepSeek's first dense layers) and the final norm, under megatron's initialised parallel state.
    `config`: the model's TransformerConfig (its pipeline split; moe_grouped_gemm); `sdpa`: see layer_spec;
    `vp_stage`: the virtual pipeline chunk (None without interleaving); `te`: Transformer Engine's specs."""
    def spec(moe: bool | None):
        grouped = bool(getattr(config, "moe_grouped_gemm", False))
        return te_layer_spec(args, moe, grouped) if te else layer_spec(args, moe=moe, sdpa=sdpa)

    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, list):
        dense, moe = spec(False), spec(True)
        specs = [moe if is_moe else dense for is_moe in freq]
    else:
        specs = [spec(None)] * args.num_layers
    first = get_transformer_layer_offset(config, vp_stage)
    final_norm: Any = SequenceParallelNorm
    if te:
        final_norm = TENorm
    return TransformerBlockSubmodules(layer_specs=specs[first: first + get_num_layers_to_build(config, vp_stage)],
                                      layer_norm=final_norm)


def _moe_config(args: argparse.Namespace) -> dict[str, Any]:
    """TransformerConfig's MoE fields from the args (none for a dense model); experts run one after another
    (SequentialMLP) and tokens are gathered, unless `parallel` (gpt_model_from_args) sets the runtime fields."""
    if not getattr(args, "num_experts", None):
        return {}
    optional = ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
                "moe_layer_freq")
    return {"num_moe_experts": args.num_experts, "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
            "moe_router_topk": args.moe_router_topk, "moe_router_pre_softmax": args.moe_router_pre_softmax,
            **{name: getattr(args, name) for name in optional if getattr(args, name, None) is not None},
            "moe_grouped_gemm": False, "moe_token_dispatcher_type": "allgather",
            "moe_router_load_balancing_type": "none", "moe_router_dtype": "fp32"}


_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
               "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim")


def _mla_config(args: argparse.Namespace) -> dict[str, Any]:
    """MLATransformerConfig's fields from the args (none without multi-latent attention)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    return {"multi_latent_attention": True, "rotary_base": float(args.rotary_base),
            **{name: getattr(args, name) for name in _MLA_FIELDS if hasattr(args, name)}}


def gpt_model_from_args(args: argparse.Namespace, dtype: torch.dtype = torch.float32,
                        parallel: dict[str, Any] | None = None, pre_process: bool = True, post_process: bool = True,
                        parallel_output: bool = True, sdpa: bool = False, vp_stage: int | None = None,
                        te: bool = False):
    """A megatron-core GPTModel (local layer spec, or Transformer Engine's with `te`; CPU initialisation) of the
    shape in a checkpoint's args.

    `parallel`: further TransformerConfig fields (tensor/pipeline parallel sizes, ...), under megatron's
    initialised parallel state; pre_process/post_process: this pipeline stage holds the embedding / the output
    layer; parallel_output False gathers the logits over the tensor-parallel ranks (full vocabulary); sdpa: torch's
    fused causal attention (layer_spec); vp_stage: the virtual pipeline stage this chunk is (its layers' offset)."""
    mla = _mla_config(args)
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        rotary_interleaved=getattr(args, "rotary_interleaved", False), hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, params_dtype=dtype)
    # `parallel` may set any field, the precision and fusion ones above too (the backend's megatron_kernels)
    config = (MLATransformerConfig if mla else TransformerConfig)(
        **{**fields, **_moe_config(args), **mla, **(parallel or {})})
    with megatron_on_cpu():  # MLA's constructor needs it (a shim there); nested in the backend's, it changes nothing
        return GPTModel(config, block_spec(args, config, sdpa, vp_stage, te), vocab_size=args.padded_vocab_size,
                        max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                        rotary_percent=getattr(args, "rotary_percent", 1.0), rotary_base=int(args.rotary_base),
                        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                        pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                        vp_stage=vp_stage)
