"""Training on one rollout, as slime's actor does: old and reference log-probs, advantages, optimizer steps.

Every data-parallel rank calls `train_on_rollout` with the whole rollout batch and its own rank; each rank
computes log-probs for its share only and the shares are gathered, so advantages see the whole rollout.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch

from slimeflow.config.train import TrainConfig
from slimeflow.rollout.types import TrainBatch
from slimeflow.train.advantages import AdvantageInputs, compute_advantages
from slimeflow.train.backends.common import LogProbs, scoring_model
from slimeflow.train.backends.protocol import Backend
from slimeflow.train.loss import LossInputs, LossNormalizer, LossOutput, compute_loss
from slimeflow.train.packing import split_for_data_parallel
from slimeflow.train.train_hooks import TrainHooks, postprocess_rollout_data


@dataclass
class Prepared:
    """Per-sample inputs of the loss over the whole rollout (CPU tensors, rollout order)."""

    old_log_probs: list[torch.Tensor] | None
    """None when on-policy with one step: the training forward's detached log-probs serve."""
    advantages: list[torch.Tensor]
    ref_log_probs: list[torch.Tensor] | None
    opd_reverse_kl: list[torch.Tensor] | None = None
    """log pi_old - log pi_teacher per response token (--use-opd), None without a teacher."""


def plan_steps(batch: TrainBatch, global_batch_size: int, rank: int, world_size: int,
               balance_data: bool) -> list[tuple[list[int], list[int]]]:
    """(global batch indices, this rank's share of them) for each optimizer step: consecutive global batches of
    --global-batch-size samples, each split over the data-parallel ranks (token-balanced with --balance-data)."""
    if len(batch) == 0 or len(batch) % global_batch_size:
        raise ValueError(f"the rollout has {len(batch)} samples, not a positive multiple of --global-batch-size "
                         f"{global_batch_size}; check rollout_batch_size x n_samples_per_prompt")
    lengths = batch.total_lengths
    plan = []
    for start in range(0, len(batch), global_batch_size):
        indices = list(range(start, start + global_batch_size))
        shares = split_for_data_parallel([lengths[i] for i in indices], world_size, balance_data)
        plan.append((indices, [indices[j] for j in shares[rank]]))
    return plan


def train_on_rollout(backend: Backend, batch: TrainBatch, config: TrainConfig, rank: int = 0,
                     world_size: int = 1, rollout_id: int = 0, hooks: TrainHooks | None = None) -> dict[str, float]:
    """Train on one rollout (rows in group order: consecutive groups of n_samples_per_prompt).

    Runs len(batch) / global_batch_size optimizer steps. Returns metrics averaged over the steps, each the
    global batch's value (summed over micro-batches and ranks): pg_loss, pg_clipfrac, ppo_kl, entropy, kl_loss
    (--use-kl-loss), tis, tis_clipfrac, tis_abs and ois (--use-tis, --get-mismatch-metrics), grad_norm, lr (of each step),
    opd_reverse_kl (--use-opd), and train_tokens_per_s
    (prompt + response tokens of the rollout over the wall time of the steps, all ranks together).
    `hooks`: slime's hooks (train_hooks), called where slime's actor calls them.
    """
    assert config.batch.global_batch_size is not None  # BatchConfig derives it
    plan = plan_steps(batch, config.batch.global_batch_size, rank, world_size, config.batch.balance_data)
    own = sorted(i for _, share in plan for i in share)
    prepared = prepare(backend, batch, config, [share for _, share in plan], world_size, single_step=len(plan) == 1,
                       hooks=hooks)
    if hooks is not None and hooks.rollout_data_postprocess is not None:
        postprocess_rollout_data(hooks, rollout_id, batch, own, prepared)
        if world_size > 1:  # each step's loss is normalised by the global batch's masks, some of them other ranks'
            batch.loss_masks = _gather(own, [batch.loss_masks[i] for i in own], len(batch), world_size,
                                       backend.data_parallel_group)
    started = time.perf_counter()
    per_step = []
    for step_id, (indices, share) in enumerate(plan):
        if hooks is not None:
            hooks.before_step(rollout_id, step_id, backend)
        metrics = accumulate_gradients(backend, batch, indices, share, prepared, config)
        per_step.append({**metrics, **backend.optimizer_step()})
    seconds = time.perf_counter() - started
    metrics = {key: sum(m[key] for m in per_step) / len(per_step) for key in per_step[0]}
    metrics["train_tokens_per_s"] = sum(batch.total_lengths) / max(seconds, 1e-9)
    if prepared.opd_reverse_kl is not None:  # slime's opd_reverse_kl: the mean over samples of each one's token mean
        means = [(kl * mask).sum() / mask.sum().clamp(min=1) for kl, mask in zip(prepared.opd_reverse_kl,
                                                                               batch.loss_masks, strict=True)]
        metrics["opd_reverse_kl"] = float(torch.stack(means).mean()) if means else 0.0
    return metrics


