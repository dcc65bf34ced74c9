"""megatron-core on a CPU-only machine: the few CUDA-only calls it makes, redirected to the CPU, in one place.

megatron-core 0.16 assumes a GPU in a handful of spots that matter to us (saving a torch_dist checkpoint,
running a GPTModel forward). Nothing is patched at import time: `megatron_on_cpu()` applies every shim for the
duration of a `with` block and restores the originals afterwards, and only when CUDA is unavailable (on a GPU
machine it changes nothing). Each shim says why it exists; tests/unit/test_compat.py shows, for each, that the
unshimmed call still fails here, so a shim whose reason has gone away is noticed and deleted.

`megatron_fixes()` applies, on any machine, the shims of megatron-core bugs that are not about the CPU (EVERYWHERE;
tests/unit/test_moe_padding.py shows, as test_compat.py for SHIMS, that the unshimmed call still fails);
`megatron_runtime()` applies both.

One more shim makes a synchronous checkpoint write cheaper on any machine (`in_process_write_results`; its test
is in tests/unit/test_compat.py too).

The Megatron training backend and the model-family helpers use this module; nothing else may shim megatron-core.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.strategies import filesystem_async

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The RNG tracker state that megatron-core's attention forks (megatron.core.tensor_parallel.random)."""


@dataclass(frozen=True)
class Shim:
    """Replace `owner.attribute` by `replacement` while shimmed; `why` is the reason it is needed."""

    owner: Callable[[], Any]
    """Returns the module or class holding the attribute (imported lazily: megatron is heavy)."""
    attribute: str
    replacement: Any
    why: str
    wraps: bool = False
    """`replacement` is called with the original (as the owner holds it) and returns the stand-in."""

    def stand_in(self, original: Any) -> Any:
        return self.replacement(original) if self.wraps else self.replacement


_ABSENT = object()
"""What a shimmed attribute was when its module never defined it (it is deleted again on exit)."""


def _module(name: str) -> Callable[[], Any]:
    """An owner for Shim: the module `name`, imported when first asked for."""
    return functools.partial(importlib.import_module, name)


def _class(module: str, name: str) -> Callable[[], Any]:
    """An owner for Shim: the class `name` of the module `module`, imported when first asked for."""
    return lambda: getattr(importlib.import_module(module), name)


class CudaFactoriesOnCpu:
    """Stands in for the name `torch` inside one megatron module: its tensor factories asked for a CUDA device
    (`torch.zeros(..., device="cuda")`) make CPU tensors; every other attribute is torch's own."""

    FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full"})

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        return _factory_on_cpu(value) if name in self.FACTORIES else value


