"""The torch training backend: a transformers causal LM trained with AdamW, on a CPU or one GPU, data parallel.

Every data-parallel rank (a Ray actor in production, a process in tests) holds a full replica. The loss of
slimeflow.train.loss is normalised by the global batch, so after backward each rank's gradients are summed
(all-reduce SUM) and every replica takes the same step. Dropout is off (the model stays in eval mode), as in
slime's RL runs, so the trainer's log-probs of a batch do not depend on the mode they were computed in.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from transformers import PreTrainedModel

from slimeflow.config.train import AlgorithmConfig, BatchConfig, OptimizerConfig, TrainConfig
from slimeflow.families.checkpoint_names import CheckpointLayout, IncompleteTensorError, to_checkpoint
from slimeflow.families.hf import load_causal_lm
from slimeflow.io.checkpoints import CheckpointRef
from slimeflow.offload import module_tensors, optimizer_tensors
from slimeflow.rollout.types import TrainBatch
from slimeflow.train.backends.checkpoint import BackgroundCommit
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
from slimeflow.train.backends.torch import checkpoint as torch_checkpoint
from slimeflow.train.loss import LossOutput, LossPlugins
from slimeflow.train.rng import seed_everything
from slimeflow.train.schedule import build_scheduler

if TYPE_CHECKING:
    from slimeflow.train.backends.protocol import RankArgs
    from slimeflow.train.train_hooks import TrainHooks


def load_model(hf_checkpoint: str | Path, device: torch.device, trainable: bool = True) -> PreTrainedModel:
    """The HF directory's causal LM in fp32 (the master weights; bf16 runs compute under autocast), eval mode."""
    model = load_causal_lm(str(hf_checkpoint), dtype=torch.float32, local_files_only=True)
    model.to(device).eval()
    model.requires_grad_(trainable)
    return model


