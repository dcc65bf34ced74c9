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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimeflow.config.train import AlgorithmConfig, BatchConfig, OptimizerConfig
from slimeflow.families.experts import fuse_experts, split_experts
from slimeflow.offload import module_tensors, optimizer_tensors
from slimeflow.rollout.types import TrainBatch
from slimeflow.train import algorithms as alg
from slimeflow.train.loss import LossOutput, LossPlugins
from slimeflow.train.packing import pack_micro_batches
from slimeflow.train.rng import seed_everything
from slimeflow.train.schedule import build_scheduler


@dataclass
class LogProbs:
    """Per-sample log-probs of the response tokens (and their entropies when asked), one 1-D tensor per sample."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None = None


def default_device() -> torch.device:
    """The current GPU when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_model(hf_checkpoint: str | Path, device: torch.device, trainable: bool = True) -> torch.nn.Module:
    """The HF directory's causal LM in fp32 (the master weights; bf16 runs compute under autocast), eval mode."""
    from slimeflow.families.hf import load_causal_lm

    model = load_causal_lm(str(hf_checkpoint), dtype=torch.float32, local_files_only=True)
    model.to(device).eval()
    model.requires_grad_(trainable)
    return model


def assign_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy HF-named `weights` into `model`; ValueError (naming `source`) when a parameter is missing or a name
    is unknown. A tied output layer needs no entry of its own."""
    weights = fuse_experts(weights)  # checkpoints name each expert; transformers holds them fused
    required = {name for name, _ in model.named_parameters()}  # tied parameters appear once
    known = set(model.state_dict())
    missing, unknown = sorted(required - set(weights)), sorted(set(weights) - known)
    if missing or unknown:
        raise ValueError(f"weights from {source} do not fit the model: missing {missing[:5]}, unknown {unknown[:5]}; "
                         "was the checkpoint saved from this --hf-checkpoint's architecture?")
    model.load_state_dict(weights, strict=False)


def scoring_model(backend: Any, reference: bool, teacher: bool) -> Any:
    """The model a log-prob pass of `backend` runs: the OPD teacher, the reference model or the policy (either
    backend's: a module, or Megatron's list of model chunks). ValueError when the one asked for is not loaded."""
    model = backend.teacher_model if teacher else backend.ref_model if reference else backend.model
    if model is None:
        raise ValueError("no teacher model: it is loaded only with --use-opd --opd-type megatron" if teacher else
                         "no reference model: it is loaded only with --use-kl-loss or --kl-coef > 0")
    return model


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
            from slimeflow.train.backends.torch.checkpoint import read_weights

            assign_weights(model, read_weights(ref_load, self.hf_checkpoint), f"--ref-load {ref_load}")
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
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
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
        """HF-named weights (tied ones once), detached, on the CPU. On a CPU backend these share memory with the
        parameters (no copy): consume them before the next optimizer step."""
        return {name: p.detach().cpu() for name, p in self.model.named_parameters()}

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The weights as an HF checkpoint names them: named_weights with each expert on its own, plus the saved
        buffers (DeepSeek's and GLM4-MoE's expert-score correction bias)."""
        parameters = self.named_weights()
        buffers = {name: b.detach().cpu() for name, b in self.model.state_dict().items()
                   if name not in parameters and not name.endswith("lm_head.weight")}
        return split_experts({**parameters, **buffers})

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


