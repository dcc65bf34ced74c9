"""megatron-core's settings from Megatron-LM's flags (kernels.py says which and why): the optimizer's config, the
TransformerConfig's precision, fusion and attention fields, and the model chunks' precision wrapper."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module

from slimeflow.config.megatron import MegatronConfig
from slimeflow.config.train import OptimizerConfig
from slimeflow.train.backends.megatron.kernels import Kernels


def optimizer_config(optimizer: OptimizerConfig, parallel: MegatronConfig, kernels: Kernels) -> Any:
    """megatron-core's OptimizerConfig from the flags: AdamW (--lr, --adam-*, --weight-decay, --clip-grad); under
    --bf16 its mixed-precision optimizer (fp32 main parameters stepped from the bf16 model's); the distributed,
    precision-aware and host-offloaded optimizers as asked (optimizer_problems refused what this machine cannot
    run). Host buffers are pinned only where there is a device to copy from."""
    o = optimizer
    return MegatronOptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=o.bf16,
        params_dtype=torch.bfloat16 if o.bf16 else torch.float32,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        use_precision_aware_optimizer=parallel.use_precision_aware_optimizer,
        optimizer_cpu_offload=parallel.optimizer_cpu_offload,
        optimizer_offload_fraction=parallel.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=parallel.overlap_cpu_optimizer_d2h_h2d,
        pin_cpu_grads=kernels.cuda, pin_cpu_params=kernels.cuda)


def fuse_host_adam(optimizer: Any) -> None:
    """Step megatron's AdamW with torch's fused kernel where its parameters are in host memory (a CPU run).

    Why: without Transformer Engine or Apex megatron-core builds torch's AdamW with no `fused` argument, which on
    host tensors runs the per-parameter loop (about ten elementwise passes over every weight): 0.69 s of a
    SmolLM2-135M step against 0.16 s for the fused kernel, the one the torch backend steps with
    (benchmarks/README.md). The update differs by float rounding only. A loaded optimizer state brings back the
    flag its param groups were saved with, so the checkpoint loader calls this again after loading. GPU parameters
    are left to megatron's choice (TE's or Apex's FusedAdam; torch's foreach default on CUDA)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)  # None: a stub (a pipeline stage without parameters)
        if not isinstance(adam, torch.optim.Adam):  # AdamW is an Adam
            continue
        params = [param for group in adam.param_groups for param in group["params"]]
        if params and all(param.device.type == "cpu" and param.is_floating_point() for param in params):
            adam.defaults.update(fused=True, foreach=None)
            for group in adam.param_groups:
                group.update(fused=True, foreach=None)  # torch reads them per group at every step


def transformer_fields(parallel: MegatronConfig, bf16: bool, kernels: Kernels) -> dict[str, Any]:
    """TransformerConfig's precision, fusion, attention-backend and deterministic-mode fields from the flags. The
    attention backend picks Transformer Engine's attention (megatron sets TE's NVTE_*_ATTN variables in the process
    from it, and refuses a second model with another): it is set with TE's spec only; the local spec runs torch's
    fused attention for flash and auto alike (kernel_problems refuses the others)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    fused = kernels.te_spec  # what Megatron-LM turns on by default, where its kernels exist
    return {"bf16": bf16, "params_dtype": dtype, "pipeline_dtype": dtype,
            "attention_softmax_in_fp32": parallel.attention_softmax_in_fp32,
            "apply_rope_fusion": fused and not parallel.no_rope_fusion,
            "masked_softmax_fusion": fused and not parallel.no_masked_softmax_fusion,
            "gradient_accumulation_fusion": fused and not parallel.no_gradient_accumulation_fusion,
            "attention_backend": AttnBackend[parallel.attention_backend] if fused else AttnBackend.auto,
            "deterministic_mode": parallel.deterministic_mode}


def in_precision(chunks: list[torch.nn.Module], bf16: bool) -> list[torch.nn.Module]:
    """The model chunks as Megatron-LM runs them: under --bf16 each in a Float16Module (its weights cast to bf16,
    float inputs cast on the first stage, outputs back to fp32 on the last), as they are otherwise."""
    if not bf16:
        return chunks
    return [Float16Module(chunk.config, chunk) for chunk in chunks]


def unwrapped(chunk: torch.nn.Module) -> Any:
    """The GPTModel inside a chunk's wrappers (megatron's DDP, Float16Module); megatron-core ships no type
    information, so to a type checker it is Any."""
    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk
