"""The Megatron backend's sequence parallelism, distributed optimizer and activation recomputation, each against the
one-process run of tests/test_megatron_backend.py (same tiny Llama, checkpoint, batch and two-step config).

Recomputation runs in this process (a one-rank world, as the reference); TP2+SP and DP2 with the distributed
optimizer in two spawned processes each (tests/megatron_steps.py).
"""

from __future__ import annotations

import pytest
import test_megatron_backend as base
import torch
from megatron_steps import run_world

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
