"""What the Megatron backend's model computes with: its layer spec, its precision and its fused kernels, as
megatron-core settings read from Megatron-LM's flags.

- Layer spec: Transformer Engine's (`get_gpt_layer_with_transformer_engine_spec`; experts as TEGroupedMLP with
  --moe-grouped-gemm) where CUDA and Transformer Engine are importable, megatron-core's local spec otherwise (CPU).
  Checkpoints hold TE's parameter names, so only the local spec needs a name map (families.megatron.key_map).
- Precision (--bf16, as Megatron-LM): the model in bf16 (Float16Module), fp32 main parameters in megatron's
  mixed-precision optimizer; gradients accumulate and are reduced in fp32 with --accumulate-allreduce-grads-in-fp32,
  in bf16 without.
- Determinism and the optimizer: --deterministic-mode as TransformerConfig.deterministic_mode (with the process's
  switches, backend.determinism); --use-precision-aware-optimizer and --optimizer-cpu-offload as megatron-core
  OptimizerConfig fields, refused where their GPU kernels are missing.
- Fusions: Megatron-LM turns the rotary, masked-softmax and gradient-accumulation fusions on by default; they are
  Transformer Engine / CUDA kernels, so they run with the TE spec only and are off on the local spec, which is what
  --no-rope-fusion, --no-masked-softmax-fusion and --no-gradient-accumulation-fusion ask for everywhere.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slimeflow.config.megatron import MegatronConfig

if TYPE_CHECKING:
    import torch

    from slimeflow.config.train import OptimizerConfig


@dataclass(frozen=True)
class Kernels:
    """What this process can run: CUDA, and Transformer Engine (importable)."""

    cuda: bool
    transformer_engine: bool

    @classmethod
    def detect(cls) -> Kernels:
        import torch  # here: the flag checks at parse need no torch

        cuda = torch.cuda.is_available()
        return cls(cuda=cuda, transformer_engine=cuda and importlib.util.find_spec("transformer_engine") is not None)

    @property
    def te_spec(self) -> bool:
        """Build Transformer Engine's layer spec (CUDA and TE), megatron-core's local one otherwise."""
        return self.cuda and self.transformer_engine


def kernel_problems(parallel: MegatronConfig, kernels: Kernels) -> list[str]:
    """The kernel flags this machine cannot run, each with the reason and what to do."""
    where = "this machine has no CUDA" if not kernels.cuda else "Transformer Engine is not installed"
    problems = []
    if not kernels.te_spec:
        if parallel.moe_grouped_gemm:
            problems.append(f"--moe-grouped-gemm: grouped-GEMM experts (TEGroupedMLP) need Transformer Engine's layer "
                            f"spec on a GPU, and {where}; the local spec runs experts one after another "
                            "(SequentialMLP): drop the flag")
        if parallel.moe_permute_fusion:
            problems.append(f"--moe-permute-fusion: the fused token permutation is a Transformer Engine kernel, and "
                            f"{where}; the local spec permutes tokens in torch: drop the flag")
        if parallel.attention_backend in ("fused", "unfused", "local"):
            problems.append(f"--attention-backend {parallel.attention_backend}: the local spec computes attention with "
                            "torch's fused scaled_dot_product_attention (its flash kernel on a CPU); megatron's unfused "
                            "attention builds its causal mask on a CUDA device, and cuDNN's fused attention runs inside "
                            f"Transformer Engine, and {where}: use --attention-backend flash or auto")
    elif parallel.attention_backend == "local":
        problems.append("--attention-backend local: megatron's local attention is not built with Transformer Engine's "
                        "layer spec; use flash, fused, unfused or auto (Transformer Engine's attention)")
    return problems + optimizer_problems(parallel, kernels)


def optimizer_problems(parallel: MegatronConfig, kernels: Kernels) -> list[str]:
    """The determinism and optimizer flags this machine (or this flag combination) cannot run, each with the reason.
    megatron-core 0.16.1's precision-aware optimizer is Transformer Engine's FusedAdam, or with --optimizer-cpu-offload
    its HybridDeviceOptimizer (its OptimizerConfig reads TE's version either way: TypeError without TE), and asserts
    the distributed optimizer. The hybrid optimizer keeps host copies of GPU parameters; with host parameters its step
    fails (KeyError, tests/integration/test_megatron_optimizer_flags.py)."""
    import os

    from slimeflow.train.backends.megatron.determinism import environment_problems

    problems = []
    if parallel.use_precision_aware_optimizer and not parallel.use_distributed_optimizer:
        problems.append("--use-precision-aware-optimizer needs --use-distributed-optimizer (megatron-core's rule; "
                        "slime always runs the distributed optimizer): add --use-distributed-optimizer")
    if parallel.optimizer_cpu_offload and not kernels.cuda:
        problems.append("--optimizer-cpu-offload: megatron's HybridDeviceOptimizer steps host copies of GPU "
                        "parameters, and this machine has no CUDA (its parameters and Adam state are in host memory already; "
                        "megatron-core's hybrid optimizer fails on host parameters): drop it")
    if parallel.use_precision_aware_optimizer and not kernels.te_spec:
        where = "this machine has no CUDA" if not kernels.cuda else "Transformer Engine is not installed"
        problems.append(f"--use-precision-aware-optimizer: megatron-core's precision-aware optimizer needs Transformer "
                        f"Engine (its FusedAdam, a CUDA kernel; megatron-core reads TE's version even with "
                        f"--optimizer-cpu-offload), and {where}; megatron's optimizer keeps fp32 main parameters and "
                        "Adam state without it: drop the flag (and --optimizer-cpu-offload, which needs it)")
    if parallel.deterministic_mode and kernels.cuda:
        problems += environment_problems(os.environ)
    return problems


def optimizer_config(optimizer: OptimizerConfig, parallel: MegatronConfig, kernels: Kernels) -> Any:
    """megatron-core's OptimizerConfig from the flags: AdamW (--lr, --adam-*, --weight-decay, --clip-grad); under
    --bf16 its mixed-precision optimizer (fp32 main parameters stepped from the bf16 model's); the distributed,
    precision-aware and host-offloaded optimizers as asked (optimizer_problems refused what this machine cannot
    run). Host buffers are pinned only where there is a device to copy from."""
    import torch
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

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


def transformer_fields(parallel: MegatronConfig, bf16: bool, kernels: Kernels) -> dict[str, Any]:
    """TransformerConfig's precision, fusion, attention-backend and deterministic-mode fields from the flags. The
    attention backend picks Transformer Engine's attention (megatron sets TE's NVTE_*_ATTN variables in the process
    from it, and refuses a second model with another): it is set with TE's spec only; the local spec runs torch's
    fused attention for flash and auto alike (kernel_problems refuses the others)."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    dtype = torch.bfloat16 if bf16 else torch.float32
    fused = kernels.te_spec  # what Megatron-LM turns on by default, where its kernels exist
    return {"bf16": bf16, "params_dtype": dtype, "pipeline_dtype": dtype,
            "attention_softmax_in_fp32": parallel.attention_softmax_in_fp32,
            "apply_rope_fusion": fused and not parallel.no_rope_fusion,
            "masked_softmax_fusion": fused and not parallel.no_masked_softmax_fusion,
            "gradient_accumulation_fusion": fused and not parallel.no_gradient_accumulation_fusion,
            "attention_backend": AttnBackend[parallel.attention_backend] if fused else AttnBackend.auto,
            "deterministic_mode": parallel.deterministic_mode}


def grad_reduce_in_fp32(parallel: MegatronConfig, bf16: bool) -> bool:
    """DDP's gradient buffers in fp32: always in an fp32 run (they are the parameters' dtype), under --bf16 with
    --accumulate-allreduce-grads-in-fp32 (Megatron-LM's default is bf16 buffers)."""
    return not bf16 or parallel.accumulate_allreduce_grads_in_fp32


def in_precision(chunks: list[torch.nn.Module], bf16: bool) -> list[torch.nn.Module]:
    """The model chunks as Megatron-LM runs them: under --bf16 each in a Float16Module (its weights cast to bf16,
    float inputs cast on the first stage, outputs back to fp32 on the last), as they are otherwise."""
    if not bf16:
        return chunks
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(chunk.config, chunk) for chunk in chunks]


def unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a chunk's wrappers (megatron's DDP, Float16Module)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk
