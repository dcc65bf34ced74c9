"""slime's Megatron flags: model-shape flags (MODEL_ARGS) checked against the HF config, and the parallelism and
recompute flags a backend does not build refused, so that none of them is accepted and then ignored.

slime's guide asks users to check `--rotary-base` and friends by hand against the model; here every model-shape
flag the user gave is compared with the field of `config.json` it describes, and a mismatch names the flag, both
values and the field. Only flags set away from their defaults are compared (a config that went through JSON, as
Prefect parameters do, has every field set), so a run without MODEL_ARGS checks nothing. Parallelism (TP, PP, CP, EP,
SP), the distributed optimizer and recompute are Megatron's; the torch backend trains data-parallel over
--actor-num-nodes x --actor-num-gpus-per-node ranks, so a non-default value is refused; the Megatron backend builds
TP, SP, PP (with the interleaved schedule), DP, EP, the distributed optimizer and recomputation and refuses the
rest by name (MEGATRON_NOT_BUILT; its
start-up checks are slimeflow/train/backends/megatron/preflight.py's megatron_backend_problems).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from slimeflow.config.megatron import MegatronConfig
from slimeflow.families import family_for, head_dim, mla_fields, moe_fields, query_groups, rope_setting

MEGATRON_ONLY = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "use_distributed_optimizer",
    "num_layers_per_virtual_pipeline_stage",
)

MOE_RUNTIME = (
    "moe_token_dispatcher_type", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_router_dtype", "moe_router_bias_update_rate", "moe_grouped_gemm", "moe_permute_fusion",
)
"""Megatron's MoE runtime flags: how experts are fed and trained (megatron-core's router and dispatcher)."""

MEGATRON_KERNELS = (
    "attention_softmax_in_fp32", "accumulate_allreduce_grads_in_fp32", "attention_backend", "no_rope_fusion",
    "no_masked_softmax_fusion", "no_gradient_accumulation_fusion",
)
"""Megatron-LM's precision and kernel flags: megatron-core settings of the Megatron backend's model and DDP."""

MEGATRON_OPTIMIZER = (
    "deterministic_mode", "use_precision_aware_optimizer", "optimizer_cpu_offload", "optimizer_offload_fraction",
    "overlap_cpu_optimizer_d2h_h2d",
)
"""Megatron-LM's determinism and optimizer-memory flags: megatron-core settings of the Megatron backend's model and
optimizer (slime defines neither; its only trainer is Megatron)."""


def _experts(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The HF config's experts in Megatron's names (empty for a dense model or an unknown architecture)."""
    family = family_for(hf.get("architectures"))
    return moe_fields(hf, family) if family and family.has_experts else {}


def _mla(hf: Mapping[str, Any]) -> dict[str, Any]:
    family = family_for(hf.get("architectures"))
    return mla_fields(hf) if family and family.multi_latent_attention else {}


def _moe_layers(hf: Mapping[str, Any]) -> list[int] | None:
    experts = _experts(hf)
    return [int(i not in experts["dense_layers"]) for i in range(hf["num_hidden_layers"])] if experts else None


def _layer_flag(name: str) -> Callable[[Mapping[str, Any]], Any]:
    """A Megatron layer flag (families.FLAGS) as the HF config's switches set it (IRRELEVANT: no family known)."""
    def read(hf: Mapping[str, Any]) -> Any:
        family = family_for(hf.get("architectures"))
        return family.flags(hf)[name] if family else IRRELEVANT

    return read


def _router(hf: Mapping[str, Any]) -> Any:
    family = family_for(hf.get("architectures"))
    return family.router_score_function if family and family.has_experts else None


IRRELEVANT = object()
"""What a reader returns when the HF config makes the flag's value irrelevant (YaRN's mscale without YaRN)."""


def _yarn(name: str) -> Callable[[Mapping[str, Any]], Any]:
    def read(hf: Mapping[str, Any]) -> Any:
        mla = _mla(hf)
        if not mla:
            return None
        return mla["yarn"][name] if mla["yarn"] else 1.0 if name == "rotary_scaling_factor" else IRRELEVANT

    return read


