"""megatron-core models of the families, built from a checkpoint's Megatron args (CPU-safe local layer spec).

The local spec names parameters as Transformer Engine's does in sharded state dicts (megatron-core maps
`input_layernorm.` onto `self_attention.linear_qkv.layer_norm_`), so a GPTModel built here loads the torch_dist
checkpoints that slime and Megatron-LM load on GPUs. Upstream megatron-core has no GLM4 sandwich norms; slime
gets them from a Megatron-LM patch. `SandwichNormLayer` adds them under that patch's names
(`post_self_attn_layernorm`, `post_mlp_layernorm`), so checkpoints are interchangeable with slime's.

megatron is imported inside the functions: it is heavy and only the Megatron paths need it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch


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


def sandwich_norm_layer() -> type:
    """A TransformerLayer with RMSNorm on the attention and MLP outputs before each residual add (GLM4)."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class SandwichNormLayer(TransformerLayer):
        def __init__(self, config, submodules, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
                setattr(self, name, build_module(submodules.input_layernorm, config=config,
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
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

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


def _with_core_attention(spec, core_attention: type):
    attention = spec.submodules.self_attention
    submodules = replace(spec.submodules, self_attention=replace(
        attention, submodules=replace(attention.submodules, core_attention=core_attention)))
    return replace(spec, submodules=submodules)


def layer_spec(args: argparse.Namespace, sdpa: bool = False):
    """The local layer spec for these args: megatron-core's, with sandwich norms when the args ask for them, and
    torch's fused causal attention (`sdpa_attention`) for `sdpa`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    experts = getattr(args, "num_experts", None)
    spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=args.qk_layernorm,
                                    normalization=args.normalization)
    if experts:
        # Transformer Engine's MoE layer keeps its pre-MLP norm as `pre_mlp_layernorm` (no fused fc1 to hold it).
        keys = {k: v for k, v in spec.submodules.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."}
        spec = ModuleSpec(module=spec.module, submodules=replace(spec.submodules, sharded_state_dict_keys_map=keys))
    if sdpa:
        spec = _with_core_attention(spec, sdpa_attention())
    post_attn, post_mlp = getattr(args, "post_self_attn_layernorm", False), getattr(args, "post_mlp_layernorm", False)
    if post_attn != post_mlp:
        raise ValueError(f"post_self_attn_layernorm={post_attn} with post_mlp_layernorm={post_mlp}: only both "
                         "(GLM4's sandwich norms) or neither are built; set both flags or neither")
    return ModuleSpec(module=sandwich_norm_layer(), submodules=spec.submodules) if post_attn else spec


def _moe_config(args: argparse.Namespace) -> dict[str, Any]:
    """TransformerConfig's MoE fields from the args (none for a dense model); experts run one after another
    (SequentialMLP) and tokens are gathered, not sent all-to-all, which needs CUDA streams."""
    if not getattr(args, "num_experts", None):
        return {}
    return {"num_moe_experts": args.num_experts, "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
            "moe_router_topk": args.moe_router_topk, "moe_router_pre_softmax": args.moe_router_pre_softmax,
            "moe_router_score_function": getattr(args, "moe_router_score_function", "softmax"),
            "moe_grouped_gemm": False, "moe_token_dispatcher_type": "allgather",
            "moe_router_load_balancing_type": "none"}


def gpt_model_from_args(args: argparse.Namespace, dtype: torch.dtype = torch.float32,
                        parallel: dict[str, Any] | None = None, pre_process: bool = True, post_process: bool = True,
                        parallel_output: bool = True, sdpa: bool = False):
    """A megatron-core GPTModel (local layer spec, CPU initialisation) of the shape in a checkpoint's args.

    `parallel`: further TransformerConfig fields (tensor/pipeline parallel sizes, ...), under megatron's
    initialised parallel state; pre_process/post_process: this pipeline stage holds the embedding / the output
    layer; parallel_output False gathers the logits over the tensor-parallel ranks (full vocabulary); sdpa: torch's
    fused causal attention (layer_spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        rotary_interleaved=getattr(args, "rotary_interleaved", False), hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, params_dtype=dtype, **_moe_config(args), **(parallel or {}))
    return GPTModel(config, layer_spec(args, sdpa), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                    rotary_percent=getattr(args, "rotary_percent", 1.0), rotary_base=int(args.rotary_base),
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    pre_process=pre_process, post_process=post_process, parallel_output=parallel_output)
