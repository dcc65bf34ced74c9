"""The Megatron training backend: megatron-core's GPTModel, trained through megatron's own schedule and optimizer.

The world is TP x PP x DP ranks (megatron's parallel_state over gloo on a CPU, NCCL on GPUs); with
--num-layers-per-virtual-pipeline-stage each pipeline rank holds several model chunks (interleaved 1F1B), and an
MoE model's experts are split over --expert-model-parallel-size ranks (megatron's SequentialMLP, tokens gathered
or sent all-to-all). Each data-parallel
rank takes its share of every global batch (train_step.plan_steps over the DP ranks); the TP and PP ranks of one
model replica see the same samples. Forward and backward run in `get_forward_backward_func` (1F1B over the
stages with PP); the last stage computes each micro-batch's loss with train_step's loss code, the torch backend's.
That loss is already normalised by the global batch; megatron's schedule, DDP and finalize_model_grads then scale it
as slime's Megatron backend has them, and the loss is multiplied beforehand by what they divide by (`loss_scale`),
so its gradients are the torch backend's. What that buys: the MoE routers' load-balancing and z losses, which
megatron scales itself, get slime's weight (without --calculate-per-token-loss each micro-batch's at 1 / (micro-batches
x DP ranks); with it, each micro-batch's times its router tokens / the step's loss tokens over all DP ranks).
The logits are gathered over the TP ranks and cut to the true vocabulary, so log-probs and entropies come from
the torch backend's code (`response_log_probs`) on the full distribution. Attention is causal through torch's
fused kernel (families.megatron.sdpa_attention), on right-padded rows as the torch backend's. megatron's optimizer
(`get_megatron_optimizer`: AdamW, no weight decay on norms and biases) steps under its `OptimizerParamScheduler`.

The model's shape is the Megatron args of the torch_dist checkpoint it starts from (--load or --ref-load, as
slime's Megatron backend; the convert stage writes one from the HF checkpoint); every rank reads its own share.
On a CPU every call into megatron runs inside `slimeflow.train.backends.megatron.shims.megatron_on_cpu`; on any machine inside
`megatron_fixes` (megatron-core bugs shimmed: the routers' expert-bias count with a padding mask). An MoE model gets
the padding mask of every micro-batch, so padding counts in no router statistic (expert-bias loads, aux and z losses).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from slimeflow.checkpoint.hf_write import origin_family
from slimeflow.checkpoint.mapping import ModelShape, megatron_to_hf
from slimeflow.checkpoint.torch_dist import read_common, unstack_layers
from slimeflow.config.train import AlgorithmConfig, BatchConfig, MegatronConfig, OptimizerConfig, TrainConfig
from slimeflow.families.megatron import gpt_model_from_args
from slimeflow.io.checkpoints import CheckpointRef, local_root
from slimeflow.offload import module_tensors, optimizer_tensors
from slimeflow.rollout.types import TrainBatch
from slimeflow.train.backends.checkpoint import BackgroundCommit, resolve_start
from slimeflow.train.backends.common import (
    LogProbs,
    RowLayout,
    default_device,
    init_process_group,
    log_prob_steps,
    plan_micro_batches,
    response_log_probs,
    scoring_model,
    sum_over_ranks,
)
from slimeflow.train.backends.megatron import checkpoint as megatron_checkpoint
from slimeflow.train.backends.megatron.core_settings import (
    fuse_host_adam,
    in_precision,
    optimizer_config,
    transformer_fields,
    unwrapped,
)
from slimeflow.train.backends.megatron.determinism import DeterministicMode
from slimeflow.train.backends.megatron.kernels import Kernels, grad_reduce_in_fp32, kernel_problems
from slimeflow.train.backends.megatron.layout import (
    check_moe,
    moe_runtime,
    virtual_pipeline_stages,
)
from slimeflow.train.backends.megatron.shims import megatron_runtime
from slimeflow.train.loss import LossOutput, LossPlugins
from slimeflow.train.packing import pack_micro_batches
from slimeflow.train.rng import seed_everything
from slimeflow.train.schedule import schedule_steps
from slimeflow.train.train_hooks import TrainHooks, check_provided

if TYPE_CHECKING:
    from slimeflow.train.backends.protocol import RankArgs

LossOf = Callable[[list[int], LogProbs], LossOutput]


class MegatronBackend:
    """One rank of the Megatron world: its shard of the policy (and of the frozen reference model when needed).

    checkpoint: the torch_dist checkpoint directory whose Megatron args give the model's shape (the one training
    starts from); its weights are loaded by load_checkpoint. Other arguments as TorchBackend's;
    `parallel` holds the parallel sizes (--tensor-model-parallel-size, --pipeline-model-parallel-size, ...) and the
    MoE runtime flags. `model` is the list of this rank's model chunks (one without a virtual pipeline), each in
    megatron's DDP, as Megatron-LM keeps it. `hooks`: slime's Megatron hooks (train_hooks): the init hook runs once
    the parallel state is set up, a model provider builds every chunk.
    """

    def __init__(self, hf_checkpoint: str | Path, checkpoint: str | Path, optimizer: OptimizerConfig,
                 algorithm: AlgorithmConfig, batch: BatchConfig, parallel: MegatronConfig, seed: int = 1234,
                 rank: int = 0, world_size: int = 1, init_method: str | None = None, total_steps: int | None = None,
                 ref_load: str | None = None, temperature: float = 1.0, hooks: TrainHooks | None = None,
                 plugin_args: Any = None, kernels: Kernels | None = None):
        if temperature <= 0:
            raise ValueError(f"temperature {temperature}: the trainer's log-probs need a sampling temperature > 0")
        self.hf_checkpoint, self.temperature, self.seed = Path(hf_checkpoint), temperature, seed
        self.optimizer_config, self.algorithm, self.batch, self.parallel = optimizer, algorithm, batch, parallel
        self.rank, self.world_size = rank, world_size
        self.background_commit = BackgroundCommit()  # --async-save: rank 0's commit in flight
        self.device = default_device()
        self.kernels = kernels or Kernels.detect()  # the layer spec and fused kernels this machine runs
        problems = kernel_problems(parallel, self.kernels)
        if problems:
            raise ValueError("; ".join(problems))
        # --deterministic-mode: torch's (and on GPUs NCCL's, cuBLAS's, TE's) switches, for this backend's lifetime
        self._deterministic = DeterministicMode.enter(self.kernels.cuda) if parallel.deterministic_mode else None
        try:
            self._start(checkpoint, world_size, init_method, total_steps, ref_load, hooks, plugin_args)
        except BaseException:
            self._restore_switches()
            raise

    @classmethod
    def build(cls, config: TrainConfig, hf_checkpoint: str, args: RankArgs, hooks: TrainHooks | None) -> Self:
        """The rank's shard of the model whose shape the start checkpoint's Megatron args give (--load's latest,
        else --ref-load), as slime's Megatron backend; ValueError when there is neither."""
        start = resolve_start(config.checkpoint.load, config.checkpoint.ref_load)
        if start.ref is None:
            raise ValueError("--train-backend megatron starts from a torch_dist checkpoint: pass --ref-load (the HF "
                             "checkpoint converted with `slimeflow convert`) or --load")
        return cls(hf_checkpoint, local_root(start.ref.uri), parallel=config.megatron, hooks=hooks, **args)

    def _start(self, checkpoint: str | Path, world_size: int, init_method: str | None, total_steps: int | None,
               ref_load: str | None, hooks: TrainHooks | None, plugin_args: Any) -> None:
        """The process group and parallel state, the model chunks, megatron's optimizer and schedule, the frozen
        models and the plug-ins (the constructor's arguments)."""
        parallel, optimizer, algorithm = self.parallel, self.optimizer_config, self.algorithm
        seed, rank = self.seed, self.rank
        # megatron's parallel state lives in process groups, so even one rank has one.
        self._owns_group = init_process_group(rank, world_size, init_method, self.device, single_rank_too=True)
        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        if world_size % (tp * pp):
            raise ValueError(f"{world_size} training ranks are not a multiple of --tensor-model-parallel-size {tp} x "
                             f"--pipeline-model-parallel-size {pp}; use a multiple of {tp * pp} ranks")
        self.args = read_common(checkpoint)["args"]
        self.virtual_stages = virtual_pipeline_stages(self.args.num_layers, parallel)
        check_moe(self.args, parallel, checkpoint)
        ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size or tp
        if world_size % (ep * etp * pp):
            raise ValueError(f"{world_size} training ranks are not a multiple of --expert-model-parallel-size {ep} x "
                             f"expert tensor parallel size {etp} x --pipeline-model-parallel-size {pp}")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=self.virtual_stages, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp)
        self.data_parallel_group = parallel_state.get_data_parallel_group()
        self.dp_rank, self.dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        seed_everything(seed)
        if self.device.type == "cuda":  # on a CPU, megatron_on_cpu seeds the tracker (megatron's reads CUDA states)
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self.vocab_size = _hf_vocab_size(self.hf_checkpoint)
        self.hooks = hooks
        if hooks is not None:
            hooks.with_model_args(self.args)
            if hooks.init is not None:
                hooks.init(hooks.args)
        if self.args.padded_vocab_size % tp:
            raise ValueError(f"{checkpoint}: its padded vocabulary ({self.args.padded_vocab_size}) does not split over "
                             f"--tensor-model-parallel-size {tp}; convert it again with that tensor-parallel size")
        with self.on_device():
            # this rank's model chunks, each in megatron's DDP (and under --bf16 in a Float16Module)
            self.model = self._wrapped(in_precision(self._build(), optimizer.bf16))
            self.optimizer = self._megatron_optimizer()
            self.scheduler = self._param_scheduler(total_steps)
            self.ref_model = self._reference(ref_load) if self.needs_reference else None
            # on-policy distillation's teacher (--opd-type megatron): a frozen model of the policy's architecture
            self.teacher_model = self._reference(algorithm.opd_teacher_load) if algorithm.needs_teacher else None
        self.plugins = LossPlugins.load(algorithm, plugin_args)  # plugin_args: slime's args

    @property
    def needs_reference(self) -> bool:
        """The KL loss or a KL-penalised reward needs the reference model's log-probs."""
        return self.algorithm.needs_reference

    def on_device(self):
        """The context every call into megatron runs in: the CPU shims when there is no GPU (none on a GPU), and the
        fixes of megatron-core bugs on any machine (_compat.megatron_runtime)."""
        return megatron_runtime(self.seed)

    # -- construction -------------------------------------------------------------------------------------------

    def _build(self, trainable: bool = True) -> list[torch.nn.Module]:
        """This rank's model chunks: one per virtual pipeline stage (one without a virtual pipeline)."""
        parallel = {"tensor_model_parallel_size": self.parallel.tensor_model_parallel_size,
                    "pipeline_model_parallel_size": self.parallel.pipeline_model_parallel_size,
                    "virtual_pipeline_model_parallel_size": self.virtual_stages,
                    "expert_model_parallel_size": self.parallel.expert_model_parallel_size,
                    "expert_tensor_parallel_size": (self.parallel.expert_tensor_parallel_size
                                                    or self.parallel.tensor_model_parallel_size),
                    **transformer_fields(self.parallel, self.optimizer_config.bf16, self.kernels),
                    **({"moe_grouped_gemm": self.parallel.moe_grouped_gemm} if self.kernels.te_spec else {}),
                    # gloo's batched p2p silently corrupts the interleaved schedule (megatron-on-cpu.md)
                    "batch_p2p_comm": False, "calculate_per_token_loss": self.algorithm.calculate_per_token_loss,
                    "sequence_parallel": self.sequence_parallel, **self._recompute(),
                    **(moe_runtime(self.parallel) if getattr(self.args, "num_experts", None) else {})}
        chunks = []
        for stage in range(self.virtual_stages or 1):
            vp_stage = stage if self.virtual_stages else None
            ends = {"pre_process": parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    "post_process": parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)}
            if self.hooks is not None and self.hooks.model_provider is not None:
                model = self.hooks.provide(vp_stage=vp_stage, **ends)
                check_provided(model, parallel["tensor_model_parallel_size"], parallel["pipeline_model_parallel_size"],
                               "--custom-model-provider-path", parallel["calculate_per_token_loss"])
            else:
                model = gpt_model_from_args(self.args, parallel=parallel, vp_stage=vp_stage, parallel_output=False,
                                            sdpa=True, te=self.kernels.te_spec, **ends)
            model.to(self.device).eval()  # dropout is 0; eval as the torch backend: log-probs do not depend on mode
            model.requires_grad_(trainable)
            chunks.append(model)
        return chunks

    @property
    def sequence_parallel(self) -> bool:
        """--sequence-parallel takes effect with tensor parallelism only (Megatron-LM turns it off at TP 1: there
        is no sequence to split)."""
        return self.parallel.sequence_parallel and self.parallel.tensor_model_parallel_size > 1

    def _recompute(self) -> dict[str, Any]:
        """TransformerConfig's activation recomputation (--recompute-*; MegatronConfig checked the combination).
        megatron recomputes in training mode only, which the training forward runs in (forward_backward)."""
        m = self.parallel
        return {"recompute_granularity": m.recompute_granularity, "recompute_method": m.recompute_method,
                "recompute_num_layers": m.recompute_num_layers}

    def _reference(self, ref_load: str | None) -> list[torch.nn.Module]:
        if ref_load is None:
            raise ValueError("--use-kl-loss or --kl-coef > 0 with --train-backend megatron needs --ref-load (the "
                             "reference model's torch_dist checkpoint, as in slime)")
        chunks = self._build(trainable=False)
        megatron_checkpoint.load_weights(chunks, ref_load)
        return in_precision(chunks, self.optimizer_config.bf16)

    def _wrapped(self, chunks: list[torch.nn.Module]) -> list[Any]:
        """Each chunk in megatron's DDP (contiguous fp32 gradient buffers, summed over DP ranks when the step
        finalises); the schedule reads its hooks from the first chunk's config, as Megatron-LM sets them."""
        wrapped = [DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32(self.parallel, self.optimizer_config.bf16), overlap_grad_reduce=False, use_distributed_optimizer=self.parallel.use_distributed_optimizer,
            average_in_collective=False), module=model, disable_bucketing=i > 0)  # gloo has no ReduceOp.AVG
            for i, model in enumerate(chunks)]
        config: Any = chunks[0].config  # megatron's TransformerConfig (megatron-core ships no type information)
        no_sync = [ddp.no_sync for ddp in wrapped]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        # megatron's own, as slime's: with --calculate-per-token-loss it divides every gradient by the step's loss
        # tokens over the DP ranks (forward_backward multiplied the loss by that count first: loss_scale)
        config.finalize_model_grads_func = finalize_model_grads
        return wrapped

    def _megatron_optimizer(self):
        optimizer = get_megatron_optimizer(optimizer_config(self.optimizer_config, self.parallel, self.kernels),
                                           self.model)
        fuse_host_adam(optimizer)
        return optimizer

    def _param_scheduler(self, total_steps: int | None):
        """Megatron's schedule of the learning rate (backend.schedule.lr_at) and of weight decay (constant; set
        per parameter group, which is what leaves norms and biases undecayed)."""
        o = self.optimizer_config
        warmup, decay = schedule_steps(o, total_steps)  # the torch backend's schedule (schedule.lr_at), too
        return OptimizerParamScheduler(self.optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
                                       lr_warmup_steps=warmup, lr_decay_steps=decay,
                                       lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay,
                                       end_wd=o.weight_decay, wd_incr_steps=1, wd_incr_style="constant")

    def close(self) -> None:
        """Tear down megatron's parallel state and the process group if this backend created it."""
        parallel_state.destroy_model_parallel()
        if self._owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self._owns_group = False
        self._restore_switches()

    def _restore_switches(self) -> None:
        """Put back the process-wide switches --deterministic-mode turned on (once)."""
        if self._deterministic is not None:
            self._deterministic.exit()
            self._deterministic = None

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The policy's GPTModel chunks (this rank's shards), without the DDP (and Float16Module) wrappers."""
        return [unwrapped(ddp) for ddp in self.model]

    # -- forward and backward -----------------------------------------------------------------------------------

    def micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """This rank's micro-batches of its share (`lengths`: tokens per sample). Under expert parallelism every rank
        runs as many (each micro-batch exchanges tokens with the other expert-parallel ranks): with
        --use-dynamic-batch-size a rank that packs fewer splits its fullest ones until it has the most any rank
        packs, as slime evens out the count (collective then: every rank calls it)."""
        planned = plan_micro_batches(self.batch, lengths)
        if self.parallel.expert_model_parallel_size == 1 or not self.batch.use_dynamic_batch_size:
            return planned
        most = torch.tensor(len(planned))
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        if int(most) == len(planned):
            return planned
        if int(most) > len(lengths):
            raise ValueError(f"--use-dynamic-batch-size with --expert-model-parallel-size "
                             f"{self.parallel.expert_model_parallel_size}: another rank packs {int(most)} micro-batches, "
                             f"this rank has {len(lengths)} samples to split into as many; raise --max-tokens-per-gpu "
                             f"(now {self.batch.max_tokens_per_gpu}) or the samples per step (--global-batch-size)")
        assert self.batch.max_tokens_per_gpu is not None  # BatchConfig validates it with dynamic batch sizes
        return pack_micro_batches(lengths, self.batch.max_tokens_per_gpu, min_micro_batches=int(most))

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, with_entropy: bool = False, reference: bool = False,
                          teacher: bool = False, steps: list[list[list[int]]] | None = None) -> LogProbs:
        """log-probs (fp32, CPU) of every sample's response tokens under the policy (or the reference model, or the
        OPD teacher); every rank of the model replica gets them. `steps`: the micro-batches (indices into `batch`)
        of each training step, run one schedule per step as training runs them (padded to the same shapes), so a
        sample's log-probs are those of its training forward bit for bit; default: this backend's micro-batches of
        the whole batch, one step."""
        model = scoring_model(self, reference, teacher)
        out = LogProbs([None] * len(batch), [None] * len(batch) if with_entropy else None)  # type: ignore[list-item]

        def keep(indices: list[int], part: LogProbs) -> tuple[torch.Tensor, torch.Tensor, Any]:
            values = [(i, lp.float().cpu(), None if part.entropy is None else part.entropy[j].float().cpu())
                      for j, (i, lp) in enumerate(zip(indices, part.log_probs, strict=True))]
            return torch.zeros(()), torch.ones((), dtype=torch.int), values

        pieces = [piece for micro_batches in log_prob_steps(steps, batch, self.micro_batches)
                  for piece in self._schedule(model, batch, micro_batches, keep, with_entropy, forward_only=True)]
        for values in self._from_last_stage(pieces):
            for i, log_probs, entropy in values:
                out.log_probs[i] = log_probs
                if out.entropy is not None:
                    out.entropy[i] = entropy
        return out

    def forward_backward(self, batch: TrainBatch, micro_batches: list[list[int]], loss_of: LossOf) -> dict[str, float]:
        """Forward (with entropies) and backward over `micro_batches` through megatron's schedule; gradients
        accumulate in the DDP buffers, summed over DP ranks. Returns the loss metrics summed over micro-batches
        and ranks (every rank gets them)."""

        scale, tokens = self.loss_scale(batch, micro_batches)

        def loss(indices: list[int], part: LogProbs) -> tuple[torch.Tensor, torch.Tensor, Any]:
            result = loss_of(indices, part)
            return (result.loss * scale, tokens(indices),
                    {k: v.detach().float() for k, v in result.metrics.items()})

        # Training mode, as Megatron-LM's training step: what recomputation (--recompute-*) and the MoE routers'
        # load-balancing loss are gated on. With no dropout (attention and hidden dropout are 0) it changes no other
        # number, so the training forward computes what the log-prob forward (eval) does.
        for chunk in self.model:
            chunk.train()
        try:
            pieces = self._schedule(self.model, batch, micro_batches, loss, with_entropy=True, forward_only=False)
        finally:
            for chunk in self.model:
                chunk.eval()
        return self._metrics(pieces)

    def loss_scale(self, batch: TrainBatch, micro_batches: list[list[int]]
                   ) -> tuple[float, Callable[[list[int]], torch.Tensor]]:
        """What the loss (normalised by the global batch) is multiplied by, and each micro-batch's token count as the
        schedule gets it, so that megatron's scaling, slime's, undoes the multiplication (collective over the DP
        ranks with --calculate-per-token-loss). slime's loss_function: without --calculate-per-token-loss the
        schedule divides each micro-batch's loss by the micro-batch count and DDP averages over the DP ranks (scale:
        micro-batches x DP ranks; count 1); with it finalize_model_grads divides by the step's token count summed
        over micro-batches and DP ranks, each sample's loss-masked tokens and at least 1 (scale: that sum)."""
        if not self.algorithm.calculate_per_token_loss:
            one = torch.ones((), dtype=torch.int)
            return float(len(micro_batches) * self.dp_size), lambda indices: one

        def tokens(indices: list[int]) -> torch.Tensor:
            return torch.tensor(sum(max(int(batch.loss_masks[i].sum()), 1) for i in indices), dtype=torch.int)

        total = tokens([i for micro in micro_batches for i in micro]).to(self.device)
        if self.dp_size > 1:
            torch.distributed.all_reduce(total, group=self.data_parallel_group)
        return float(total), tokens

    def _schedule(self, model: list[torch.nn.Module], batch: TrainBatch, micro_batches: list[list[int]],
                  on_log_probs: Callable[[list[int], LogProbs], tuple[torch.Tensor, torch.Tensor, Any]],
                  with_entropy: bool, forward_only: bool) -> list[Any]:
        """Run `micro_batches` through get_forward_backward_func; on the last stage, `on_log_probs(indices,
        log_probs)` gives each micro-batch's (loss, tokens, data); returns the data (last stage only)."""
        items = [(rows, batch.select(rows), RowLayout.of(batch.select(rows))) for rows in micro_batches]
        # Sequence parallelism splits every sequence evenly over the TP ranks: lengths are padded to a multiple.
        unit = self.parallel.tensor_model_parallel_size if self.sequence_parallel else 1
        rows_max = max(layout.ids.shape[0] for _, _, layout in items)
        length_max = _round_up(max(layout.ids.shape[1] for _, _, layout in items), unit)
        experts_split = self.parallel.expert_model_parallel_size > 1
        if experts_split:
            rows_max, length_max = self._shape_over_ranks(rows_max, length_max, len(items))
        # Pipeline stages exchange activations of one fixed shape, and expert-parallel ranks gather each other's
        # tokens (gloo has no uneven gather): then every micro-batch is padded to one shape.
        pipelined = self.parallel.pipeline_model_parallel_size > 1 or experts_split
        vocab, temperature, device = self.vocab_size, self.temperature, self.device
        routed = bool(getattr(self.args, "num_experts", None))
        tp_rank, tp_size = self._tensor_parallel_rank_and_size()

        def forward_step(data: Iterator[Any], model: torch.nn.Module):
            indices, rows, layout = next(data)
            count, length = layout.ids.shape
            shape = (rows_max, length_max) if pipelined else (count, _round_up(length, unit))
            ids, keep = _padded(layout.ids, shape), _padded(layout.keep, shape)
            positions = torch.arange(shape[1], device=device).expand(shape)
            # Causal attention (sdpa_attention): right padding needs no mask, real positions never see it. The MoE
            # routers do count tokens (expert-bias loads, load-balancing and z losses): they get the padding.
            extra = {}
            if routed:
                padding = ~_padded(layout.mask.bool(), shape)
                extra["padding_mask"] = stage_padding_mask(padding, unwrapped(model).pre_process,
                                                           self.sequence_parallel, tp_rank, tp_size).to(device)
            kept, chunk = keep.to(device), unwrapped(model)
            selecting = kept_positions_only(chunk, self.sequence_parallel)
            with output_layer_on(chunk, kept) if selecting else contextlib.nullcontext():
                output = model(ids.to(device), positions, None, **extra)

            def on_output(output: torch.Tensor):
                selected = output[0, :, :vocab] if selecting else output[..., :vocab][kept]
                return on_log_probs(indices, response_log_probs(selected, rows, layout, temperature, with_entropy))

            return output, on_output

        with self.on_device():
            # Every chunk reads the micro-batches in order (the last one's loss needs their rows).
            data = [iter(items) for _ in model] if len(model) > 1 else iter(items)
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=model,
                num_microbatches=len(items), seq_length=length_max, micro_batch_size=rows_max,
                forward_only=forward_only)

    def _tensor_parallel_rank_and_size(self) -> tuple[int, int]:
        return (parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_world_size())

    def _shape_over_ranks(self, rows: int, length: int, micro_batches: int) -> tuple[int, int]:
        """The largest micro-batch shape over all ranks; ValueError when ranks run different micro-batch counts
        (each expert-parallel rank runs every micro-batch's token exchange with the others)."""
        shapes: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(shapes, (rows, length, micro_batches))
        counts = sorted({count for _, _, count in shapes})
        if len(counts) > 1:
            raise ValueError(f"the data-parallel ranks run {counts} micro-batches this step; with "
                             "--expert-model-parallel-size > 1 every rank must run as many: give every rank as many "
                             "samples per step (--global-batch-size a multiple of the data-parallel size x "
                             "--micro-batch-size)")
        return max(r for r, _, _ in shapes), max(n for _, n, _ in shapes)

    def _metrics(self, pieces: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        metrics = None
        if parallel_state.is_pipeline_last_stage():
            sums: dict[str, torch.Tensor] = {}
            for piece in pieces:
                for key, value in piece.items():
                    sums[key] = sums.get(key, torch.zeros((), device=self.device)) + value.to(self.device)
            metrics = sum_over_ranks(sums, self.dp_size, self.data_parallel_group)
        return self._from_last_stage([metrics])[0]

    def _from_last_stage(self, values: list[Any]) -> list[Any]:
        """`values` as the last pipeline stage has them, on every stage (objects broadcast over the PP group)."""
        if self.parallel.pipeline_model_parallel_size == 1:
            return values
        box = [values]
        torch.distributed.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                                group=parallel_state.get_pipeline_model_parallel_group())
        return box[0]

    # -- the optimizer step -------------------------------------------------------------------------------------

    def optimizer_step(self) -> dict[str, float]:
        """Clip (--clip-grad; 0 disables), step megatron's optimizer and schedule, zero the gradient buffers.

        Returns the step's grad_norm (before clipping, over the whole model) and lr.
        """
        lr = self.optimizer.param_groups[0]["lr"]
        with self.on_device():
            unclipped = self.optimizer.get_grad_norm() if not self.optimizer_config.clip_grad else None
            _, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
        norm = grad_norm if grad_norm is not None else unclipped
        if norm is None:
            raise RuntimeError("megatron's optimizer step returned no gradient norm at --clip-grad "
                               f"{self.optimizer_config.clip_grad}")
        return {"grad_norm": float(norm), "lr": float(lr)}

    # -- checkpoints and weights ----------------------------------------------------------------------------------

    def save_checkpoint(self, root: str | Path, rollout_id: int, extra_state: dict[str, Any],
                        before_commit: Callable[[], None] | None = None, async_save: bool = False) -> CheckpointRef:
        """megatron/checkpoint.py's save_checkpoint of this rank's shards."""
        return megatron_checkpoint.save_checkpoint(self, root, rollout_id, extra_state, before_commit, async_save)

    def wait_for_save(self) -> None:
        """megatron/checkpoint.py's wait_for_save of this rank."""
        megatron_checkpoint.wait_for_save(self)

    def load_checkpoint(self, ref_or_uri: CheckpointRef | str | Path, weights_only: bool = False) -> dict[str, Any]:
        """megatron/checkpoint.py's load_checkpoint into this rank's shards."""
        return megatron_checkpoint.load_checkpoint(self, ref_or_uri, weights_only)

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this rank holds on its device (what --offload-train moves off it): the policy shard's
        weights and buffers, DDP's gradient buffer (through each parameter's main_grad view), megatron's optimizer
        (its parameters and Adam state), the reference model and the OPD teacher (each a list of model chunks)."""
        for chunk in self.model:
            yield from module_tensors(chunk)
        yield from optimizer_tensors(self.optimizer)
        for chunk in [*(self.ref_model or []), *(self.teacher_model or [])]:
            yield from module_tensors(chunk)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The policy's full HF-named weights (vocabulary padding cut) on global rank 0, {} on the others.
        Collective: every rank calls it; each sends its shards (one copy of each, megatron's main replicas)."""
        with self.on_device():
            tensors = gather_global_tensors(self.modules)
        if tensors is None:
            return {}
        hf_config, family = origin_family(self.hf_checkpoint)
        shape = ModelShape.from_megatron_args(self.args, family, hf_config["vocab_size"])
        return megatron_to_hf(unstack_layers(tensors), shape)