def prepare(backend: Backend, batch: TrainBatch, config: TrainConfig, shares: list[list[int]],
            world_size: int, single_step: bool = False, hooks: TrainHooks | None = None) -> Prepared:
    """Old (and reference) log-probs of this rank's samples (`shares`: its samples in each optimizer step, as
    plan_steps splits them), gathered from all ranks, then the advantages of the whole rollout
    (--advantage-estimator, or the custom function the backend loaded). `hooks`: each log-prob pass is preceded
    by slime's before-log-prob hook.

    Each log-prob pass runs the micro-batches the training steps will run (step by step, as slime's forward_only),
    so every sample's old log-probs come out of the same float sums as its first training forward: the first
    step's ppo_kl is exactly 0 with --use-dynamic-batch-size too (packing the whole share at once groups samples
    otherwise, and rounding differs)."""
    algo = config.algorithm
    if algo.disable_compute_advantages_and_returns:  # slime's SFT: the loss reads the training forward alone
        return Prepared(old_log_probs=None, advantages=[torch.zeros(len(m)) for m in batch.loss_masks],
                        ref_log_probs=None)
    own = sorted(i for share in shares for i in share)
    mine = batch.select(own)

    @functools.cache  # planned once, on the first pass (none when no pass runs)
    def steps() -> list[list[list[int]]]:
        """Each step's training micro-batches as indices into `mine`."""
        lengths, position = batch.total_lengths, {i: p for p, i in enumerate(own)}
        return [[[position[i] for i in micro] for micro in step_micro_batches(backend, lengths, share)]
                for share in shares]

    def log_probs(reference: bool = False, teacher: bool = False) -> list[torch.Tensor]:
        if hooks is not None:
            hooks.before_log_probs(scoring_model(backend, reference, teacher),
                                   "ref_" if reference else "teacher_" if teacher else "")
        computed = backend.compute_log_probs(mine, reference=reference, teacher=teacher, steps=steps())
        return _gather(own, computed.log_probs, len(batch), world_size, backend.data_parallel_group)

    if algo.use_rollout_logprobs and batch.rollout_log_probs is None:
        raise ValueError("--use-rollout-logprobs needs the rollout engine's log-probs of every sample; this rollout "
                         "has none (a custom generate function must set rollout_log_probs)")
    if algo.use_rollout_logprobs and not algo.get_mismatch_metrics:
        old = None  # the engine's log-probs are the old policy's (as slime, no recompute); TIS metrics are off
    elif single_step and _advantages_need_no_log_probs(config, backend):
        # On-policy with one optimizer step: the old log-probs are the training forward's own values (detached),
        # so the extra forward pass over the rollout is skipped.
        old = None
    else:
        old = log_probs()
    ref = log_probs(reference=True) if backend.needs_reference else None
    teacher = None
    if algo.needs_teacher:
        teacher = log_probs(teacher=True)
    elif algo.use_opd:
        if batch.teacher_log_probs is None:
            raise ValueError("--use-opd --opd-type sglang needs every sample's teacher_log_probs, which this rollout "
                             "lacks: set them in --custom-reward-post-process-path (slime's "
                             "slime.rollout.on_policy_distillation.post_process_rewards, with its reward_func as "
                             "--custom-rm-path and the teacher server as --rm-url)")
        teacher = batch.teacher_log_probs
    policy = batch.rollout_log_probs if algo.use_rollout_logprobs else old
    inputs = AdvantageInputs(rewards=batch.rewards, loss_masks=batch.loss_masks, log_probs=policy, ref_log_probs=ref,
                             teacher_log_probs=teacher)
    advantages = compute_advantages(algo, inputs, group_size(batch, config.batch.n_samples_per_prompt),
                                    backend.plugins.advantage)
    return Prepared(old_log_probs=old, advantages=advantages.advantages, ref_log_probs=ref,
                    opd_reverse_kl=advantages.opd_reverse_kl)