# flag field -> (config.json field as named in messages, how to read it from the HF config)
SHAPE: dict[str, tuple[str, Callable[[Mapping[str, Any]], Any]]] = {
    "num_layers": ("num_hidden_layers", lambda hf: hf.get("num_hidden_layers")),
    "hidden_size": ("hidden_size", lambda hf: hf.get("hidden_size")),
    "ffn_hidden_size": ("intermediate_size", lambda hf: hf.get("intermediate_size")),
    "num_attention_heads": ("num_attention_heads", lambda hf: hf.get("num_attention_heads")),
    "num_query_groups": ("num_key_value_heads", query_groups),
    "kv_channels": ("head_dim (MLA: v_head_dim)", lambda hf: hf["v_head_dim"] if _mla(hf) else head_dim(hf)),
    "norm_epsilon": ("rms_norm_eps", lambda hf: hf.get("rms_norm_eps")),
    "rotary_base": ("rope_theta", lambda hf: rope_setting(hf, "rope_theta")),
    "vocab_size": ("vocab_size", lambda hf: hf.get("vocab_size")),
    "max_position_embeddings": ("max_position_embeddings", lambda hf: hf.get("max_position_embeddings")),
    "untie_embeddings_and_output_weights": ("tie_word_embeddings",
                                            lambda hf: not hf.get("tie_word_embeddings", False)),
    "swiglu": ("hidden_act", lambda hf: hf.get("hidden_act") == "silu"),
    "group_query_attention": ("num_key_value_heads", lambda hf: query_groups(hf) != hf["num_attention_heads"]),
    "rotary_percent": ("partial_rotary_factor", lambda hf: rope_setting(hf, "partial_rotary_factor", 1.0)),
    "attention_dropout": ("attention_dropout", lambda hf: hf.get("attention_dropout", 0.0)),
    "hidden_dropout": ("hidden_dropout", lambda hf: hf.get("hidden_dropout", 0.0)),
    "normalization": ("rms_norm_eps", lambda hf: "RMSNorm" if "rms_norm_eps" in hf else "LayerNorm"),
    "num_experts": ("n_routed_experts / num_experts", lambda hf: _experts(hf).get("num_experts")),
    "moe_ffn_hidden_size": ("moe_intermediate_size", lambda hf: _experts(hf).get("moe_ffn_hidden_size")),
    "moe_router_topk": ("num_experts_per_tok", lambda hf: _experts(hf).get("moe_router_topk")),
    "moe_layer_freq": ("first_k_dense_replace / mlp_only_layers", _moe_layers),
    "moe_shared_expert_intermediate_size": ("n_shared_experts",
                                            lambda hf: _experts(hf).get("moe_shared_expert_intermediate_size")),
    "moe_router_score_function": ("architectures", _router),
    "moe_router_pre_softmax": ("norm_topk_prob", lambda hf: _experts(hf).get("moe_router_pre_softmax", False)),
    "moe_router_enable_expert_bias": ("architectures", lambda hf: _router(hf) == "sigmoid"),
    "moe_router_num_groups": ("n_group", lambda hf: _experts(hf).get("moe_router_num_groups")),
    "moe_router_group_topk": ("topk_group", lambda hf: _experts(hf).get("moe_router_group_topk")),
    "moe_router_topk_scaling_factor": ("routed_scaling_factor",
                                       lambda hf: _experts(hf).get("moe_router_topk_scaling_factor")),
    "multi_latent_attention": ("architectures", lambda hf: bool(_mla(hf))),
    "q_lora_rank": ("q_lora_rank", lambda hf: _mla(hf).get("q_lora_rank")),
    "kv_lora_rank": ("kv_lora_rank", lambda hf: _mla(hf).get("kv_lora_rank")),
    "qk_head_dim": ("qk_nope_head_dim", lambda hf: _mla(hf).get("qk_head_dim")),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim", lambda hf: _mla(hf).get("qk_pos_emb_head_dim")),
    "v_head_dim": ("v_head_dim", lambda hf: _mla(hf).get("v_head_dim")),
    "rotary_scaling_factor": ("rope_scaling.factor", _yarn("rotary_scaling_factor")),
    "mscale": ("rope_scaling.mscale", _yarn("mscale")),
    "mscale_all_dim": ("rope_scaling.mscale_all_dim", _yarn("mscale_all_dim")),
    "add_qkv_bias": ("attention_bias", _layer_flag("add_qkv_bias")),
    "qk_layernorm": ("use_qk_norm", _layer_flag("qk_layernorm")),
    "disable_bias_linear": ("mlp_bias", lambda hf: _not(_layer_flag("add_bias_linear")(hf))),
}
"""--make-vocab-size-divisible-by sets the padding. The rest is checked in `_consistency`."""


