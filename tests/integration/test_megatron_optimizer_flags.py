"""Megatron-LM's --deterministic-mode, --use-precision-aware-optimizer and --optimizer-cpu-offload (with
--optimizer-offload-fraction and --overlap-cpu-optimizer-d2h-h2d), as slime's scripts pass them: parsed into the
Megatron config, refused by the torch backend and the converter, passed to megatron-core's OptimizerConfig, refused
at start where their GPU kernels are missing (not at parse: a CPU login node may launch a GPU run). The one-process
deterministic run is tests/integration/test_megatron_backend.py's; the optimizers' steps need a GPU (the `gpu` tests here).
"""

from __future__ import annotations

import os

import pytest
import test_megatron_backend as base
import torch
from megatron_steps import make_config, make_job, train_job
from train_helpers import flag_config as train_config

from slimeflow.config.megatron import MegatronConfig
from slimeflow.config.model_args import check_model_args
from slimeflow.config.slime_flags import refusal_reason
from slimeflow.train.backends.megatron.core_settings import optimizer_config
from slimeflow.train.backends.megatron.determinism import GPU_ENVIRONMENT, DeterministicMode
from slimeflow.train.backends.megatron.kernels import Kernels, kernel_problems

converted = base.converted  # the tiny Llama and its torch_dist checkpoint (module fixture; the GPU tests only)

CPU = Kernels(cuda=False, transformer_engine=False)
GPU_WITHOUT_TE = Kernels(cuda=True, transformer_engine=False)
GPU_WITH_TE = Kernels(cuda=True, transformer_engine=True)
SLIME_OFFLOAD = ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer")
"""What slime's large-MoE scripts pass (scripts/run-qwen3-30B-A3B.sh and others)."""
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}


def test_the_flags_are_taken_into_the_megatron_config_and_refused_elsewhere():
    megatron = train_config(*SLIME_OFFLOAD, "--deterministic-mode", "--optimizer-offload-fraction", "0.5").megatron
    assert (megatron.optimizer_cpu_offload, megatron.overlap_cpu_optimizer_d2h_h2d,
            megatron.use_precision_aware_optimizer, megatron.deterministic_mode) == (True, True, True, True)
    assert megatron.optimizer_offload_fraction == 0.5
    assert [refusal_reason(f) for f in ("--deterministic-mode", *SLIME_OFFLOAD, "--optimizer-offload-fraction")] \
        == [None] * 5
    for backend in ("torch", "convert"):
        refused = [p.split(" ", 1)[0] for p in check_model_args(megatron, HF_CONFIG, backend)]
        assert refused == ["--deterministic-mode", "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
                           "--optimizer-offload-fraction", "--overlap-cpu-optimizer-d2h-h2d"]
    assert check_model_args(megatron, HF_CONFIG, "megatron") == []
    # megatron-core's own options that change nothing here are refused by name, with the reason
    assert "SGD" in refusal_reason("--use-torch-optimizer-for-cpu-offload")
    assert "dtypes are not taken" in refusal_reason("--exp-avg-dtype")


def test_combinations_megatron_lm_refuses_fail_at_parse():
    with pytest.raises(ValueError, match="--optimizer-cpu-offload needs --use-precision-aware-optimizer"):
        MegatronConfig(optimizer_cpu_offload=True)
    with pytest.raises(ValueError, match="--optimizer-offload-fraction and --overlap-cpu-optimizer-d2h-h2d without"):
        MegatronConfig(optimizer_offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True)
    with pytest.raises(ValueError, match="less than or equal to 1"):
        MegatronConfig(optimizer_offload_fraction=1.5)


