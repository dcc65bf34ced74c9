"""Each megatron-core CPU shim in slimeflow/_compat.py is still needed: the unshimmed call fails on this machine.

When one of these tests fails on a CPU-only machine, megatron-core or torch stopped needing that shim: delete it.
"""

from __future__ import annotations

import pytest
import torch

from slimeflow import _compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims only apply without CUDA")


def test_every_shim_says_why_and_is_tested_here():
    names = {shim.attribute for shim in _compat.SHIMS}
    assert names == {"synchronize", "current_device", "_get_cuda_rng_state", "_set_cuda_rng_state"}
    assert all(len(shim.why) > 40 for shim in _compat.SHIMS)


def test_dist_checkpointing_preload_needs_the_synchronize_shim():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    buckets = [("f", "k", ([], [("item", torch.ones(2))]))]
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        FileSystemWriterAsync.preload_tensors(buckets, non_blocking=True)
    with _compat.megatron_on_cpu():
        assert FileSystemWriterAsync.preload_tensors(buckets, non_blocking=True)[0][2][1][0][1].sum() == 2


def test_rotary_embedding_needs_the_current_device_shim():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        rope(4)
    with _compat.megatron_on_cpu():
        assert rope(4).shape == (4, 1, 1, 8)


def test_rng_tracker_fork_needs_the_get_state_shim():
    from megatron.core.tensor_parallel import random

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        random._get_cuda_rng_state()


def test_rng_tracker_fork_needs_the_set_state_shim_to_restore_the_generator():
    """Unshimmed, the restore is queued for a CUDA device that never comes: the CPU generator is not restored."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, random

    unshimmed = random._set_cuda_rng_state  # outside megatron_on_cpu: megatron-core's own

    def fork_restores_the_generator() -> bool:
        before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            torch.rand(3)
        return torch.equal(before, torch.get_rng_state())

    with _compat.megatron_on_cpu():
        assert fork_restores_the_generator()
        shimmed, random._set_cuda_rng_state = random._set_cuda_rng_state, unshimmed
        try:
            assert not fork_restores_the_generator()
        finally:
            random._set_cuda_rng_state = shimmed


def test_shims_are_undone_on_exit():
    before = torch.cuda.synchronize
    with _compat.megatron_on_cpu():
        assert torch.cuda.synchronize is not before
    assert torch.cuda.synchronize is before