def gather_global_tensors(chunks: list[Any]) -> dict[str, torch.Tensor] | None:
    """The model's checkpoint tensors as global tensors under their checkpoint keys (layers stacked, as in a
    torch_dist checkpoint) on global rank 0, None on the others. Built from `model.sharded_state_dict()`, the
    declaration megatron saves from, so the TP split (fused QKV and gate/up included) and the PP layer offsets are
    undone exactly as dist_checkpointing would (over all of the rank's model chunks: virtual pipeline stages)."""
    declared = [chunk.sharded_state_dict() for chunk in chunks]
    apply_factories(declared)
    mine = [(t.key, tuple(t.global_shape), t.global_slice(), t.data.detach().cpu())
            for t in sharded_leaves(declared)
            if isinstance(t, ShardedTensor) and not any(t.replica_id if isinstance(t.replica_id, tuple)
                                                        else (t.replica_id,))]
    world = torch.distributed.get_world_size()
    gathered: list[Any] = [None] * world if torch.distributed.get_rank() == 0 else None  # type: ignore[assignment]
    torch.distributed.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for pieces in gathered:
        for key, shape, where, data in pieces:
            full = out.setdefault(key, torch.empty(shape, dtype=data.dtype))
            full[where] = data
    return out


def sharded_leaves(tree: Any) -> Iterator[Any]:
    """The leaves of a (sharded) state dict: what its nested dicts and lists hold."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from sharded_leaves(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from sharded_leaves(value)
    else:
        yield tree


def stage_padding_mask(padding: torch.Tensor, first_stage: bool, sequence_parallel: bool, tp_rank: int,
                       tp_size: int) -> torch.Tensor:
    """The padding mask [rows, length] (True at padding) as a model chunk's MoE layers must get it: GPTModel splits it
    over the sequence-parallel ranks with the embeddings, on the first pipeline stage only; a later stage's input
    arrives split already (this rank's share of the positions), so its mask is cut here the same way."""
    if first_stage or not sequence_parallel or tp_size == 1:
        return padding
    share = padding.shape[1] // tp_size
    return padding[:, tp_rank * share: (tp_rank + 1) * share].contiguous()


def kept_positions_only(chunk: Any, sequence_parallel: bool) -> bool:
    """Whether `chunk` (a GPTModel) can run its output layer on the kept positions alone: it is a last stage, its
    output layer's input is not split along the sequence over the TP ranks (sequence parallelism), and no MTP block
    reads every position's hidden state."""
    return (bool(getattr(chunk, "post_process", False)) and not sequence_parallel
            and not getattr(chunk, "mtp_process", False))


@contextlib.contextmanager
def output_layer_on(chunk: Any, keep: torch.Tensor) -> Iterator[None]:
    """While open, `chunk`'s output layer gets only the hidden states at `keep` ([rows, length] bool, the positions
    that predict a response token), row by row as [kept, 1, hidden], so the model returns logits [1, kept, vocab].

    Why: the log-probs need those positions only, and the output layer over every position was a fifth of the step
    and of the log-prob passes (SmolLM2-135M, 49k vocabulary, 32 replies of <= 12 tokens to ~36-token prompts:
    benchmarks/real_step.py). GPTModel has no argument for it (its inference path keeps only the last token), so a
    forward pre-hook selects them; megatron's postprocess then runs unchanged on the smaller input."""
    def select(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0]  # [length, rows, hidden]
        return (hidden.transpose(0, 1)[keep].unsqueeze(1), *args[1:]), kwargs

    handle = chunk.output_layer.register_forward_pre_hook(select, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _padded(tensor: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """`tensor` [rows, length] zero-padded (False for booleans) at the bottom and right to `shape`."""
    if tuple(tensor.shape) == shape:
        return tensor
    out = tensor.new_zeros(shape)
    out[: tensor.shape[0], : tensor.shape[1]] = tensor
    return out


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _hf_vocab_size(hf_checkpoint: Path) -> int:
    return int(json.loads((hf_checkpoint / "config.json").read_text(encoding="utf-8"))["vocab_size"])