def test_what_needs_a_gpu_or_transformer_engine_is_refused_at_start_by_name():
    """The precision-aware optimizer needs Transformer Engine (megatron-core 0.16.1 reads its version whenever the
    optimizer is on), the host offload a GPU to offload from; both the distributed optimizer (megatron-core asserts
    it). Deterministic mode runs anywhere."""
    offload = MegatronConfig(use_distributed_optimizer=True, optimizer_cpu_offload=True,
                             use_precision_aware_optimizer=True)
    aware = MegatronConfig(use_distributed_optimizer=True, use_precision_aware_optimizer=True)
    assert [p.split(":")[0] for p in kernel_problems(offload, CPU)] == ["--optimizer-cpu-offload",
                                                                       "--use-precision-aware-optimizer"]
    assert all("no CUDA" in p for p in kernel_problems(offload, CPU))
    for kernels, why in ((CPU, "no CUDA"), (GPU_WITHOUT_TE, "Transformer Engine is not installed")):
        (problem,) = kernel_problems(aware, kernels)
        assert problem.startswith("--use-precision-aware-optimizer: ") and why in problem
    assert kernel_problems(offload, GPU_WITHOUT_TE) == kernel_problems(aware, GPU_WITHOUT_TE)
    assert kernel_problems(aware, GPU_WITH_TE) == kernel_problems(offload, GPU_WITH_TE) == []
    (problem,) = kernel_problems(MegatronConfig(use_precision_aware_optimizer=True), GPU_WITH_TE)
    assert "add --use-distributed-optimizer" in problem
    assert kernel_problems(MegatronConfig(deterministic_mode=True), CPU) == []


def test_slimes_offload_flags_parse_anywhere_and_are_refused_when_the_stage_starts():
    """A CPU login node may launch a GPU run: the flags parse everywhere; the train stage's start checks (before
    Ray) ask this machine's kernels, as every trainer asks its own again when it builds the backend."""
    from slimeflow.train.backends.megatron.preflight import megatron_backend_problems

    config = train_config("--train-backend", "megatron", "--ref-load", "r", "--use-distributed-optimizer",
                          "--deterministic-mode", *SLIME_OFFLOAD)
    problems = megatron_backend_problems(config)
    assert problems == kernel_problems(config.megatron, Kernels.detect())  # nothing else keeps this run from starting
    if not Kernels.detect().cuda:
        assert [p.split(":")[0] for p in problems] == ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]


def test_the_optimizer_flags_reach_megatron_cores_optimizer_config(monkeypatch):
    """optimizer_config is what MegatronBackend hands get_megatron_optimizer. megatron-core's OptimizerConfig reads
    Transformer Engine's version when the precision-aware optimizer is on; TE is absent here, so that one check is
    answered as TE 2.x would (what GPU_WITH_TE describes)."""
    from megatron.core.optimizer import optimizer_config as megatron_optimizer_config

    monkeypatch.setattr(megatron_optimizer_config, "is_te_min_version", lambda version: True)
    o = make_config(optimizer={"lr": 1e-3, "bf16": True}).optimizer
    config = optimizer_config(o, train_config(*SLIME_OFFLOAD, "--use-distributed-optimizer").megatron, GPU_WITH_TE)
    assert (config.use_precision_aware_optimizer, config.optimizer_cpu_offload, config.overlap_cpu_optimizer_d2h_h2d,
            config.optimizer_offload_fraction, config.use_distributed_optimizer) == (True, True, True, 1.0, True)
    assert (config.pin_cpu_grads, config.bf16, config.lr) == (True, True, 1e-3)
    plain = optimizer_config(o, MegatronConfig(), CPU)
    assert (plain.use_precision_aware_optimizer, plain.optimizer_cpu_offload, plain.pin_cpu_grads) == (False,) * 3