def _factory_on_cpu(factory: Callable[..., Any]) -> Callable[..., Any]:
    def make(*args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


def _clip_grads_by_total_norm_on_cpu(parameters: Any, max_norm: float, total_norm: float,
                                     use_decoupled_grad: bool = False) -> None:
    """megatron's clip_grad_by_total_norm_fp32 without its `grad.type() == 'torch.cuda.FloatTensor'` assert:
    every gradient is scaled in place by max_norm / (total_norm + 1e-6) when that is below 1, as megatron does."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(coeff)


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _run_with_cuda_type_names(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` run while a CPU tensor's `type()` names the CUDA type of its dtype."""
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        own_type = torch.Tensor.type

        def type_(tensor: Any, *type_args: Any, **type_kwargs: Any) -> Any:
            name = own_type(tensor, *type_args, **type_kwargs)
            return _CUDA_TYPE_NAMES.get(name, name) if not type_args and not type_kwargs else name

        torch.Tensor.type = type_  # type: ignore[method-assign, assignment]  # the shim itself, for this call only
        try:
            return function(*args, **kwargs)
        finally:
            torch.Tensor.type = own_type  # type: ignore[method-assign]

    return run


def _type_names_as_cuda(method: Any) -> Any:
    """`method` (a classmethod or a plain method) run while a CPU tensor's `type()` names the CUDA type of its
    dtype."""
    if isinstance(method, classmethod):
        return classmethod(_run_with_cuda_type_names(method.__func__))
    return _run_with_cuda_type_names(method)


def _with_adam_state(method: Callable[..., Any]) -> Callable[..., Any]:
    """DistributedOptimizer.state_dict, first giving a fresh optimizer the per-parameter Adam state a step would
    (zeros, step 0; what a load then overwrites)."""
    def state_dict(self: Any) -> Any:
        if not self.optimizer.state:
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
        return method(self)

    return state_dict


def _own_step(method: Callable[..., Any]) -> Callable[..., Any]:
    """DistributedOptimizer._set_main_param_and_optimizer_states, giving the parameter a step count of its own
    (load_state_dict set one tensor as every parameter's) and passing it along when the loaded tensors lack it."""

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> Any:
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state:
            state["step"] = state["step"].clone()
            tensors = {"step": state["step"], **tensors}
        return method(self, model_param, tensors)

    return set_states


class _HostStream:
    """What megatron's all-to-all token dispatcher asks of a CUDA stream and its events, on the host, where work
    runs in program order: waiting, recording and synchronising have nothing to do."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        return None


_HOST_STREAM = _HostStream()


class _CudaStreamsOnHost:
    """`torch.cuda` with its streams on the host (_HostStream); every other attribute is torch.cuda's own."""

    def Stream(self, *args: Any, **kwargs: Any) -> _HostStream:  # noqa: N802 (torch.cuda's name)
        return _HOST_STREAM

    def current_stream(self, *args: Any, **kwargs: Any) -> _HostStream:
        return _HOST_STREAM

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class TorchWithHostStreams:
    """Stands in for the name `torch` inside megatron's token dispatcher: `torch.cuda`'s streams on the host."""

    cuda = _CudaStreamsOnHost()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _split_sizes_on_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """moe_utils.maybe_move_tensor_to_cpu for tensors already on the host: as numpy when asked (split sizes)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _uneven_gather_padded(original: Callable[..., Any]) -> Callable[..., Any]:
    """mappings._gather_along_first_dim with uneven `output_split_sizes` on gloo: every rank's rows padded to the
    largest share, gathered evenly, the padding cut (even gathers are megatron's own)."""
    def gather(input_: Any, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:rows] for piece, rows in zip(pieces, output_split_sizes, strict=True)])

    return gather


def _uneven_reduce_scatter_by_all_reduce(original: Callable[..., Any]) -> Callable[..., Any]:
    """mappings._reduce_scatter_along_first_dim with uneven `input_split_sizes` on gloo: the whole tensor summed
    over the group, each rank keeping its own rows (even reduce-scatters are megatron's own)."""
    def reduce_scatter(input_: Any, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start: start + input_split_sizes[group.rank()]].clone()

    return reduce_scatter


def _no_sync() -> None:
    return None


def _cpu_device() -> str:
    return "cpu"


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: Any, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


