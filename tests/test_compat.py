"""Each megatron-core CPU shim in slimeflow/_compat.py is still needed: the unshimmed call fails on this machine.

When one of these tests fails on a CPU-only machine, megatron-core or torch stopped needing that shim: delete it.
"""

from __future__ import annotations

import argparse
import multiprocessing.managers
import queue
import subprocess
import sys

import pytest
import torch

from slimeflow import _compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims only apply without CUDA")


def test_every_shim_says_why_and_is_tested_here():
    names = {shim.attribute for shim in _compat.SHIMS}
    assert names == {"synchronize", "current_device", "_get_cuda_rng_state", "_set_cuda_rng_state", "te_general_gemm",
                     "HAVE_TE"}
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


def test_moe_router_needs_the_te_general_gemm_shim():
    from megatron.core.transformer.moe import moe_utils

    inp, weight = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    with _compat.megatron_on_cpu():
        torch.testing.assert_close(moe_utils.router_gating_linear(inp, weight, None, torch.float32), inp @ weight.T)
    assert not hasattr(moe_utils, "te_general_gemm")  # deleted again: megatron-core never defined it


def test_multi_latent_attention_needs_the_have_te_shim(megatron_world):
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from slimeflow.families.megatron import layer_spec

    config = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, kv_channels=8, q_lora_rank=8,
                                  kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, rope_type="rope",
                                  use_cpu_initialization=True, normalization="RMSNorm")
    from megatron.core.transformer import multi_latent_attention

    args = argparse.Namespace(qk_layernorm=True, normalization="RMSNorm", multi_latent_attention=True)
    attention = layer_spec(args).submodules.self_attention  # with the core attention MLA needs here
    with _compat.megatron_on_cpu():  # the other shims are needed before it gets this far
        multi_latent_attention.HAVE_TE = True  # as unshimmed
        with pytest.raises(TypeError, match="isinstance"):
            build_module(attention, config=config, layer_number=1)
        multi_latent_attention.HAVE_TE = False
        built = build_module(attention, config=config, layer_number=1)
    assert built.linear_q_up_proj.weight.shape == (2 * 12, 8)
    assert multi_latent_attention.HAVE_TE is True  # restored on exit


def test_shims_are_undone_on_exit():
    before = torch.cuda.synchronize
    with _compat.megatron_on_cpu():
        assert torch.cuda.synchronize is not before
    assert torch.cuda.synchronize is before


def test_synchronous_save_results_need_no_manager_process():
    """Unshimmed, megatron-core collects write results through a Manager queue served by a spawned process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert filesystem_async._results_queue is None
    with _compat.in_process_write_results():
        assert isinstance(filesystem_async._get_write_results_queue(), queue.Queue)
    assert filesystem_async._results_queue is None
    try:
        assert isinstance(filesystem_async._get_write_results_queue(), multiprocessing.managers.BaseProxy)
    finally:
        filesystem_async._results_queue = None  # the manager shuts its server down when collected


def _imports_dynamo(eager: bool) -> bool:
    """Whether importing megatron.core.dist_checkpointing (in a fresh interpreter) loads torch._dynamo."""
    block = "eager_jit_fusions()" if eager else "contextlib.nullcontext()"
    code = ("import contextlib, sys, torch\n"
            "from slimeflow._compat import eager_jit_fusions\n"
            f"with {block}:\n    import megatron.core.dist_checkpointing\n"
            "assert torch.compile.__module__.startswith('torch'), torch.compile\n"
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1] == "True"


def test_megatron_import_compiles_its_fusions_unless_eager():
    assert _imports_dynamo(eager=False)
    assert not _imports_dynamo(eager=True)