def _not(value: Any) -> Any:
    return value if value is IRRELEVANT else not value


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _equal(given: Any, actual: Any) -> bool:
    if isinstance(given, float) or isinstance(actual, float):
        return actual is not None and abs(float(given) - float(actual)) <= 1e-9 * max(1.0, abs(float(actual)))
    return given == actual


NOT_BUILT = ("the Megatron backend does not build it yet (this version: TP, SP, PP with VPP, DP, EP, the "
             "distributed optimizer, activation recomputation)")
MEGATRON_NOT_BUILT = {
    "context_parallel_size": "context parallelism: " + NOT_BUILT + "; on a CPU it cannot run at all (megatron-core's "
                             "local attention asserts context parallel size 1)",
}
"""The Megatron parallelism flags the Megatron backend refuses, with the reason. Those that need Transformer Engine's
kernels (--moe-grouped-gemm, --moe-permute-fusion) are refused where it is missing (rl.backend.megatron_kernels)."""


_REFUSED_BY: dict[str, dict[str, str]] = {
    # torch_dist is resharded by whoever loads it; only TP shapes the vocabulary padding.
    "convert": {field: "the converter writes one torch_dist checkpoint that any parallel layout loads (Megatron "
                "reshards it), so it takes no parallel, recompute, optimizer or MoE runtime setting but "
                "--tensor-model-parallel-size (the vocabulary padding): remove it"
                for field in (*MEGATRON_ONLY, *MOE_RUNTIME, *MEGATRON_KERNELS, *MEGATRON_OPTIMIZER)
                if field != "tensor_model_parallel_size"},
    "megatron": {field: f"{reason}; remove it" for field, reason in MEGATRON_NOT_BUILT.items()},
    "torch": dict.fromkeys(MEGATRON_ONLY, "Megatron parallelism, recompute or distributed optimizer, read only by "
                           "--train-backend megatron; the torch backend trains data-parallel over --actor-num-nodes x "
                           "--actor-num-gpus-per-node ranks: remove it"),
}
_REFUSED_BY["torch"].update(dict.fromkeys(MOE_RUNTIME, "a Megatron MoE runtime flag (router, dispatcher, kernels), read "
                                          "only by --train-backend megatron; the torch backend runs the HF model's "
                                          "own experts: remove it"))
_REFUSED_BY["torch"].update(dict.fromkeys(MEGATRON_KERNELS, "a Megatron-LM precision or kernel flag, read only by "
                                          "--train-backend megatron; the torch backend's --bf16 autocasts its fp32 "
                                          "weights (fp32 gradients, torch's fused attention): remove it"))
_REFUSED_BY["torch"].update(dict.fromkeys(
    MEGATRON_OPTIMIZER, "a Megatron-LM determinism or optimizer flag (megatron-core's deterministic mode, "
    "precision-aware or host-offloaded optimizer), read only by --train-backend megatron; the torch backend steps "
    "torch's AdamW on its device: remove it"))
"""Per backend, the parallelism/recompute flags it refuses when set away from their defaults, with the reason."""

TRAINING_ONLY = frozenset(_REFUSED_BY["convert"])
"""The Megatron fields only training reads (parallel layout but TP, recompute, optimizer, MoE runtime, kernels): a
pipeline routes these flags to its training stages, not to the converter."""


