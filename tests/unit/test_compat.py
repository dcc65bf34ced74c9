"""Each megatron-core CPU shim in slimeflow/train/backends/megatron/shims.py is still needed: the unshimmed call fails on this machine.

When one of these tests fails on a CPU-only machine, megatron-core or torch stopped needing that shim: delete it.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing.managers
import queue
import subprocess
import sys

import pytest
import torch

from slimeflow.train.backends.megatron import shims as _compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims only apply without CUDA")


def test_every_shim_says_why_and_is_tested_here():
    names = {(shim.owner().__name__, shim.attribute) for shim in _compat.SHIMS}
    assert names == {("torch.cuda", "synchronize"), ("torch.cuda", "current_device"),
                     ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
                     ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
                     ("megatron.core.transformer.moe.moe_utils", "te_general_gemm"),
                     ("megatron.core.transformer.multi_latent_attention", "HAVE_TE"),
                     ("megatron.core.optimizer.optimizer", "torch"),
                     ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
                     ("megatron.core.optimizer.clip_grads", "torch"), ("megatron.core.utils", "torch"),
                     ("megatron.core.pipeline_parallel.schedules", "torch"),
                     ("DistributedOptimizer", "_build_model_and_main_param_groups"),
                     ("Float16OptimizerWithFloat16Params", "__init__"),
                     ("DistributedOptimizer", "state_dict"),
                     ("DistributedOptimizer", "_set_main_param_and_optimizer_states"),
                     ("megatron.core.transformer.moe.token_dispatcher", "torch"),
                     ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"),
                     ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"),
                     ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim")}
    assert all(len(shim.why) > 40 for shim in _compat.SHIMS)


@contextlib.contextmanager
def all_shims_but(module, attribute: str):
    """megatron_on_cpu with one shim taken back out: megatron-core's own `module.attribute` inside."""
    original = getattr(module, attribute)
    with _compat.megatron_on_cpu():
        shimmed = getattr(module, attribute)
        setattr(module, attribute, original)
        try:
            yield
        finally:
            setattr(module, attribute, shimmed)


def test_fp32_optimizer_needs_the_optimizer_module_torch_shim():
    from megatron.core.optimizer import OptimizerConfig, optimizer

    def build():
        return optimizer.FP32Optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]),
                                       OptimizerConfig(lr=1e-3), None)

    with all_shims_but(optimizer, "torch"), pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        build()
    with _compat.megatron_on_cpu():
        assert build().get_loss_scale().device.type == "cpu"


def test_gradient_clipping_needs_the_stand_in_for_its_cuda_type_assert():
    from megatron.core.optimizer import optimizer

    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 3.0)
    with all_shims_but(optimizer, "clip_grad_by_total_norm_fp32"), pytest.raises(AssertionError):
        optimizer.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=6.0)
    with _compat.megatron_on_cpu():
        optimizer.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=6.0)
    torch.testing.assert_close(param.grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))


def test_the_inf_norm_of_gradients_needs_the_clip_grads_torch_shim(megatron_world):
    from megatron.core.optimizer import clip_grads

    grads = [torch.tensor([1.0, -4.0]), torch.tensor([2.0])]
    with all_shims_but(clip_grads, "torch"), pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        clip_grads.get_grad_norm_fp32(grads, norm_type=float("inf"))
    with _compat.megatron_on_cpu():
        assert clip_grads.get_grad_norm_fp32(grads, norm_type=float("inf")) == 4.0


def test_the_l2_norm_without_apex_needs_the_utils_torch_shim():
    from megatron.core import utils

    tensors = [[torch.tensor([3.0]), torch.tensor([4.0])]]
    with all_shims_but(utils, "torch"), pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        utils.local_multi_tensor_l2_norm(2048, None, tensors, False)
    with _compat.megatron_on_cpu():
        assert utils.local_multi_tensor_l2_norm(2048, None, tensors, False)[0].item() == 5.0


def test_the_schedule_needs_the_schedules_torch_shim(megatron_world):
    from megatron.core import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.enums import ModelType

    model = torch.nn.Linear(2, 1)
    model.config, model.model_type = ModelParallelConfig(), ModelType.encoder_or_decoder
    model.set_input_tensor = lambda tensor: None

    def step(data, model):
        return model(next(data)).sum(), lambda out: (out, {"out": out.detach()})

    def run():
        return schedules.forward_backward_no_pipelining(
            forward_step_func=step, data_iterator=iter([torch.ones(1, 2)]), model=[model], num_microbatches=1,
            seq_length=1, micro_batch_size=1, forward_only=True)

    with all_shims_but(schedules, "torch"), pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        run()
    with _compat.megatron_on_cpu():
        assert len(run()) == 1