def assign_weights(model: PreTrainedModel, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy HF-named `weights` into `model`; ValueError (naming `source`) when a parameter is missing or a name
    is unknown. A tied output layer needs no entry of its own."""
    try:  # checkpoints name each expert; transformers holds them fused
        weights = CheckpointLayout(model).to_model(weights)
    except IncompleteTensorError as err:
        raise ValueError(f"weights from {source} do not fit the model: {err}") from None
    required = {name for name, _ in model.named_parameters()}  # tied parameters appear once
    known = set(model.state_dict())
    missing, unknown = sorted(required - set(weights)), sorted(set(weights) - known)
    if missing or unknown:
        raise ValueError(f"weights from {source} do not fit the model: missing {missing[:5]}, unknown {unknown[:5]}; "
                         "was the checkpoint saved from this --hf-checkpoint's architecture?")
    model.load_state_dict(weights, strict=False)


class TorchBackend:
    """One data-parallel rank's replica of the policy (and of the frozen reference model when the algorithm needs it).

    hf_checkpoint: HF directory (architecture, config and initial weights). ref_load: torch_dist checkpoint (root
    or directory) of the reference model; default: the HF weights. total_steps: the run's optimizer steps, needed
    by a decaying learning rate without --lr-decay-iters. rank/world_size/init_method: torch.distributed
    rendezvous (gloo on CPU, NCCL on GPU); world size 1 needs none. temperature: --rollout-temperature; the
    logits are divided by it before every log-softmax, as slime does, so the trainer's log-probs (old, reference,
    current) and entropies are those of the distribution the rollouts were sampled from. Custom loss/advantage
    plug-ins are loaded here, so a wrong path fails at construction.
    """

    def __init__(self, hf_checkpoint: str | Path, optimizer: OptimizerConfig, algorithm: AlgorithmConfig,
                 batch: BatchConfig, seed: int = 1234, rank: int = 0, world_size: int = 1,
                 init_method: str | None = None, total_steps: int | None = None, ref_load: str | None = None,
                 device: torch.device | str | None = None, temperature: float = 1.0, plugin_args: Any = None):
        if temperature <= 0:
            raise ValueError(f"temperature {temperature}: the trainer's log-probs need a sampling temperature > 0")
        self.hf_checkpoint = Path(hf_checkpoint)
        self.temperature = temperature
        self.optimizer_config, self.algorithm, self.batch = optimizer, algorithm, batch
        self.rank, self.world_size = rank, world_size
        self.data_parallel_group = None  # every rank is a data-parallel rank: the default process group
        self.dp_rank, self.dp_size = rank, world_size
        self.device = torch.device(device) if device is not None else default_device()
        self._owns_group = init_process_group(rank, world_size, init_method, self.device)
        seed_everything(seed)
        self.model = load_model(self.hf_checkpoint, self.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optimizer.lr, betas=(optimizer.adam_beta1, optimizer.adam_beta2),
            eps=optimizer.adam_eps, weight_decay=optimizer.weight_decay,
            fused=True)  # one kernel for all parameters: 0.7 ms a step against 1.5 ms with foreach (demo model, CPU)
        self.scheduler = build_scheduler(self.optimizer, optimizer, total_steps)
        self.ref_model = self._load_reference(ref_load) if self.needs_reference else None
        # on-policy distillation's teacher (--opd-type megatron): the policy's architecture, the teacher's weights
        self.teacher_model = self._load_reference(algorithm.opd_teacher_load) if algorithm.needs_teacher else None
        self.plugins = LossPlugins.load(algorithm, plugin_args)  # plugin_args: slime's args
        self.background_commit = BackgroundCommit()  # --async-save: the commit in flight
        self.save_snapshot = torch_checkpoint.Snapshot()  # --async-save: the copy it writes

    @classmethod
    def build(cls, config: TrainConfig, hf_checkpoint: str, args: RankArgs, hooks: TrainHooks | None) -> Self:
        """The rank's replica of the HF checkpoint's model. slime's hooks reach the torch backend only through
        train_step (its hooks into Megatron's actor are refused for this backend at parse)."""
        return cls(hf_checkpoint=hf_checkpoint, **args)

    @property
    def needs_reference(self) -> bool:
        """The KL loss or a KL-penalised reward needs the reference model's log-probs."""
        return self.algorithm.needs_reference

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.optimizer_config.bf16 else None

    def _load_reference(self, ref_load: str | None) -> torch.nn.Module:
        model = load_model(self.hf_checkpoint, self.device, trainable=False)
        if ref_load is not None:
            assign_weights(model, torch_checkpoint.read_weights(ref_load, self.hf_checkpoint), f"--ref-load {ref_load}")
        return model

    def close(self) -> None:
        """Destroy the process group if this backend created it."""
        if self._owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self._owns_group = False

    # -- forward ------------------------------------------------------------------------------------------------

    def micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Micro-batches (sample indices) of one rank's share: packed under --max-tokens-per-gpu with
        --use-dynamic-batch-size, else consecutive --micro-batch-size samples."""
        return plan_micro_batches(self.batch, lengths)

    def forward(self, rows: TrainBatch, with_entropy: bool = False, reference: bool = False,
                teacher: bool = False) -> LogProbs:
        """Response-token log-probs (and entropies) of every row, on this device, with autograd as the caller's
        grad mode sets it. One micro-batch: its distinct rows (`distinct_rows`) right-padded to the longest."""
        model = scoring_model(self, reference, teacher)
        layout = RowLayout.of(rows)
        cast = self.autocast_dtype
        with torch.autocast(self.device.type, dtype=cast) if cast is not None else contextlib.nullcontext():
            # The output layer runs on the kept positions only, flattened row by row into one [tokens, vocab]
            # block, so one log-softmax serves the micro-batch. The decoder and the output layer are called apart
            # (what transformers >= 5.2x does for a boolean `logits_to_keep`; 5.17 rejects such a mask).
            hidden = model.base_model(input_ids=layout.ids.to(self.device), attention_mask=layout.mask.to(self.device),
                                      use_cache=False).last_hidden_state
            selected = model.get_output_embeddings()(hidden[layout.keep.to(self.device)])
        return response_log_probs(selected, rows, layout, self.temperature, with_entropy)

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, with_entropy: bool = False, reference: bool = False,
                          teacher: bool = False, steps: list[list[list[int]]] | None = None) -> LogProbs:
        """log-probs (fp32, CPU) of every sample's response tokens under the policy (or the reference model, or the
        OPD teacher). `steps`: the micro-batches (indices into `batch`) of each training step, which a sample's
        log-probs then come from bit for bit as in its training forward; default: this backend's micro-batches of
        the whole batch, one step."""
        out = LogProbs([None] * len(batch), [None] * len(batch) if with_entropy else None)  # type: ignore[list-item]
        for micro in itertools.chain.from_iterable(log_prob_steps(steps, batch, self.micro_batches)):
            rows = batch.select(micro)
            part = self.forward(rows, with_entropy, reference, teacher)
            for values, into in ((part.log_probs, out.log_probs), (part.entropy, out.entropy)):
                if values is not None and into is not None:  # one copy to the CPU per micro-batch, then views
                    flat = torch.cat(values).float().cpu()
                    for i, value in zip(micro, torch.split(flat, rows.response_lengths), strict=True):
                        into[i] = value
        return out

    def forward_backward(self, batch: TrainBatch, micro_batches: list[list[int]],
                         loss_of: Callable[[list[int], LogProbs], LossOutput]) -> dict[str, float]:
        """Forward (with entropies) and backward over `micro_batches` (indices into `batch`), each micro-batch's
        loss from `loss_of(indices, log_probs)`; returns the loss metrics summed over micro-batches and ranks."""
        sums: dict[str, torch.Tensor] = {}
        for rows in micro_batches:
            result = loss_of(rows, self.forward(batch.select(rows), with_entropy=True))
            result.loss.backward()
            for key, value in result.metrics.items():
                sums[key] = sums.get(key, torch.zeros((), device=self.device)) + value.float().to(self.device)
        return sum_over_ranks(sums, self.world_size)

    # -- the optimizer step -------------------------------------------------------------------------------------

    def all_reduce_gradients(self) -> None:
        """Sum every gradient over the data-parallel ranks (one flat buffer); a no-op with one rank."""
        if self.world_size == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            g.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def optimizer_step(self) -> dict[str, float]:
        """All-reduce, clip (--clip-grad; 0 disables), step AdamW and the schedule, zero the gradients.

        Returns the step's grad_norm (before clipping) and lr.
        """
        self.all_reduce_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        max_norm = self.optimizer_config.clip_grad or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "lr": float(lr)}

    # -- weights and state --------------------------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights (tied ones once) as an HF checkpoint names them (each MoE expert on its own, as the Megatron
        backend's), detached, on the CPU. On a CPU backend those that keep their in-memory name share memory with
        the parameters (no copy; experts split off a fused parameter are copies): consume them before the next
        optimizer step."""
        return to_checkpoint(self.model, self._parameters())

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """named_weights plus the saved buffers (DeepSeek's and GLM4-MoE's expert-score correction bias)."""
        parameters = self._parameters()
        buffers = {name: b.detach().cpu() for name, b in self.model.state_dict().items()
                   if name not in parameters and not name.endswith("lm_head.weight")}
        return to_checkpoint(self.model, {**parameters, **buffers})

    def _parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu() for name, p in self.model.named_parameters()}

    def load_weights(self, weights: dict[str, torch.Tensor], source: str) -> None:
        """Replace the policy's weights by HF-named `weights` (from `source`, named in errors)."""
        assign_weights(self.model, weights, source)

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this rank holds on its device (what --offload-train moves off it): the policy's weights,
        gradients and buffers, the optimizer's state, the reference model and the OPD teacher."""
        yield from module_tensors(self.model)
        yield from optimizer_tensors(self.optimizer)
        yield from module_tensors(self.ref_model)
        yield from module_tensors(self.teacher_model)

    def training_state(self) -> dict[str, Any]:
        """Optimizer and scheduler state (torch-saveable), identical on every data-parallel rank."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_training_state(self, state: dict[str, Any]) -> None:
        """The inverse of training_state (after the weights are loaded)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def save_checkpoint(self, root: str | Path, rollout_id: int, extra_state: dict[str, Any],
                        before_commit: Callable[[], None] | None = None, async_save: bool = False) -> CheckpointRef:
        """torch/checkpoint.py's save_checkpoint of this backend."""
        return torch_checkpoint.save_checkpoint(self, root, rollout_id, extra_state, before_commit, async_save)

    def wait_for_save(self) -> None:
        """torch/checkpoint.py's wait_for_save of this rank."""
        torch_checkpoint.wait_for_save(self)

    def load_checkpoint(self, ref_or_uri: CheckpointRef | str | Path, weights_only: bool = False) -> dict[str, Any]:
        """torch/checkpoint.py's load_checkpoint into this backend."""
        return torch_checkpoint.load_checkpoint(self, ref_or_uri, weights_only)
