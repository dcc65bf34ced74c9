"""The Megatron backend's sequence parallelism, distributed optimizer and activation recomputation, each against the
one-process run of tests/integration/test_megatron_backend.py (same tiny Llama, checkpoint, batch and two-step config).

Recomputation runs in this process (a one-rank world, as the reference); TP2+SP and DP2 with the distributed
optimizer in two spawned processes each (tests/megatron_steps.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import test_megatron_backend as base
import torch
from megatron_steps import make_backend, make_batch, make_config, make_job, run_world, train_job, train_steps

converted = base.converted  # the module's fixtures: the tiny Llama and its torch_dist checkpoint,
one_process = base.one_process  # the one-process reference run


@pytest.mark.slow
def test_sequence_parallel_with_tp2_equals_one_process(converted, one_process, tmp_path):
    """TP2 with sequences split over the two ranks between layers (megatron scatters and gathers them; the norms'
    gradients are summed over the ranks). The test rollout's odd lengths are padded to a multiple of 2."""
    run = run_world(2, "tp2sp", tmp_path, converted["hf"], converted["release"], one_process["batch"],
                    base.two_step_config(tensor_model_parallel_size=2, sequence_parallel=True))
    first = run["steps"][0]
    assert first["ppo_kl"] == 0.0  # slime's gates, with sequence parallelism
    assert first["train_rollout_logprob_abs_diff"] <= 1e-6
    base._compare_with_one_process(run, one_process)


def test_hidden_state_norms_carry_the_sequence_parallel_tag():
    """What makes megatron sum the norms' gradients over the TP ranks under sequence parallelism: the norms of the
    hidden states (each layer's two; the final one is block_spec's) are tagged; the q/k norms, which see whole
    sequences (the QKV projection gathers them), are not, and neither is any norm without sequence parallelism."""
    import argparse
    from types import SimpleNamespace

    from slimeflow.families.megatron import SequenceParallelNorm, TorchNorm, layer_spec

    spec = layer_spec(argparse.Namespace(qk_layernorm=True, normalization="RMSNorm")).submodules
    assert spec.input_layernorm is SequenceParallelNorm and spec.pre_mlp_layernorm is SequenceParallelNorm
    assert spec.self_attention.submodules.q_layernorm is TorchNorm
    assert spec.self_attention.submodules.k_layernorm is TorchNorm
    for sequence_parallel in (True, False):
        config = SimpleNamespace(normalization="RMSNorm", sequence_parallel=sequence_parallel)
        assert SequenceParallelNorm(config, 8).weight.sequence_parallel is sequence_parallel
        assert TorchNorm(config, 8).weight.sequence_parallel is False
    norm = SequenceParallelNorm(SimpleNamespace(normalization="LayerNorm", sequence_parallel=True), 8, eps=1e-3)
    assert isinstance(norm, torch.nn.LayerNorm) and norm.eps == 1e-3 and norm.bias.sequence_parallel


def test_mla_latent_path_is_whole_on_each_rank_and_its_gradients_summed():
    """Multi-latent attention under sequence parallelism: its down projections are built whole on each TP rank, as
    Transformer Engine's spec builds them (megatron-core's Linear, which tags its weight as TE's duplicated TELinear
    does), and its latent norms, which see this rank's part of the sequence only, are tagged; the up projections stay
    split over the heads. A TP 2 run against one process: test_megatron_vpp_ep's test_mla_at_tp2_...."""
    import argparse
    from types import SimpleNamespace

    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from slimeflow.families.megatron import SequenceParallelNorm, layer_spec

    args = argparse.Namespace(qk_layernorm=True, normalization="RMSNorm", multi_latent_attention=True)
    attention = layer_spec(args).submodules.self_attention.submodules
    assert attention.linear_q_down_proj is Linear and attention.linear_kv_down_proj is Linear
    assert attention.q_layernorm is SequenceParallelNorm and attention.kv_layernorm is SequenceParallelNorm
    assert attention.linear_q_up_proj is ColumnParallelLinear and attention.linear_kv_up_proj is ColumnParallelLinear
    for sequence_parallel in (True, False):
        config = SimpleNamespace(params_dtype=torch.float32, sequence_parallel=sequence_parallel)
        assert Linear(8, 4, config=config, init_method=None, bias=False).weight.sequence_parallel is sequence_parallel


@pytest.mark.slow
def test_distributed_optimizer_with_dp2_equals_one_process(converted, one_process, tmp_path):
    """Two replicas, the Adam state and the main weights sharded over them (megatron's DistributedOptimizer:
    gradients reduce-scattered, updated shards all-gathered)."""
    run = run_world(2, "dp2-distopt", tmp_path, converted["hf"], converted["release"], one_process["batch"],
                    base.two_step_config(use_distributed_optimizer=True))
    base._compare_with_one_process(run, one_process)


