"""--bf16 in the Megatron backend (Megatron-LM's mixed precision: a bf16 model in a Float16Module, fp32 main
parameters in megatron's optimizer) against the torch backend's bf16 and against itself at TP2; the Megatron-LM
precision and kernel flags as megatron-core settings; the choice of layer spec. CPU, gloo, the tiny Llama and
checkpoint of tests/integration/test_megatron_backend.py.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import test_megatron_backend as base
import torch
from megatron_steps import make_backend, make_config, make_job, run_world, train_steps

from slimeflow.config.megatron import MegatronConfig
from slimeflow.train.backends.megatron.core_settings import transformer_fields
from slimeflow.train.backends.megatron.kernels import Kernels, grad_reduce_in_fp32, kernel_problems

converted = base.converted  # the tiny Llama and its torch_dist checkpoint (module fixture)

LR = 1e-3
SLIME_FLAGS = {"accumulate_allreduce_grads_in_fp32": True, "attention_softmax_in_fp32": True, "no_rope_fusion": True,
               "no_masked_softmax_fusion": True, "no_gradient_accumulation_fusion": True, "attention_backend": "flash"}
"""What slime's scripts pass with --bf16."""


def main_weights(backend) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 main parameters under HF names (named_weights with each bf16 parameter's data swapped
    for its main copy, then restored). Megatron's non-distributed mixed-precision optimizer; collective."""
    pairs = [(param, main) for optimizer in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])
             for params, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups, strict=True)
             for param, main in zip(params, mains, strict=True)]
    saved = [param.data for param, _ in pairs]
    for param, main in pairs:
        param.data = main.data
    try:
        return backend.named_weights()
    finally:
        for (param, _), data in zip(pairs, saved, strict=True):
            param.data = data


def bf16_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """Load the checkpoint's weights, train on the job's batch; rank 0's steps, bf16 model weights, fp32 main
    weights (None with the distributed optimizer) and what reached megatron-core. With job["save"]: save then, zero
    the main parameters, resume from the save and return the main parameters it restored ("resumed")."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint, save_checkpoint

    backend = make_backend(job, rank, world)
    try:
        load_checkpoint(backend, job["checkpoint"], weights_only=True)
        steps = train_steps(backend, job["batch"], job["config"], backend.dp_rank, backend.dp_size)
        distributed = job["config"].megatron.use_distributed_optimizer
        result = {"steps": steps, "weights": backend.named_weights(),
                  "main": None if distributed else main_weights(backend), "reached": reached(backend)}
        if "save" in job:
            result["checkpoint"] = save_checkpoint(backend, job["save"], 0, {"rollout_id": 0}).uri
            for group in backend.optimizer.param_groups:
                for main in group["params"]:
                    main.data.zero_()
            load_checkpoint(backend, result["checkpoint"])
            result["resumed"] = main_weights(backend)
    finally:
        backend.close()
    return result if rank == 0 else None


def reached(backend) -> dict[str, Any]:
    """The settings megatron-core runs with: TransformerConfig's, DDP's, the optimizer's and the model's dtypes."""
    config, ddp = backend.modules[0].config, backend.model[0]
    fields = ("bf16", "params_dtype", "pipeline_dtype", "attention_softmax_in_fp32", "apply_rope_fusion",
              "masked_softmax_fusion", "gradient_accumulation_fusion", "attention_backend")
    params = list(backend.modules[0].parameters())
    return {**{f: getattr(config, f) for f in fields}, "grad_reduce_in_fp32": ddp.ddp_config.grad_reduce_in_fp32,
            "wrapper": type(ddp.module).__name__, "param_dtypes": {p.dtype for p in params},
            "main_grad_dtypes": {p.main_grad.dtype for p in params},
            "optimizers": [type(o).__name__ for o in getattr(backend.optimizer, "chained_optimizers", [])],
            "optimizer_bf16": backend.optimizer.config.bf16,
            "linear_qkv": type(backend.modules[0].decoder.layers[0].self_attention.linear_qkv).__name__}


TP_LR = 1e-2
"""The TP test's: its second step's KL and policy loss measure how far the first step moved the policy, which must
stand well above bf16's rounding of the log-probs (~1e-3 per token) to be compared; at lr 1e-3 it does not."""


def bf16_config(**megatron):
    return make_config(batch={"micro_batch_size": 3}, optimizer={"lr": LR, "bf16": True}, megatron=megatron)