def check_model_args(megatron: MegatronConfig, hf_config: Mapping[str, Any], backend: str) -> list[str]:
    """Problems with the Megatron flags for a run on `backend` with this HF config.json; empty when all is well."""
    defaults = MegatronConfig()
    problems = [f"{_flag(field)} {getattr(megatron, field)}: {reason}"
                for field, reason in _REFUSED_BY[backend].items() if getattr(megatron, field) != getattr(defaults, field)
                and not (field == "expert_tensor_parallel_size" and megatron.expert_tensor_parallel_size == 1)]
    # (slime's scripts pass --expert-tensor-parallel-size 1 with TP 1: what a backend without TP has anyway)
    for field, (hf_field, read) in SHAPE.items():
        value = getattr(megatron, field)
        if value is None or value == getattr(defaults, field):
            continue
        try:
            actual = read(hf_config)
            given = moe_layer_freq(value, hf_config["num_hidden_layers"]) if field == "moe_layer_freq" else value
        except KeyError:  # the config lacks a field the value derives from
            actual, given = None, value
        except ValueError as err:
            problems.append(f"{_flag(field)} {value}: {err}")
            continue
        if actual is IRRELEVANT:
            continue
        if not _equal(given, actual):
            shown = _runs(actual) if isinstance(actual, list) else actual
            problems.append(f"{_flag(field)} {value} does not match the HF config ({hf_field}: "
                            f"{hf_config.get(hf_field, 'absent')} means {shown}); correct the flag or drop it")
    return problems + _consistency(megatron, hf_config)


def _consistency(megatron: MegatronConfig, hf_config: Mapping[str, Any]) -> list[str]:
    """The MODEL_ARGS that describe a property rather than copy a config.json field."""
    problems = []
    # Megatron-LM: --use-rotary-position-embeddings (the older spelling) makes the type rope whatever else is given.
    if megatron.position_embedding_type != "rope" and not megatron.use_rotary_position_embeddings:
        problems.append(f"--position-embedding-type {megatron.position_embedding_type}: every supported family uses "
                        "rotary embeddings (rope); correct the flag or drop it")
    limit = hf_config.get("max_position_embeddings")
    if megatron.seq_length is not None and limit is not None and megatron.seq_length > limit:
        problems.append(f"--seq-length {megatron.seq_length} is longer than the HF config's max_position_embeddings "
                        f"({limit}); lower it or drop it")
    return problems


_FREQ_TERM = re.compile(r"\[\s*([01](?:\s*,\s*[01])*)\s*\](?:\s*\*\s*(\d+))?")


def moe_layer_freq(text: str, num_layers: int) -> list[int]:
    """Megatron-LM's --moe-layer-freq as a list (1: MoE layer, 0: dense): an integer N (every N-th layer, from the
    first), or list terms joined by `+`, each repeated by `*k` (`[0]*3+[1]*58`, `[0, 1, 1]`). ValueError otherwise
    (Megatron-LM evaluates the text as Python; this reads only these forms)."""
    text = text.strip()
    if text.isdigit():
        return [int(i % int(text) == 0) for i in range(num_layers)]
    layers: list[int] = []
    for term in text.split("+"):
        match = _FREQ_TERM.fullmatch(term.strip())
        if match is None:
            raise ValueError(f"{term.strip()!r} is not a list term such as [0]*3 or [0, 1, 1]; write an integer N "
                             "(every N-th layer an MoE layer) or terms like [0]*3+[1]*58")
        layers += [int(bit) for bit in match.group(1).split(",")] * int(match.group(2) or 1)
    return layers


def _runs(layers: list[int]) -> str:
    """A layer list as --moe-layer-freq's shortest form: [0]*3+[1]*58."""
    runs: list[list[int]] = []
    for bit in layers:
        if runs and runs[-1][0] == bit:
            runs[-1][1] += 1
        else:
            runs.append([bit, 1])
    return "+".join(f"[{bit}]*{count}" for bit, count in runs)