def test_megatron_cores_hybrid_optimizer_still_cannot_step_host_parameters():
    """Why --optimizer-cpu-offload is refused without CUDA: megatron-core 0.16.1's HybridDeviceOptimizer creates
    CUDA streams, and with host streams stood in (slimeflow.train.backends.megatron.shims's) its step still looks every host parameter up
    as the host copy of a GPU one: KeyError. When this test fails, the offload may run on a CPU: lift the refusal."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    from slimeflow.train.backends.megatron.shims import TorchWithHostStreams, cuda_available

    if cuda_available():
        pytest.skip("on a GPU machine the hybrid optimizer runs (the gpu tests)")
    param = torch.nn.Parameter(torch.ones(3))

    def hybrid():
        return hybrid_optimizer.HybridDeviceOptimizer(
            [{"params": [param]}], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True, pin_cpu_grads=False, lr=1e-3)

    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        hybrid()
    saved = hybrid_optimizer.torch
    hybrid_optimizer.torch = TorchWithHostStreams()
    try:
        optimizer = hybrid()
        param.grad = torch.ones(3)
        with pytest.raises(KeyError):
            optimizer.step()
    finally:
        hybrid_optimizer.torch = saved


@pytest.fixture
def clean_gpu_environment(monkeypatch):
    for name in GPU_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


def test_deterministic_mode_sets_the_gpu_environment_and_puts_everything_back(clean_gpu_environment, monkeypatch):
    """On a GPU (cuda=True) the unset variables get slime's values (NCCL_ALGO Ring, cuBLAS :4096:8, TE's
    NVTE_ALLOW_NONDETERMINISTIC_ALGO 0) beside torch's switches; exit removes what it set. A value that lets a
    library pick a non-deterministic algorithm is refused by name, before anything changes; allowed ones stay."""
    state = DeterministicMode.enter(cuda=True)
    try:
        assert {name: os.environ.get(name) for name in GPU_ENVIRONMENT} == \
            {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
    finally:
        state.exit()
    assert not any(name in os.environ for name in GPU_ENVIRONMENT)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic

    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    with pytest.raises(ValueError, match="NCCL_ALGO='NVLS' allows non-deterministic algorithms; set it to one of Tree"):
        DeterministicMode.enter(cuda=True)
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    (problem,) = kernel_problems(MegatronConfig(deterministic_mode=True), GPU_WITH_TE)  # at start, too
    assert problem.startswith("--deterministic-mode: NCCL_ALGO='NVLS'")
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    DeterministicMode.enter(cuda=True).exit()
    assert os.environ["NCCL_ALGO"] == "Tree"
    DeterministicMode.enter(cuda=False).exit()  # on a CPU the variables mean nothing: NCCL_ALGO may be anything


GPU_LR = 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: megatron's hybrid and TE optimizers")
@pytest.mark.parametrize("flags", [
    {"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": True},
    {"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5},
    {"use_precision_aware_optimizer": True},
], ids=["offload-all-overlapped", "offload-half", "precision-aware"])
def test_the_gpu_optimizers_step_like_megatrons_distributed_optimizer(converted, flags):
    """One bf16 step (the distributed optimizer, as slime always runs) with each optimizer against the plain one:
    the same gradients (same model, batch and kernels), the fp32 main parameters stepped by AdamW on the host, or by
    TE's FusedAdam, instead of on the device, so they differ by float rounding only and the bf16 weights by at most
    one bf16 spacing (2^-7 relative). Not run on the CPU machine this was written on: unmeasured."""
    if not Kernels.detect().transformer_engine:
        pytest.skip("megatron-core 0.16.1's precision-aware optimizer needs Transformer Engine")
    batch = base.rollout_batch(converted["hf"])
    runs = {}
    for name, extra in (("plain", {}), ("flags", flags)):
        config = make_config(batch={"micro_batch_size": 3}, optimizer={"lr": GPU_LR, "bf16": True},
                             megatron={"use_distributed_optimizer": True, **extra})
        runs[name] = train_job(0, 1, make_job(converted["tmp"], f"gpu-{name}", converted["hf"], converted["release"],
                                              batch, config))
    plain, got = runs["plain"], runs["flags"]
    assert got["steps"][0]["grad_norm"] == pytest.approx(plain["steps"][0]["grad_norm"], rel=1e-3)
    for key, value in plain["weights"].items():
        torch.testing.assert_close(got["weights"][key].float(), value.float(), rtol=2**-7, atol=1e-6, msg=key)
    moved = max((plain["weights"][k].float() - w).abs().max().item() for k, w in base_weights(converted).items())
    assert moved > 0  # the step moved the weights: the comparison is not of two untouched models


def base_weights(converted) -> dict[str, torch.Tensor]:
    """The checkpoint's HF weights before any step (fp32)."""
    from safetensors.torch import load_file

    return {k: v.float() for path in sorted(converted["hf"].glob("*.safetensors")) for k, v in load_file(path).items()}