@pytest.mark.slow
def test_a_bf16_step_matches_the_torch_backends_bf16_step(converted, tmp_path):
    """One step, slime's bf16 flags, same checkpoint and batch. The two backends compute differently rounded bf16
    functions: the torch backend autocasts fp32 weights (norms, residual adds and softmax in fp32, matmuls in bf16),
    megatron runs a bf16 model throughout (residual stream and norms in bf16, bf16 being 8 bits of mantissa: a
    relative 4e-3 per rounding). So: loss metrics and grad norm to a relative 1e-2 (measured: entropy 1e-6, grad
    norm 5e-4), the trainer's log-probs against the torch backend's bf16 ones within 1e-2 on average (measured 1e-3).
    Weights: each backend steps fp32 copies (torch: its master weights; megatron: its main parameters, which start
    from the bf16 model's), so their updates are compared in fp32. Adam's first step moves a weight by about lr x sign(gradient), so a near-zero gradient whose sign the
    rounding flips moves it up to 2 lr apart: per weight matrix, at most 2% of the entries differ by more than
    lr / 2 (measured <= 0.4%) and none by more than 2 lr plus bf16's rounding of the start weights; the update
    directions agree (cosine >= 0.95; measured >= 0.99). Norm weights (~1, bf16 spacing 2^-7) do not move in the
    bf16 model at this lr, only in the main parameters: why those are compared. The run is then saved and resumed:
    bf16 weights and fp32 main parameters in the checkpoint, as Megatron-LM's, restored exactly."""
    from slimeflow.checkpoint.torch_dist import tensor_metadata
    from slimeflow.train.backends.torch.backend import TorchBackend

    config = bf16_config(**SLIME_FLAGS)
    batch = base.rollout_batch(converted["hf"])
    torch_backend = TorchBackend(converted["hf"], config.optimizer, config.algorithm, config.batch, seed=3,
                                 device="cpu")
    batch.rollout_log_probs = torch_backend.compute_log_probs(batch).log_probs  # the torch backend's bf16 ones
    before = {k: v.clone() for k, v in torch_backend.named_weights().items()}
    expected = train_steps(torch_backend, batch, config, 0, 1)[0]
    got = bf16_job(0, 1, {**make_job(converted["tmp"], "bf16-vs-torch", converted["hf"], converted["release"],
                                     batch, config), "save": str(tmp_path / "save")})
    step = got["steps"][0]
    assert set(step) == set(expected)
    for key in ("entropy", "grad_norm", "pg_loss", "lr"):
        assert step[key] == pytest.approx(expected[key], rel=1e-2, abs=1e-6), key
    assert step["ppo_kl"] == 0.0 and step["grad_norm"] > 0.1
    assert 0.0 < step["train_rollout_logprob_abs_diff"] <= 1e-2  # bf16 rounding, not an fp32 run
    assert got["reached"] == {
        "bf16": True, "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16,
        "attention_softmax_in_fp32": True, "apply_rope_fusion": False, "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False, "attention_backend": got["reached"]["attention_backend"],
        "grad_reduce_in_fp32": True, "wrapper": "Float16Module", "param_dtypes": {torch.bfloat16},
        "main_grad_dtypes": {torch.float32}, "optimizers": ["Float16OptimizerWithFloat16Params"],
        "optimizer_bf16": True, "linear_qkv": "ColumnParallelLinear"}  # the local spec's
    assert got["reached"]["attention_backend"].name == "auto"  # flash steers TE only; here torch's fused attention
    assert all(w.dtype == torch.bfloat16 for w in got["weights"].values())  # what the engines get, as slime's
    trained = torch_backend.named_weights()
    assert set(got["main"]) == set(trained)
    for name, main in got["main"].items():
        assert main.dtype == torch.float32
        # megatron starts from the checkpoint's weights rounded to bf16 (Megatron-LM's main parameters are copies of
        # the bf16 model's after a weights-only load), the torch backend from them in fp32: compare the updates
        update, expected_update = main - before[name].bfloat16().float(), trained[name] - before[name]
        diff = (update - expected_update).abs()
        assert (diff <= 2 * LR + 1e-6).all(), name
        assert (diff > LR / 2).float().mean() <= 0.02, name
        cosine = torch.nn.functional.cosine_similarity(update.flatten(), expected_update.flatten(), dim=0)
        assert cosine >= 0.95, (name, cosine)
        # the bf16 model holds its main parameters rounded; a resume restores them from the checkpoint exactly
        torch.testing.assert_close(got["weights"][name], main.bfloat16(), atol=0, rtol=0)
        torch.testing.assert_close(got["resumed"][name], main, atol=0, rtol=0)
    # Megatron-LM's checkpoint of a bf16 run: bf16 model weights, the fp32 main parameters in the optimizer state
    saved = tensor_metadata(got["checkpoint"])
    assert {dtype for key, (_, dtype) in saved.items() if not key.startswith("optimizer.")} == {torch.bfloat16}
    assert {dtype for key, (_, dtype) in saved.items() if key.startswith("optimizer.")} == {torch.float32}
    assert "optimizer.state.fp32_param.decoder.layers.self_attention.linear_qkv.weight" in saved