def group_size(batch: TrainBatch, n_samples_per_prompt: int) -> int:
    """Samples per group for the group-normalised estimators: n_samples_per_prompt, or the size every group shares
    when a custom generate returned several samples per trajectory; groups of different sizes normalise as one
    group over the whole rollout (slime's fallback for unequal groups)."""
    sizes = {len(list(run)) for _, run in itertools.groupby(batch.group_indices)}
    if not sizes or sizes == {n_samples_per_prompt}:
        return n_samples_per_prompt
    return sizes.pop() if len(sizes) == 1 else len(batch)


def _advantages_need_no_log_probs(config: TrainConfig, backend: Backend) -> bool:
    """GRPO-style estimators read only the rewards; the KL-shaped ones and custom functions read log-probs."""
    return (backend.plugins.advantage is None and config.algorithm.advantage_estimator in ("grpo", "gspo", "cispo")
            and not config.algorithm.use_opd)  # OPD's penalty reads the old policy's log-probs


def _gather(own: list[int], values: list[torch.Tensor], total: int, world_size: int,
            group: Any = None) -> list[torch.Tensor]:
    """Every data-parallel rank's (indices, per-sample tensors) put back in rollout order (`group`: the
    data-parallel process group, None: the default group)."""
    pieces = [(own, values)]
    if world_size > 1:
        pieces = [None] * world_size  # type: ignore[list-item]
        torch.distributed.all_gather_object(pieces, (own, values), group=group)
    out: list[torch.Tensor | None] = [None] * total
    for indices, tensors in pieces:
        for i, tensor in zip(indices, tensors, strict=True):
            out[i] = tensor
    missing = [i for i, t in enumerate(out) if t is None]
    if missing:
        raise RuntimeError(f"no rank computed log-probs for samples {missing[:10]}: the ranks disagree on the split")
    return out  # type: ignore[return-value]


def step_micro_batches(backend: Backend, lengths: list[int], share: list[int]) -> list[list[int]]:
    """The micro-batches (batch indices) this rank runs its `share` of one optimizer step in (`lengths`: every
    sample's tokens), for the training step and the log-prob passes alike. Collective under expert parallelism
    with --use-dynamic-batch-size (the ranks even out their counts): every rank calls it for every step."""
    return [[share[j] for j in micro] for micro in backend.micro_batches([lengths[i] for i in share])]


def accumulate_gradients(backend: Backend, batch: TrainBatch, indices: list[int], share: list[int],
                         prepared: Prepared, config: TrainConfig) -> dict[str, float]:
    """Forward/backward over this rank's micro-batches (`share`) of the global batch `indices`; returns the global
    batch's loss metrics (summed over ranks). The gradients summed over ranks equal one pass over the batch."""
    algo, device = config.algorithm, backend.device
    normalizer = LossNormalizer.for_batch([batch.loss_masks[i] for i in indices])
    lengths = batch.total_lengths  # a property that walks the batch: read it once, not once per sample
    micros = step_micro_batches(backend, lengths, share)

    def loss_of(rows: list[int], out: LogProbs) -> LossOutput:
        """The loss of the micro-batch `rows` (batch indices) from the backend's forward output `out`."""
        assert out.entropy is not None
        entropy = out.entropy if algo.entropy_coef else [e.detach() for e in out.entropy]

        def pick(values: list[torch.Tensor]) -> list[torch.Tensor]:
            return [values[i].to(device) for i in rows]

        def pick_given(values: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if values is None else pick(values)

        old = pick_given(prepared.old_log_probs) or [lp.detach() for lp in out.log_probs]
        inputs = LossInputs(log_probs=out.log_probs, old_log_probs=old,
                            advantages=pick(prepared.advantages), loss_masks=pick(batch.loss_masks),
                            ref_log_probs=pick_given(prepared.ref_log_probs) if algo.use_kl_loss else None,
                            rollout_log_probs=pick_given(batch.rollout_log_probs),
                            entropy=entropy, total_lengths=[lengths[i] for i in rows])
        return compute_loss(algo, inputs, normalizer, backend.plugins.loss, backend.plugins.tis,
                            backend.plugins.pg_loss_reducer)

    return backend.forward_backward(batch, micros, loss_of)