SHIMS: tuple[Shim, ...] = (
    Shim(_module("torch.cuda"), "synchronize", _no_sync,
         why="dist_checkpointing.save's FileSystemWriterAsync.preload_tensors calls torch.cuda.synchronize() "
             "after its (no-op on CPU) device-to-host copies; on a CPU-only torch that raises."),
    Shim(_module("torch.cuda"), "current_device", _cpu_device,
         why="RotaryEmbedding.forward moves inv_freq to torch.cuda.current_device(); on a CPU-only torch that "
             "raises. 'cpu' is a valid device argument at every call site."),
    Shim(_module("megatron.core.tensor_parallel.random"), "_get_cuda_rng_state", _get_cpu_rng_state,
         why="CudaRNGStatesTracker.fork (entered by attention around its dropout) saves the CUDA generator's "
             "state; with no CUDA generator the CPU generator stands in."),
    Shim(_module("megatron.core.tensor_parallel.random"), "_set_cuda_rng_state", _set_cpu_rng_state,
         why="CudaRNGStatesTracker.fork restores the CUDA generator's state on exit; see _get_cuda_rng_state."),
    Shim(_module("megatron.core.optimizer.optimizer"), "torch", CudaFactoriesOnCpu(),
         why="megatron.core.optimizer.optimizer's FP32Optimizer makes its loss scale with torch.tensor(..., "
             "device='cuda'); on a CPU-only torch that raises."),
    Shim(_module("megatron.core.optimizer.optimizer"), "clip_grad_by_total_norm_fp32", _clip_grads_by_total_norm_on_cpu,
         why="megatron's clip_grad_by_total_norm_fp32 asserts every gradient's type() is 'torch.cuda.FloatTensor' "
             "(a CPU gradient is 'torch.FloatTensor'); the stand-in scales them as it does."),
    Shim(_class("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
         "_build_model_and_main_param_groups", _type_names_as_cuda, wraps=True,
         why="DistributedOptimizer sorts the parameters it shards by `param.type()`, accepting only the names "
             "'torch.cuda.FloatTensor', 'torch.cuda.HalfTensor' and 'torch.cuda.BFloat16Tensor' (a CPU parameter's "
             "is 'torch.FloatTensor': TypeError); while it builds them, a CPU tensor's type() names the CUDA type."),
    Shim(_class("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"), "__init__",
         _type_names_as_cuda, wraps=True,
         why="--bf16 without the distributed optimizer: Float16OptimizerWithFloat16Params sorts the parameters into "
             "bf16 ones (given fp32 main copies) and fp32 ones by `param.type()`, accepting only the CUDA names (a "
             "CPU bf16 parameter's is 'torch.BFloat16Tensor': TypeError); while it does, type() names the CUDA "
             "type."),
    Shim(_class("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"), "state_dict", _with_adam_state,
         wraps=True,
         why="without Apex or Transformer Engine (torch's Adam), DistributedOptimizer.state_dict asserts that every "
             "parameter's Adam state holds one step count, which only a step creates: the loading state dict of a "
             "fresh optimizer (a resume) fails. The stand-in first allocates the state as a step would, at step 0."),
    Shim(_class("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
         "_set_main_param_and_optimizer_states", _own_step, wraps=True,
         why="without Apex or Transformer Engine, DistributedOptimizer.load_state_dict sets one step tensor as every "
             "parameter's Adam step (torch's Adam then adds 1 to it once per parameter per step: a wrong bias "
             "correction after a resume), and loading the fully_reshardable state copies every entry of the Adam "
             "state from loaded tensors that lack the step: KeyError 'step'. The stand-in gives each parameter a "
             "copy of the step and passes it along."),
    Shim(_module("megatron.core.optimizer.clip_grads"), "torch", CudaFactoriesOnCpu(),
         why="get_grad_norm_fp32 puts the norm in torch.tensor(..., device='cuda') to all-reduce it; on a "
             "CPU-only torch that raises."),
    Shim(_module("megatron.core.utils"), "torch", CudaFactoriesOnCpu(),
         why="megatron.core.utils' local_multi_tensor_l2_norm (the gradient norm without Apex or Transformer "
             "Engine) returns it as torch.tensor(..., device='cuda'); on a CPU-only torch that raises."),
    Shim(_module("megatron.core.pipeline_parallel.schedules"), "torch", CudaFactoriesOnCpu(),
         why="the forward-backward schedules count tokens in torch.zeros([], device='cuda'); on a CPU-only torch "
             "that raises."),
    Shim(_module("megatron.core.transformer.moe.moe_utils"), "te_general_gemm", None,
         why="megatron-core 0.16.1's MoE router (RouterGatingLinearFunction) tests `te_general_gemm is not None`, a "
             "name only imported with Transformer Engine: without it, NameError. None selects its torch.mm path."),
    Shim(_module("megatron.core.transformer.moe.token_dispatcher"), "torch", TorchWithHostStreams(),
         why="the all-to-all token dispatcher (--moe-token-dispatcher-type alltoall) creates a torch.cuda.Stream "
             "for its device-to-host copies of the split sizes and waits on it; on a CPU-only torch that raises."),
    Shim(_module("megatron.core.transformer.moe.token_dispatcher"), "maybe_move_tensor_to_cpu", _split_sizes_on_host,
         why="the all-to-all dispatcher moves its split sizes to the host as numpy only from a CUDA tensor; on the "
             "host they stay tensors, which gloo's all_to_all_single rejects as split sizes."),
    Shim(_module("megatron.core.tensor_parallel.mappings"), "_gather_along_first_dim", _uneven_gather_padded,
         wraps=True,
         why="with expert and tensor parallelism the all-to-all dispatcher gathers each expert-tensor-parallel rank's "
             "tokens, uneven counts, through all_gather into pieces of their sizes; gloo's all_gather takes only "
             "pieces of the input's size (RuntimeError 'invalid tensor size'). Padded to one size, gathered, cut."),
    Shim(_module("megatron.core.tensor_parallel.mappings"), "_reduce_scatter_along_first_dim",
         _uneven_reduce_scatter_by_all_reduce, wraps=True,
         why="the all-to-all dispatcher's combine (and the gather's backward) reduce-scatters those uneven token "
             "counts; gloo's reduce_scatter checks every piece against the output's size (a fatal check). Summed "
             "whole with all_reduce, each rank keeping its rows."),
    Shim(_module("megatron.core.transformer.multi_latent_attention"), "HAVE_TE", False,
         why="megatron-core 0.16.1's MLA imports Transformer Engine's names through a module that stands in "
             "placeholders when TE is absent, so it believes TE is there and `isinstance(linear_proj, TELinear)` "
             "raises TypeError while building MLASelfAttention. False skips its TE-only fp8 branch."),
)


def _expert_bias_over_real_tokens(self: Any, routing_map: Any, padding_mask: Any = None) -> None:
    """TopKRouter._apply_expert_bias with the padding mask ([tokens], True at padding) broadcast over the experts:
    the expert-bias update counts each expert's real tokens only (megatron's own, as it means to)."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.unsqueeze(-1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


EVERYWHERE: tuple[Shim, ...] = (
    Shim(_class("megatron.core.transformer.moe.router", "TopKRouter"), "_apply_expert_bias",
         _expert_bias_over_real_tokens,
         why="megatron-core 0.16.1's TopKRouter._apply_expert_bias excludes padding from the tokens per expert as "
             "`routing_map & ~padding_mask`, a [tokens, experts] map and a [tokens] mask: a broadcast error (or, "
             "with as many tokens as experts, a wrong count), on any device. The stand-in masks the tokens' rows."),
)
"""Shims of megatron-core bugs that are not about the CPU: applied on every machine (`megatron_fixes`)."""


def _apply(shims: tuple[Shim, ...]) -> Callable[[], None]:
    """Put every shim of `shims` in place; returns what restores the originals."""
    # As the owner holds it (vars: a class's classmethod itself, not a method bound to the class).
    saved = [(shim, vars(shim.owner()).get(shim.attribute, _ABSENT)) for shim in shims]

    def restore() -> None:
        for shim, original in saved:
            if original is not _ABSENT:
                setattr(shim.owner(), shim.attribute, original)
            elif shim.attribute in vars(shim.owner()):
                delattr(shim.owner(), shim.attribute)

    try:
        for shim, original in saved:
            setattr(shim.owner(), shim.attribute, shim.stand_in(original))
    except BaseException:
        restore()
        raise
    return restore


@contextlib.contextmanager
def megatron_fixes() -> Iterator[None]:
    """Apply EVERYWHERE (on a GPU machine too) for the duration of the block; restored on exit."""
    restore = _apply(EVERYWHERE)
    try:
        yield
    finally:
        restore()


@contextlib.contextmanager
def megatron_runtime(seed: int = 1234) -> Iterator[None]:
    """What a training process runs megatron-core's model in: `megatron_fixes` and `megatron_on_cpu(seed)`."""
    with megatron_fixes(), megatron_on_cpu(seed):
        yield


def cuda_available() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def megatron_on_cpu(seed: int = 1234) -> Iterator[None]:
    """Apply SHIMS (when CUDA is unavailable) and seed the RNG tracker's model-parallel state on the CPU.

    megatron-core's own seeding (`model_parallel_cuda_manual_seed`) reads CUDA generator states, so the
    tracker's state is set through its public `set_states` instead. Everything is restored on exit.
    """
    if cuda_available():
        yield
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved_states = tracker.get_states()
    restore = _apply(SHIMS)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            tracker.set_states({MODEL_PARALLEL_RNG: torch.get_rng_state()})
        yield
    finally:
        restore()
        tracker.set_states(saved_states)


@contextlib.contextmanager
def in_process_write_results() -> Iterator[None]:
    """Collect a synchronous dist_checkpointing save's write results on an in-process queue.

    megatron-core hands its writers' results back through a `multiprocessing.Manager().Queue()`, whose server
    is a spawned process; unpickling the results makes that process import torch and torch.distributed
    (3-6 s of CPU on two cores, measured), and the saving rank waits for it. That queue exists for
    asynchronous saves, whose results cross processes. A synchronous save (`dist_checkpointing.save` without
    an async strategy, the only kind slimeflow makes) puts and gets them in the saving process, so a plain
    queue carries them. Restored on exit.
    """
    saved = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = saved
