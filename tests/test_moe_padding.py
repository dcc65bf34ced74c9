"""Padding tokens do not count in the MoE routers' statistics (Megatron backend): the expert-bias loads, the
load-balancing loss and the z-loss see the same real tokens however a micro-batch is padded.

The backend right-pads micro-batches (and pads lengths to a multiple of TP under sequence parallelism, and every
micro-batch to one shape with PP or EP); it hands megatron-core the padding mask, which megatron's routers
exclude from their counts (its expert-bias count through a _compat shim).
"""

from __future__ import annotations

import types

import pytest
import torch
from megatron_steps import make_backend, make_batch, make_config, make_job
from test_megatron_vpp_ep import deepseek_v3

from slimeflow import _compat

__all__ = ["deepseek_v3"]  # the tiny DeepSeek-V3 fixture, shared


def test_the_expert_bias_count_needs_the_padding_mask_stand_in():
    """megatron's own _apply_expert_bias cannot take its padding mask (a [tokens, experts] map and a [tokens] mask);
    the stand-in counts the real tokens only. When the first assertion fails, megatron fixed it: delete the shim."""
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter

    assert {(shim.owner().__name__, shim.attribute) for shim in _compat.EVERYWHERE} == \
        {("TopKRouter", "_apply_expert_bias")}
    routing_map = torch.zeros(6, 4, dtype=torch.bool)
    routing_map[torch.arange(6), torch.tensor([0, 1, 2, 3, 0, 0])] = True
    padding = torch.tensor([False, False, False, False, True, True])
    router = types.SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(4))
    own = inspect.unwrap(vars(TopKRouter)["_apply_expert_bias"])  # megatron's, without its torch.compile
    with pytest.raises(RuntimeError, match="size of tensor"):
        own(router, routing_map, padding)
    with _compat.megatron_fixes():
        vars(TopKRouter)["_apply_expert_bias"](router, routing_map, padding)
    assert router.local_tokens_per_expert.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert inspect.unwrap(vars(TopKRouter)["_apply_expert_bias"]) is own  # restored on exit


class _Group:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_a_later_pipeline_stage_gets_its_sequence_parallel_share_of_the_mask():
    """GPTModel splits the mask with the embeddings (first stage only): a later stage's mask is cut as megatron's
    scatter_to_sequence_parallel_region cuts the first stage's, [rows, length] split along the length."""
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim

    from slimeflow.stages.rl.backend.megatron_backend import stage_padding_mask

    padding = torch.rand(3, 8) > 0.5
    for rank in range(2):
        expected = _split_along_first_dim(padding.transpose(0, 1).contiguous(), _Group(rank, 2)).transpose(0, 1)
        assert torch.equal(stage_padding_mask(padding, False, True, rank, 2), expected)
        assert stage_padding_mask(padding, True, True, rank, 2) is padding  # GPTModel splits it itself
    assert stage_padding_mask(padding, False, False, 1, 2) is padding  # no sequence parallelism: whole


def _router_statistics(backend, batch, micro_batches, extra_columns, monkeypatch) -> dict:
    """One forward-backward of `micro_batches` with every micro-batch padded by `extra_columns` more positions: each
    router's token counts (what the expert-bias update reads), the expert biases after the update, the aux and
    z-loss values megatron's tracker logged, and the gradients."""
    from megatron.core.transformer.moe import moe_utils

    from slimeflow.stages.rl.backend import megatron_backend

    round_up = megatron_backend._round_up
    monkeypatch.setattr(megatron_backend, "_round_up", lambda value, unit: round_up(value, unit) + extra_columns)
    modules = backend.modules[0]
    routers = [m for m in modules.modules() if hasattr(m, "expert_bias") and m.expert_bias is not None]
    biases = [r.expert_bias.clone() for r in routers]
    counts = []
    config = modules.config
    finalize = config.finalize_model_grads_func

    def counting(*args, **kwargs):
        counts.extend(r.local_tokens_per_expert.clone() for r in routers)
        return finalize(*args, **kwargs)

    def loss_of(indices, part):
        return types.SimpleNamespace(loss=sum(lp.sum() for lp in part.log_probs) / 100, metrics={})

    moe_utils.clear_aux_losses_tracker()
    config.finalize_model_grads_func = counting
    try:
        backend.forward_backward(batch, micro_batches, loss_of)
    finally:
        config.finalize_model_grads_func = finalize
    out = {"counts": counts, "before": biases, "biases": [r.expert_bias.clone() for r in routers],
           "losses": {name: entry["values"].clone() for name, entry in
                      moe_utils.get_moe_layer_wise_logging_tracker().items()},
           "grads": torch.cat([p.main_grad.flatten() for p in modules.parameters() if p.requires_grad])}
    for router, bias in zip(routers, biases, strict=True):
        router.expert_bias.copy_(bias)
    for chunk in backend.model:
        chunk.zero_grad_buffer()
    moe_utils.clear_aux_losses_tracker()
    return out


def test_padding_changes_no_router_statistic(deepseek_v3, tmp_path, monkeypatch):
    """The tiny DeepSeek-V3 (sigmoid router, expert bias), seq_aux_loss and a z-loss on, one process: micro-batches
    of 4 unequal samples padded as the backend pads them and with 5 more padding positions give the same token
    counts per expert (exactly; their total is top-k x the real tokens), the same expert-bias update, the same aux
    and z-loss values (1e-6 relative) and gradients (1e-5 relative: rounding of other matrix shapes); one sample
    per micro-batch (no padding at all) counts the same tokens and moves the biases the same way."""
    from slimeflow.stages.rl.backend.megatron_checkpoint import load_checkpoint

    batch = make_batch()
    config = make_config(batch={"micro_batch_size": 4}, megatron={"moe_router_load_balancing_type": "seq_aux_loss",
                                                                   "moe_aux_loss_coeff": 0.01})
    backend = make_backend(make_job(tmp_path, "padding", deepseek_v3["hf"], deepseek_v3["release"], batch, config))
    try:
        load_checkpoint(backend, deepseek_v3["release"], weights_only=True)
        backend.modules[0].config.moe_z_loss_coeff = 1e-3  # no slime flag sets it here; megatron's routers read it
        fours = [[0, 1, 2, 3], [4, 5, 6, 7]]
        padded = _router_statistics(backend, batch, fours, 0, monkeypatch)
        more = _router_statistics(backend, batch, fours, 5, monkeypatch)
        single = _router_statistics(backend, batch, [[i] for i in range(8)], 0, monkeypatch)
        topk = backend.modules[0].config.moe_router_topk
    finally:
        backend.close()
    real_tokens = sum(batch.total_lengths)
    assert padded["counts"] and all(float(c.sum()) == topk * real_tokens for c in padded["counts"])
    for run in (more, single):
        assert all(torch.equal(a, b) for a, b in zip(padded["counts"], run["counts"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(padded["biases"], run["biases"], strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(padded["before"], padded["biases"], strict=True))  # moved
    assert set(padded["losses"]) == {"seq_load_balancing_loss", "z_loss"}
    for name, values in padded["losses"].items():
        assert values.abs().sum() > 0
        torch.testing.assert_close(more["losses"][name], values, rtol=1e-6, atol=0)
    torch.testing.assert_close(more["grads"], padded["grads"], rtol=1e-5, atol=1e-7)
