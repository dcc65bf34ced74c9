"""Padding tokens do not count in the MoE routers' statistics (Megatron backend): the expert-bias loads, the
load-balancing loss and the z-loss see the same real tokens however a micro-batch is padded.

The backend right-pads micro-batches (and pads lengths to a multiple of TP under sequence parallelism, and every
micro-batch to one shape with PP or EP); it hands megatron-core the padding mask, which megatron's routers
exclude from their counts (its expert-bias count through a _compat shim). The backend's run over padded
micro-batches: test_megatron_vpp_ep.test_padding_changes_no_router_statistic (its tiny DeepSeek-V3, shared).
"""

from __future__ import annotations

import types

import pytest
import torch

from slimeflow.train.backends.megatron import shims as _compat


def test_the_expert_bias_count_needs_the_padding_mask_stand_in():
    """megatron's own _apply_expert_bias cannot take its padding mask (a [tokens, experts] map and a [tokens] mask);
    the stand-in counts the real tokens only. When the first assertion fails, megatron fixed it: delete the shim."""
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter

    assert {(shim.owner().__name__, shim.attribute) for shim in _compat.EVERYWHERE} == \
        {("TopKRouter", "_apply_expert_bias")}
    assert all(shim.why for shim in _compat.EVERYWHERE)
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

    from slimeflow.train.backends.megatron.backend import stage_padding_mask

    padding = torch.rand(3, 8) > 0.5
    for rank in range(2):
        expected = _split_along_first_dim(padding.transpose(0, 1).contiguous(), _Group(rank, 2)).transpose(0, 1)
        assert torch.equal(stage_padding_mask(padding, False, True, rank, 2), expected)
        assert stage_padding_mask(padding, True, True, rank, 2) is padding  # GPTModel splits it itself
    assert stage_padding_mask(padding, False, False, 1, 2) is padding  # no sequence parallelism: whole