def distributed_optimizer():
    """megatron's DistributedOptimizer (inside its ChainedOptimizer) over a DDP-wrapped Linear(4, 2): fp32
    parameters on the CPU. Call inside megatron_on_cpu, in megatron_world."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, use_cpu_initialization=True)
    module = torch.nn.Linear(4, 2)
    module.config = config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), module=module)
    chained = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])
    return chained.chained_optimizers[0]


def test_the_distributed_optimizer_needs_cpu_tensor_types_named_as_cuda(megatron_world):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    with all_shims_but(DistributedOptimizer, "_build_model_and_main_param_groups"), \
            pytest.raises(TypeError, match="torch.cuda.FloatTensor"):
        distributed_optimizer()
    with _compat.megatron_on_cpu():
        assert sum(map(len, distributed_optimizer().model_fp32_groups)) == 2  # the Linear's weight and bias
    assert torch.ones(1).type() == "torch.FloatTensor"  # restored


def test_the_bf16_optimizer_needs_cpu_tensor_types_named_as_cuda():
    """--bf16 without the distributed optimizer: megatron's mixed-precision optimizer gives each bf16 parameter an
    fp32 main copy, recognising bf16 parameters by their CUDA type name."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    def build():
        param = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        return Float16OptimizerWithFloat16Params(torch.optim.AdamW([param]), OptimizerConfig(lr=1e-3, bf16=True),
                                                 None, lambda *args: None)

    with all_shims_but(Float16OptimizerWithFloat16Params, "__init__"), \
            pytest.raises(TypeError, match="torch.cuda.BFloat16Tensor"):
        build()
    with _compat.megatron_on_cpu():
        optimizer = build()
    assert [main.dtype for main in optimizer.fp32_from_float16_groups[0]] == [torch.float32]
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"  # restored


def test_a_fresh_distributed_optimizers_state_dict_needs_the_adam_state_stand_in(megatron_world):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    with all_shims_but(DistributedOptimizer, "state_dict"), pytest.raises(AssertionError):
        distributed_optimizer().state_dict()
    with _compat.megatron_on_cpu():
        state = distributed_optimizer().state_dict()
    assert {group["step"] for group in state["optimizer"]["param_groups"]} == {0}


def test_loading_distributed_optimizer_state_needs_the_own_step_stand_in(megatron_world):
    """As a resume loads it: load_state_dict sets the step, then every parameter's loaded tensors, without it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    @torch.no_grad()  # as megatron's load_parameter_state_from_fully_reshardable
    def load(optimizer):
        optimizer.load_state_dict(optimizer.state_dict())
        for param in optimizer.model_param_group_index_map:
            optimizer._set_main_param_and_optimizer_states(
                param, {key: torch.zeros(param.numel()) for key in ("param", "exp_avg", "exp_avg_sq")})
        return optimizer

    with all_shims_but(DistributedOptimizer, "_set_main_param_and_optimizer_states"), \
            pytest.raises(KeyError, match="step"):
        load(distributed_optimizer())
    with _compat.megatron_on_cpu():
        steps = [state["step"] for state in load(distributed_optimizer()).optimizer.state.values()]
    assert len(steps) == 2 and steps[0] is not steps[1]  # one count per parameter: Adam adds 1 to each per step


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


def test_the_alltoall_dispatcher_needs_the_host_streams_shim(megatron_world):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import token_dispatcher

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=2,
                               moe_router_topk=2, moe_token_dispatcher_type="alltoall", use_cpu_initialization=True)

    def build():
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # created by the first one built
        return token_dispatcher.MoEAlltoAllTokenDispatcher(2, [0, 1], config,
                                                           ProcessGroupCollection.use_mpu_process_groups())

    with all_shims_but(token_dispatcher, "torch"), pytest.raises(RuntimeError, match="CUDA"):
        build()
    with _compat.megatron_on_cpu():
        assert build().cuda_dtoh_stream is not None


def test_alltoall_split_sizes_need_the_host_numpy_shim(megatron_world):
    """gloo's all_to_all_single takes split sizes as a sequence of ints, not a tensor; megatron makes them numpy
    only when moving them off a GPU."""
    from megatron.core.transformer.moe import token_dispatcher

    sizes, tokens = torch.tensor([3]), torch.arange(3.0)
    with all_shims_but(token_dispatcher, "maybe_move_tensor_to_cpu"):
        unshimmed = token_dispatcher.maybe_move_tensor_to_cpu(sizes, as_numpy=True)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        torch.distributed.all_to_all_single(torch.empty(3), tokens, unshimmed, unshimmed)
    with _compat.megatron_on_cpu():
        shimmed = token_dispatcher.maybe_move_tensor_to_cpu(sizes, as_numpy=True)
    out = torch.empty(3)
    torch.distributed.all_to_all_single(out, tokens, shimmed, shimmed)
    assert torch.equal(out, tokens)


def test_uneven_gathers_and_reduce_scatters_need_the_gloo_stand_ins(megatron_world):
    """gloo's all_gather and reduce_scatter take pieces of one size only (the input's, the output's): the uneven
    forms megatron's all-to-all dispatcher uses with expert and tensor parallelism fail (the reduce-scatter with a
    fatal check, so it is shown in a child process). One rank shows the size check; the stand-ins' results at two
    ranks are checked by test_megatron_vpp_ep's TP 2 x EP 2 run against one process."""
    from megatron.core.tensor_parallel import mappings

    with pytest.raises(RuntimeError, match="invalid tensor size"):
        torch.distributed.all_gather([torch.empty(4, 2)], torch.ones(3, 2))
    script = ("import tempfile, torch; torch.distributed.init_process_group('gloo', init_method='file://' + "
              "tempfile.mktemp(), rank=0, world_size=1); "
              "torch.distributed.reduce_scatter(torch.empty(2, 2), [torch.ones(3, 2)])")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert child.returncode != 0 and "Check failed: outputs[0].sizes()" in child.stderr
    group = torch.distributed.group.WORLD
    original = mappings._gather_along_first_dim
    with _compat.megatron_on_cpu():
        assert mappings._gather_along_first_dim is not original
        tokens = torch.arange(6.0).reshape(3, 2)
        assert torch.equal(mappings._gather_along_first_dim(tokens, group, [3]), tokens)  # one rank: unchanged
        assert torch.equal(mappings._reduce_scatter_along_first_dim(tokens, group, [3]), tokens)
    assert mappings._gather_along_first_dim is original


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