@pytest.mark.slow
def test_bf16_at_tp2_equals_tp1_with_either_optimizer(converted, tmp_path):
    """TP1 with the distributed optimizer (in this process) and TP2 without it (two processes), bf16 gradient
    buffers (no --accumulate-allreduce-grads-in-fp32), two steps of 4 samples with the KL loss (low_var_kl, as
    slime's scripts), lr 1e-2 (so that a step moves the bf16 weights: their spacing is 2^-8 relative).

    TP2 sums each row-parallel GEMM's partial outputs in bf16 over the ranks where TP1 rounds one GEMM's output
    once: the same function rounded differently (in fp32 the two agree to 1e-6 over both steps, KL included). Step
    1: metrics to a relative 1e-2 (measured: entropy 4e-7, grad norm 1e-4), the log-probs against the fp32 rollout's
    within 1e-2 on average (measured <= 1.2e-3, both steps). Step 2 sees the policy step 1 made; Adam's first step
    moves each weight by about lr x sign(gradient), so a near-zero gradient whose sign rounding flips moves it 2 lr
    the other way. After step 1 a token's log-ratio to the reference is ~0.4 and bf16 moves it by 0.012 rms (TP1)
    and 0.014 (TP2) from the exact fp32 run's: TP2's rounding is of TP1's size, not a TP2 error. So step 2: entropy
    to 1e-2 (measured 1.3e-5), grad norm to 3e-2 (measured 8e-3; bf16 against fp32 1.8e-2), the KL loss, a mean of
    non-negative terms, to 10% (measured 3.5%; bf16 against fp32 4.5% and 8%). ppo_kl and pg_loss are signed means
    over the step's 14 tokens that cancel to ~0.01: within an absolute 1e-2 (measured 4.3e-3 and 2e-4; 0.013 /
    sqrt(14) is their rounding's scale).

    Why not k1 (the default): its KL loss is such a cancelling mean too, and came out 1.9x TP1's at TP2 (0.0151
    against 0.0081; fp32 0.0094, the torch backend's bf16 0.0121, TP1 at micro-batch 1 0.0098): one sample has a
    single response token, a quarter of the per-sample mean, whose log-ratio bf16 moved by 0.025 at TP2. A smaller
    lr makes the ratio worse (lr 1e-3: 0.0032 against 0.0018, fp32 0.0027; lr 1e-4: 0.0005 against -0.0002, fp32
    0.0003), as rounding noise would and a TP2 error would not; the reference model's log-probs at TP2 equal the
    policy's before step 1 exactly and TP1's to bf16's rounding (8e-4 on average, as bf16 against fp32: 9e-4).

    The weights after both steps, as the bf16 weights show them: each matrix's update points the same way (cosine >=
    0.98; measured >= 0.989) with at most 5% of the entries a whole bf16 spacing plus lr / 2 apart (measured <=
    1.6%)."""
    batch = base.rollout_batch(converted["hf"])
    config = make_config(batch={"micro_batch_size": 2, "global_batch_size": 4},
                         optimizer={"lr": TP_LR, "bf16": True},
                         algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl"})
    one = bf16_job(0, 1, make_job(converted["tmp"], "bf16-tp1", converted["hf"], converted["release"], batch,
                                  config.model_copy(update={"megatron": MegatronConfig(use_distributed_optimizer=True)})))
    assert one["reached"]["optimizers"] == ["DistributedOptimizer"]
    assert one["reached"]["main_grad_dtypes"] == {torch.bfloat16}  # Megatron-LM's default: bf16 buffers
    two = run_world(2, "bf16-tp2", tmp_path, converted["hf"], converted["release"], batch,
                    config.model_copy(update={"megatron": MegatronConfig(tensor_model_parallel_size=2)}),
                    work=bf16_job)
    assert two["reached"]["optimizers"] == ["Float16OptimizerWithFloat16Params"]
    (got, got_next), (want, want_next) = two["steps"], one["steps"]
    assert got["ppo_kl"] == want["ppo_kl"] == 0.0 and got["kl_loss"] == want["kl_loss"] == 0.0
    for step in (got, want, got_next, want_next):
        assert step["train_rollout_logprob_abs_diff"] <= 1e-2
    for key in ("entropy", "grad_norm", "pg_loss", "lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-2, abs=1e-6), key
    assert want_next["kl_loss"] > 1e-3 and abs(want_next["ppo_kl"]) > 1e-3  # step 1 moved the policy off both
    for key, rel in (("entropy", 1e-2), ("grad_norm", 3e-2), ("kl_loss", 0.1), ("lr", 0.0)):
        assert got_next[key] == pytest.approx(want_next[key], rel=rel), key
    for key in ("ppo_kl", "pg_loss"):
        assert got_next[key] == pytest.approx(want_next[key], abs=1e-2), key
    start = {name: weight.bfloat16().float() for name, weight in base_weights(converted["hf"]).items()}
    assert all(torch.equal(w, m.bfloat16()) for w, m in zip(two["weights"].values(), two["main"].values(), strict=True))
    for name, weight in two["weights"].items():
        update, expected_update = weight.float() - start[name], one["weights"][name].float() - start[name]
        spacing = torch.finfo(torch.bfloat16).eps * start[name].abs()
        assert ((update - expected_update).abs() > TP_LR / 2 + spacing).float().mean() <= 0.05, name
        cosine = torch.nn.functional.cosine_similarity(update.flatten(), expected_update.flatten(), dim=0)
        assert cosine >= 0.98, (name, cosine)


def base_weights(hf) -> dict[str, torch.Tensor]:
    """The HF checkpoint's weights (the converted checkpoint's, fp32)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(hf.glob("*.safetensors")):
        weights.update(load_file(path))
    return weights


# -- flags and the layer spec, without a model ---------------------------------------------------------------------

CPU, GPU_WITHOUT_TE, GPU_WITH_TE = Kernels(False, False), Kernels(True, False), Kernels(True, True)


def test_fusions_run_with_transformer_engine_unless_turned_off():
    """Megatron-LM's default fusions are on where their kernels exist (TE's spec on a GPU) and off on the local spec;
    --no-rope-fusion / --no-masked-softmax-fusion / --no-gradient-accumulation-fusion turn each off there too."""
    fusions = ("apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion")
    on_te = transformer_fields(MegatronConfig(), bf16=True, kernels=GPU_WITH_TE)
    assert all(on_te[f] for f in fusions)
    assert transformer_fields(MegatronConfig(attention_backend="flash"), True, GPU_WITH_TE)["attention_backend"].name \
        == "flash"
    assert transformer_fields(MegatronConfig(attention_backend="flash"), True, CPU)["attention_backend"].name == "auto"
    for kernels in (CPU, GPU_WITHOUT_TE):
        assert not any(transformer_fields(MegatronConfig(), True, kernels)[f] for f in fusions)
    for flag, field in zip(("no_rope_fusion", "no_masked_softmax_fusion", "no_gradient_accumulation_fusion"),
                           fusions, strict=True):
        fields = transformer_fields(MegatronConfig(**{flag: True}), True, GPU_WITH_TE)
        assert [f for f in fusions if not fields[f]] == [field]
    fp32 = transformer_fields(MegatronConfig(attention_softmax_in_fp32=True), bf16=False, kernels=CPU)
    assert (fp32["bf16"], fp32["params_dtype"], fp32["attention_softmax_in_fp32"]) == (False, torch.float32, True)


def test_gradient_buffers_are_fp32_unless_bf16_without_the_flag():
    assert grad_reduce_in_fp32(MegatronConfig(), bf16=False)
    assert not grad_reduce_in_fp32(MegatronConfig(), bf16=True)
    assert grad_reduce_in_fp32(MegatronConfig(accumulate_allreduce_grads_in_fp32=True), bf16=True)


def test_te_only_kernels_are_refused_without_transformer_engine_by_name():
    flags = MegatronConfig(moe_grouped_gemm=True, moe_permute_fusion=True, attention_backend="fused")
    for kernels, why in ((CPU, "no CUDA"), (GPU_WITHOUT_TE, "Transformer Engine is not installed")):
        problems = kernel_problems(flags, kernels)
        assert [p.split(":")[0] for p in problems] == ["--moe-grouped-gemm", "--moe-permute-fusion",
                                                       "--attention-backend fused"]
        assert all(why in p for p in problems)
        assert kernel_problems(MegatronConfig(attention_backend="unfused"), kernels)[0].endswith("flash or auto")
    assert kernel_problems(flags, GPU_WITH_TE) == []
    assert [kernel_problems(MegatronConfig(attention_backend=b), CPU) for b in ("flash", "auto")] == [[], []]
    assert "not built with Transformer Engine's" in kernel_problems(MegatronConfig(attention_backend="local"),
                                                                    GPU_WITH_TE)[0]


def test_the_spec_and_its_name_map_follow_cuda_and_transformer_engine():
    """TE's spec (no name map: the checkpoint's names are TE's) exactly when CUDA and TE are both there; the local
    spec maps its norms onto TE's fused names otherwise."""
    from slimeflow.families.megatron import key_map, layer_spec

    args = argparse.Namespace(qk_layernorm=True, normalization="RMSNorm")
    assert [k.te_spec for k in (CPU, GPU_WITHOUT_TE, GPU_WITH_TE)] == [False, False, True]
    assert Kernels.detect() == Kernels(torch.cuda.is_available(), Kernels.detect().transformer_engine)
    assert key_map(args, te=True) == {}
    local = key_map(args, te=False)
    assert local == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                     "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    assert layer_spec(args).submodules.sharded_state_dict_keys_map == local


def test_warmup_fraction_is_a_fraction_of_the_decay_steps_in_both_schedules():
    """--lr-warmup-fraction reaches megatron's OptimizerParamScheduler (the Megatron backend's) as warm-up steps,
    and the torch backend's lr_at gives the same learning rate at every step."""
    from types import SimpleNamespace

    from slimeflow.config.train import OptimizerConfig
    from slimeflow.train.backends.megatron.backend import MegatronBackend
    from slimeflow.train.schedule import lr_at

    config = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_fraction=0.25, lr_decay_style="linear", lr_decay_iters=10)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = MegatronBackend._param_scheduler(SimpleNamespace(optimizer_config=config, optimizer=optimizer), None)
    assert scheduler.lr_warmup_steps == 2.5
    megatron_lrs = []
    for _ in range(12):
        megatron_lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    assert lr_at(config, 1) == pytest.approx(0.4)  # warm-up over 2.5 steps
    assert megatron_lrs == pytest.approx([lr_at(config, step) for step in range(12)])
    with pytest.raises(ValueError, match="--lr-warmup-fraction 0.25 with --lr-warmup-iters 2"):
        OptimizerConfig(lr_warmup_fraction=0.25, lr_warmup_iters=2)
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        lr_at(OptimizerConfig(lr_warmup_fraction=0.25), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Transformer Engine's layer spec")
def test_a_bf16_step_with_transformer_engine_on_a_gpu(converted):
    """The TE spec loads the converted checkpoint (TE's names, no map) and trains one bf16 step, close to the torch
    backend's bf16 step (tolerances as on the CPU)."""
    pytest.importorskip("transformer_engine")
    from slimeflow.train.backends.torch.backend import TorchBackend

    config = bf16_config(**SLIME_FLAGS)
    batch = base.rollout_batch(converted["hf"])
    torch_backend = TorchBackend(converted["hf"], config.optimizer, config.algorithm, config.batch, seed=3)
    expected = train_steps(torch_backend, batch, config, 0, 1)[0]
    got = bf16_job(0, 1, make_job(converted["tmp"], "bf16-te", converted["hf"], converted["release"], batch, config))
    assert got["steps"][0]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-2)
    assert got["reached"]["bf16"] and got["reached"]["apply_rope_fusion"] is False  # --no-rope-fusion
    assert got["reached"]["linear_qkv"] == "TELayerNormColumnParallelLinear"  # TE's spec, the input norm fused
    assert got["reached"]["masked_softmax_fusion"] is False and got["reached"]["grad_reduce_in_fp32"]
