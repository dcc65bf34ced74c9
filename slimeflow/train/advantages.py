"""Advantage estimation for a whole rollout batch: grpo, gspo, cispo, reinforce_plus_plus(_baseline), ppo, custom.

Runs over the global batch (all samples of the rollout, in group order) before it is split into micro-batches,
because group statistics and whitening are batch-wide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from slimeflow.config.train import AlgorithmConfig
from slimeflow.rollout.plugins import load_plugin
from slimeflow.train import algorithms as alg


@dataclass
class AdvantageInputs:
    """Per-sample inputs over response tokens; `rewards` holds the raw scalar rewards in group order.

    log_probs are the trainer's log-probs under the policy that generated the batch; ref_log_probs the
    reference model's (None without a reference: the KL term is then 0); values the critic's (PPO only).
    """

    rewards: torch.Tensor
    loss_masks: list[torch.Tensor]
    log_probs: list[torch.Tensor] | None = None
    ref_log_probs: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    teacher_log_probs: list[torch.Tensor] | None = None
    """A teacher's log-probs (on-policy distillation, --use-opd), None without one."""

    @property
    def response_lengths(self) -> list[int]:
        return [int(m.numel()) for m in self.loss_masks]


@dataclass
class Advantages:
    """Per-token advantages of each sample, and the returns (the critic's targets; equal to advantages but PPO's)."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]
    opd_reverse_kl: list[torch.Tensor] | None = None
    """log pi_old - log pi_teacher per response token (--use-opd), None without a teacher."""


CustomAdvantage = Callable[[AlgorithmConfig, AdvantageInputs], list[torch.Tensor]]
"""(config, inputs) -> per-sample advantages over response tokens (whitened afterwards if normalize_advantages)."""


def load_custom_advantage(config: AlgorithmConfig) -> CustomAdvantage | None:
    """The function at --custom-advantage-function-path, or None."""
    path = config.custom_advantage_function_path
    return None if path is None else load_plugin(path, "custom-advantage-function-path")


def token_kl(config: AlgorithmConfig, inputs: AdvantageInputs) -> list[torch.Tensor]:
    """Per-token KL of the policy against the reference with --kl-loss-type (zeros without a reference)."""
    if inputs.log_probs is None or inputs.ref_log_probs is None:
        return [torch.zeros_like(m, dtype=torch.float32) for m in inputs.loss_masks]
    return [alg.compute_approx_kl(lp, ref, config.kl_loss_type)
            for lp, ref in zip(inputs.log_probs, inputs.ref_log_probs, strict=True)]


def compute_advantages(config: AlgorithmConfig, inputs: AdvantageInputs, n_samples_per_prompt: int,
                       custom: CustomAdvantage | None = None, *, post_processed: bool | None = None) -> Advantages:
    """Advantages for --advantage-estimator (or `custom`), then whitening where slime whitens.

    GRPO-style and REINFORCE++-baseline rewards are group-normalised first, unless they are post-processed already:
    `post_processed` True (slime's trainer-side contract: the rollout normalised them), or, when None, a
    --custom-reward-post-process-path function or a custom conversion to train data made them. REINFORCE++ and
    REINFORCE++-baseline are always whitened over the batch's loss-masked tokens; the others when
    --normalize-advantages is set. Whitening raises when no token of the batch is loss-masked in.
    """
    estimator = config.advantage_estimator
    if post_processed is None:
        # --custom-reward-post-process-path (or a custom conversion to train data) already turned the rewards into
        # what the estimator takes (slime's contract)
        post_processed = (config.custom_reward_post_process_path
                          or config.custom_convert_samples_to_train_data_path) is not None
    returns = None
    if custom is not None:
        advantages = list(custom(config, inputs))
        _check_shapes(advantages, inputs.response_lengths)
    elif estimator in ("grpo", "gspo", "cispo"):
        rewards = inputs.rewards.float() if post_processed else alg.normalize_group_rewards(
            inputs.rewards, n_samples_per_prompt, std_normalization=not config.disable_grpo_std_normalization)
        advantages = alg.broadcast_returns(rewards, inputs.response_lengths)
    elif estimator == "reinforce_plus_plus":
        advantages = alg.reinforce_plus_plus_returns(inputs.rewards.float(), token_kl(config, inputs), inputs.loss_masks,
                                                     config.kl_coef, config.gamma)
    elif estimator == "reinforce_plus_plus_baseline":
        centered = inputs.rewards.float() if post_processed else alg.normalize_group_rewards(
            inputs.rewards, n_samples_per_prompt, std_normalization=False)
        advantages = alg.reinforce_plus_plus_baseline_advantages(centered, token_kl(config, inputs),
                                                                config.kl_coef)
    elif estimator == "ppo":
        if inputs.values is None:
            raise ValueError("--advantage-estimator ppo needs the critic's values for every sample")
        if [v.numel() for v in inputs.values] != inputs.response_lengths:
            raise ValueError("--advantage-estimator ppo: the critic's values must have one entry per response token "
                             f"of each sample; got lengths {[v.numel() for v in inputs.values][:8]}..., "
                             f"response lengths {inputs.response_lengths[:8]}...")
        token_rewards = alg.ppo_token_rewards(inputs.rewards.float(), token_kl(config, inputs), config.kl_coef)
        padded_advantages, padded_returns = alg.gae(alg.pad_rows(token_rewards), alg.pad_rows(inputs.values),
                                                    config.gamma, config.lambd)
        lengths = inputs.response_lengths
        advantages, returns = alg.unpad_rows(padded_advantages, lengths), alg.unpad_rows(padded_returns, lengths)
    else:
        raise ValueError(f"unknown --advantage-estimator {estimator!r}")
    reverse_kl = None
    if config.use_opd:
        reverse_kl = teacher_reverse_kl(inputs)
        advantages = [a - config.opd_kl_coef * kl for a, kl in zip(advantages, reverse_kl, strict=True)]
    if returns is None:  # a copy, so whitening or a caller's in-place edit of one leaves the other
        returns = _copy(advantages)
    whiten = config.normalize_advantages or (custom is None and estimator.startswith("reinforce_plus_plus"))
    if whiten:
        advantages = whiten_batch(advantages, inputs.loss_masks)
    return Advantages(advantages=advantages, returns=returns, opd_reverse_kl=reverse_kl)


def teacher_reverse_kl(inputs: AdvantageInputs) -> list[torch.Tensor]:
    """On-policy distillation (slime's OPD): log pi_old - log pi_teacher per token, the reverse KL to the teacher
    that compute_advantages subtracts (x --opd-kl-coef) from the advantages of any estimator."""
    if inputs.log_probs is None or inputs.teacher_log_probs is None:
        raise ValueError("--use-opd needs the policy's and the teacher's log-probs of every response token")
    return [lp - t for lp, t in zip(inputs.log_probs, inputs.teacher_log_probs, strict=True)]


def whiten_batch(advantages: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Whiten all samples' advantages together over their loss-masked tokens."""
    lengths = [a.numel() for a in advantages]
    flat = alg.masked_whiten(torch.cat(list(advantages)).float(), torch.cat(list(loss_masks)).float())
    return list(torch.split(flat, lengths))


def _copy(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (views of one new flat tensor: one copy for the batch, not one per sample)."""
    if len({t.dtype for t in tensors}) != 1:
        return [t.clone() for t in tensors]
    return list(torch.cat(list(tensors)).split([t.numel() for t in tensors]))


def _check_shapes(advantages: Sequence[torch.Tensor], lengths: Sequence[int]) -> None:
    got = [int(a.numel()) for a in advantages]
    if got != list(lengths):
        raise ValueError(f"the custom advantage function returned per-sample lengths {got[:8]}..., "
                         f"expected the response lengths {list(lengths)[:8]}...")