def resume_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank: rollout 0 from the job's checkpoint, saved under job['save']; rollout 1 (job['second']) trained
    on, as an uninterrupted run; then a new backend resumed from the save trains rollout 1 again. Rank 0 returns
    the steps and weights of both runs of rollout 1 and the saved extra state as resumed."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint, save_checkpoint

    config, runs = job["config"], []
    backend = make_backend(job, rank, world)
    try:
        load_checkpoint(backend, job["checkpoint"], weights_only=True)
        train_steps(backend, job["batch"], config, backend.dp_rank, backend.dp_size)
        ref = save_checkpoint(backend, job["save"], 0, {"rollout_id": 0})
        runs.append((train_steps(backend, job["second"], config, backend.dp_rank, backend.dp_size),
                     backend.named_weights()))
    finally:
        backend.close()
    resumed = make_backend({**job, "init": job["init"] + "-resumed"}, rank, world)
    try:
        extra = load_checkpoint(resumed, ref)
        runs.append((train_steps(resumed, job["second"], config, resumed.dp_rank, resumed.dp_size),
                     resumed.named_weights()))
    finally:
        resumed.close()
    return {"runs": runs, "extra": extra, "uri": ref.uri} if rank == 0 else None


@pytest.mark.slow
def test_distributed_optimizer_checkpoint_resumes_the_next_rollout_exactly(converted, one_process, tmp_path):
    """DP2 with the distributed optimizer: the ranks' shards of the Adam state are saved through dist_checkpointing
    with the weights, schedule and RNG, and a resumed world trains the next rollout (two steps, the LR schedule
    moving) to the same metrics and weights, bit for bit."""
    from slimeflow.checkpoint.torch_dist import tensor_metadata

    config = make_config(batch={"micro_batch_size": 2, "global_batch_size": 4},
                         optimizer={"lr": base.LR, "lr_warmup_iters": 1, "lr_decay_style": "linear",
                                    "lr_decay_iters": 8, "weight_decay": 0.01},
                         megatron={"use_distributed_optimizer": True})
    second = make_batch(seed=1)
    second.rollout_log_probs = one_process["batch"].rollout_log_probs
    got = run_world(2, "distopt-resume", tmp_path, converted["hf"], converted["release"], one_process["batch"],
                    config, work=resume_job, second=second, save=str(tmp_path / "save"))
    assert got["extra"] == {"rollout_id": 0}
    (steps, weights), (steps_again, weights_again) = got["runs"]
    assert steps_again == steps and len(steps) == 2 and steps[0]["grad_norm"] > 0
    assert weights_again.keys() == weights.keys()
    assert all(torch.equal(weights_again[k], weights[k]) for k in weights)
    # The Adam state is saved per parameter, in its global shape (as without the distributed optimizer), so it
    # reshards to any layout.
    saved = tensor_metadata(got["uri"])
    model_keys = {k for k in saved if not k.startswith("optimizer.")}
    for state in ("exp_avg", "exp_avg_sq"):
        assert {k.removeprefix(f"optimizer.state.{state}.") for k in saved
                if k.startswith(f"optimizer.state.{state}.")} == model_keys
        assert all(saved[f"optimizer.state.{state}.{k}"][0] == saved[k][0] for k in model_keys)


RECOMPUTE = [{"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
             {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
             {"recompute_granularity": "selective"}]


@pytest.mark.parametrize("recompute", RECOMPUTE, ids=["full-uniform", "full-block", "selective"])
def test_recomputation_changes_no_number(converted, one_process, monkeypatch, recompute):
    """Recomputed activations are the same computation again (no dropout): the same metrics and weights as the
    one-process run, exactly. megatron's checkpoint function counts how much was recomputed: full uniform
    recomputes each of the tiny model's 2 layers, block the first layer per stage, selective each layer's core
    attention; per training forward of a micro-batch (2 steps x 2 micro-batches), none in the log-prob forwards."""
    from megatron.core import tensor_parallel

    calls = []
    checkpoint = tensor_parallel.checkpoint

    def counted(function, *args, **kwargs):
        calls.append(function)
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(tensor_parallel, "checkpoint", counted)
    job = make_job(converted["tmp"], "recompute", converted["hf"], converted["release"], one_process["batch"],
                   base.two_step_config(**recompute))
    run = train_job(0, 1, job)
    per_forward = {"uniform": 2, "block": 1}.get(recompute.get("recompute_method"), 2)
    assert len(calls) == 2 * 2 * per_forward
    assert run["steps"] == one_process["steps"]
    assert all(torch.equal(run["weights"][k], one_process["weights"][k]) for k in one_process["weights"])
