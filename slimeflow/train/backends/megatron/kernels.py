"""What the Megatron backend's model computes with: its layer spec, its precision and its fused kernels, as
megatron-core settings read from Megatron-LM's flags. This module is what this machine can run and the checks of
those flags (the driver runs them, so it imports no megatron-core); core_settings.py makes the settings.

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
import os
from dataclasses import dataclass

from slimeflow.config.megatron import MegatronConfig
from slimeflow.train.backends.megatron.determinism import environment_problems


@dataclass(frozen=True)
class Kernels:
    """What this process can run: CUDA, and Transformer Engine (importable)."""

    cuda: bool
    transformer_engine: bool

    @classmethod
    def detect(cls) -> Kernels:
        import torch  # here: the driver runs these checks and stays free of torch

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


def grad_reduce_in_fp32(parallel: MegatronConfig, bf16: bool) -> bool:
    """DDP's gradient buffers in fp32: always in an fp32 run (they are the parameters' dtype), under --bf16 with
    --accumulate-allreduce-grads-in-fp32 (Megatron-LM's default is bf16 buffers)."""
    return not bf16 or parallel.accumulate_allreduce_grads_in_fp32
