"""The Megatron backend's layout beyond TP x PP x DP: virtual pipeline stages (the interleaved schedule) and the
MoE runtime (expert parallelism, router and dispatcher flags), read from MegatronConfig as Megatron-LM reads its args.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slimeflow.config.model_args import MOE_RUNTIME
from slimeflow.config.train import MegatronConfig


def virtual_pipeline_stages(num_layers: int, parallel: MegatronConfig) -> int | None:
    """Model chunks per pipeline rank for --num-layers-per-virtual-pipeline-stage (None: no virtual pipeline), as
    Megatron-LM derives them; ValueError when the layers do not split so."""
    per_stage, pp = parallel.num_layers_per_virtual_pipeline_stage, parallel.pipeline_model_parallel_size
    if per_stage is None:
        return None
    if pp == 1:
        raise ValueError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 (the "
                         "interleaved schedule interleaves pipeline stages); drop it or raise the pipeline size")
    if num_layers % (pp * per_stage):
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: the model's {num_layers} layers do "
                         f"not split into --pipeline-model-parallel-size {pp} x stages of {per_stage} layers; use a "
                         f"divisor of {num_layers // pp if num_layers % pp == 0 else num_layers} layers")
    return num_layers // (pp * per_stage)


def check_moe(args: Any, parallel: MegatronConfig, checkpoint: str | Path) -> None:
    """ValueError for MoE settings this model cannot run: experts or MoE runtime flags on a dense model (they would
    change nothing), an MoE model tensor-parallel without sequence parallelism (megatron-core's MoE layer raises
    then, in its first training forward) or multi-latent attention so (the gradient of its RoPE key, shared by the
    heads, is then left partial on each rank: Megatron-LM issue 1699)."""
    if getattr(args, "num_experts", None) and parallel.tensor_model_parallel_size > 1 and not parallel.sequence_parallel:
        raise ValueError(f"{checkpoint} is an MoE model: at --tensor-model-parallel-size "
                         f"{parallel.tensor_model_parallel_size} it trains with --sequence-parallel only (megatron-core's "
                         "MoE layer raises without it); add --sequence-parallel")
    if getattr(args, "multi_latent_attention", False) and parallel.tensor_model_parallel_size > 1 and \
            not parallel.sequence_parallel:
        raise ValueError(f"{checkpoint} uses multi-latent attention: at --tensor-model-parallel-size "
                         f"{parallel.tensor_model_parallel_size} it trains with --sequence-parallel only (without it "
                         "megatron-core leaves the RoPE key's gradient partial on each rank); add --sequence-parallel")
    if not getattr(args, "num_experts", None):
        defaults = MegatronConfig()
        given = [f"--{field.replace('_', '-')}" for field in ("expert_model_parallel_size", *MOE_RUNTIME)
                 if getattr(parallel, field) != getattr(defaults, field)]
        if given:
            raise ValueError(f"{' '.join(given)}: {checkpoint} is a dense model (no experts); drop them")


def moe_runtime(parallel: MegatronConfig) -> dict[str, Any]:
    """TransformerConfig's MoE runtime fields from the MoE runtime flags (experts: SequentialMLP, local spec)."""
    return {"moe_token_dispatcher_type": parallel.moe_token_dispatcher_type,
            "moe_router_load_balancing_type": parallel.moe_router_load_balancing_type,
            "moe_aux_loss_coeff": parallel.moe_aux_loss_coeff, "moe_z_loss_coeff": parallel.moe_z_loss_coeff,
            "moe_router_dtype": parallel.moe_router_dtype,
            "moe_router_bias_update_rate": parallel.moe_router_bias_update_rate}