@dataclass
class RowLayout:
    """One micro-batch as model input: its distinct rows (`distinct_rows`) right-padded to the longest.

    ids/mask: [rows, longest]; keep: the positions whose output predicts a response token; kept: each row's count
    of them; row_of: each sample's row (None: one row per sample); totals/lengths: each sample's token counts.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    keep: torch.Tensor
    kept: torch.Tensor
    row_of: torch.Tensor | None
    totals: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, rows: TrainBatch) -> RowLayout:
        """ValueError for a sample whose response leaves no prompt token to predict its first token from."""
        totals = torch.tensor(rows.total_lengths, dtype=torch.long)
        lengths = torch.tensor(rows.response_lengths, dtype=torch.long)
        bad = (lengths >= totals).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise ValueError(f"sample {i}: response_length {int(lengths[i])} leaves no prompt token "
                             f"({int(totals[i])} tokens); the first response token needs a token before it to be "
                             "predicted from")
        firsts, row_of = distinct_rows(rows.tokens, rows.response_lengths)
        kept = lengths[firsts]  # each row's kept positions (its response length)
        ids, mask, keep = right_padded([rows.tokens[i] for i in firsts], totals[firsts], kept)
        return cls(ids, mask, keep, kept, row_of, totals, lengths)


def response_log_probs(selected: torch.Tensor, rows: TrainBatch, layout: RowLayout, temperature: float,
                       with_entropy: bool) -> LogProbs:
    """Per-sample log-probs (and entropies) from `selected`, the logits [kept positions, vocab] of `layout`'s
    rows, flattened row by row; the logits are divided by the sampling temperature first."""
    device = selected.device
    logits = selected.float() / temperature  # the sampling policy's logits; x / 1.0 is exact
    kept, lengths, totals = layout.kept, layout.lengths, layout.totals
    if layout.row_of is not None:  # each sample's positions within its row's block of kept positions
        logits = logits[ranges((torch.cumsum(kept, 0) - kept)[layout.row_of], lengths).to(device)]
    targets = torch.cat(list(rows.tokens))[ranges(torch.cumsum(totals, 0) - lengths, lengths)]
    log_probs = alg.compute_log_probs(logits, targets.to(device))
    entropy = alg.compute_entropy_from_logits(logits) if with_entropy else None
    split = rows.response_lengths
    return LogProbs(list(torch.split(log_probs, split)), None if entropy is None else list(torch.split(entropy, split)))


def init_process_group(rank: int, world_size: int, init_method: str | None, device: torch.device,
                       single_rank_too: bool = False) -> bool:
    """Join the default process group (gloo on CPU, NCCL on GPU) unless there is one, or there is a single rank
    and not `single_rank_too`; returns whether this call created it (its owner destroys it)."""
    if torch.distributed.is_initialized() or (world_size == 1 and not single_rank_too):
        return False
    if init_method is None:
        raise ValueError(f"world_size {world_size} needs an init_method (e.g. file:///shared/rendezvous "
                         "or tcp://host:port) for torch.distributed")
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return True


def plan_micro_batches(batch: BatchConfig, lengths: list[int]) -> list[list[int]]:
    """Micro-batches (sample indices) of one rank's share of `lengths` tokens: packed under --max-tokens-per-gpu
    with --use-dynamic-batch-size, else consecutive --micro-batch-size samples."""
    if batch.use_dynamic_batch_size:
        assert batch.max_tokens_per_gpu is not None  # BatchConfig validates this
        return pack_micro_batches(lengths, batch.max_tokens_per_gpu)
    size = batch.micro_batch_size
    return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


def log_prob_steps(steps: list[list[list[int]]] | None, batch: TrainBatch,
                   micro_batches: Callable[[list[int]], list[list[int]]]) -> list[list[list[int]]]:
    """A log-prob pass's micro-batches, step by step: `steps` checked to hold each sample of `batch` once
    (ValueError otherwise), or, without them, `micro_batches` of the whole batch as one step."""
    if steps is None:
        return [micro_batches(batch.total_lengths)]
    seen = sorted(i for step in steps for micro in step for i in micro)
    if seen != list(range(len(batch))):
        raise ValueError(f"a log-prob pass's micro-batches must hold each of the {len(batch)} samples once; they "
                         f"hold {seen[:10]}{' ...' if len(seen) > 10 else ''}")
    return steps


def sum_over_ranks(sums: dict[str, torch.Tensor], world_size: int, group: Any = None) -> dict[str, float]:
    """Each metric's global-batch value: the ranks' sums added over `group` (None: the default group); every rank
    has the same metric names."""
    keys = sorted(sums)
    if not keys:
        return {}
    stacked = torch.stack([sums[k] for k in keys])
    if world_size > 1:
        torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.SUM, group=group)
    return dict(zip(keys, stacked.tolist(), strict=True))


def distinct_rows(tokens: list[torch.Tensor], response_lengths: list[int]) -> tuple[list[int], torch.Tensor | None]:
    """The samples that get a forward row of their own, and each sample's row (None: every sample has its own).

    A sample's response log-probs depend only on its tokens but the last (the last one's output predicts nothing)
    and on its response length. Samples that agree on both (a GRPO group's one-token responses to one prompt)
    share the first one's row, so the forward and backward run once for all of them; the loss still counts each
    sample, and autograd sums their gradients into the shared row.
    """
    if not tokens:
        return [], None
    values = torch.cat(tokens).tolist()  # one conversion for the micro-batch, then slices of a Python list
    keys: dict[tuple[int, tuple[int, ...]], int] = {}
    row_of, start = [], 0
    for t, n in zip(tokens, response_lengths, strict=True):
        end = start + t.numel()
        row_of.append(keys.setdefault((n, tuple(values[start : end - 1])), len(keys)))
        start = end
    if len(keys) == len(row_of):
        return list(range(len(row_of))), None
    firsts: dict[int, int] = {}
    for i, row in enumerate(row_of):
        firsts.setdefault(row, i)
    return list(firsts.values()), torch.tensor(row_of, dtype=torch.long)


def right_padded(tokens: list[torch.Tensor], totals: torch.Tensor,
                 response_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, keep) of rows right-padded to the longest; `keep` marks the positions whose output
    predicts a response token (the one before each response token)."""
    columns = torch.arange(int(totals.max()))
    filled = columns < totals[:, None]
    ids = torch.zeros(filled.shape, dtype=torch.long)
    ids[filled] = torch.cat(tokens)  # row-major: each row's tokens, then padding
    keep = (columns >= (totals - response_lengths - 1)[:, None]) & (columns < (totals - 1)[:, None])
    return ids, filled.long(), keep


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(start, start + length) for each (start, length), without a Python loop."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths) + torch.arange(int(lengths.sum()))
