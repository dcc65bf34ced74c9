"""slime.utils.ppo_utils: the RL math slime's custom losses and advantage functions call, with slime's signatures,
over slimeflow's own (slimeflow.train.algorithms, slimeflow.train.logprob_entropy).

Context parallelism is not supported here (slimeflow's trainer gathers a sample's response before this math): every
per-sample tensor holds the whole response, as in slime with a context-parallel size of 1. Off-policy sequence
masking (compute_opsm_mask) is refused, as slimeflow refuses --use-opsm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slimeflow.train import algorithms as alg
from slimeflow.train.algorithms import compute_approx_kl, compute_cispo_loss, compute_policy_loss
from slimeflow.train.logprob_entropy import log_probs_and_entropy

__all__ = [
    "calculate_log_probs_and_entropy", "chunked_discounted_returns", "chunked_gae", "compute_approx_kl",
    "compute_cispo_loss", "compute_gspo_kl", "compute_policy_loss", "get_advantages_and_returns_batch",
    "get_grpo_returns", "get_reinforce_plus_plus_baseline_advantages", "get_reinforce_plus_plus_returns",
    "vanilla_gae",
]


def compute_gspo_kl(full_log_probs: list[torch.Tensor], full_old_log_probs: list[torch.Tensor],
                    local_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> torch.Tensor:
    """GSPO's per-sequence KL (masked mean of old - new log-probs) on every token of each local_log_probs[i],
    concatenated."""
    lengths = [lp.numel() for lp in full_log_probs]
    index = alg.sample_index(lengths, full_log_probs[0].device)
    means = alg.sample_means(torch.cat(full_old_log_probs) - torch.cat(full_log_probs), torch.cat(loss_masks),
                             index, len(lengths))
    return torch.cat([mean.expand_as(local) for mean, local in zip(means, local_log_probs, strict=True)])


def get_grpo_returns(rewards: torch.Tensor, kl: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's reward on every token (the shape of its kl)."""
    return alg.broadcast_returns(torch.as_tensor(rewards), [k.numel() for k in kl])


def get_reinforce_plus_plus_returns(rewards: torch.Tensor, kl: list[torch.Tensor], loss_masks: list[torch.Tensor],
                                    response_lengths: list[int], total_lengths: list[int], kl_coef: float,
                                    gamma: float) -> list[torch.Tensor]:
    """REINFORCE++ discounted returns (alg.reinforce_plus_plus_returns); the lengths are unused (no CP)."""
    return alg.reinforce_plus_plus_returns(torch.as_tensor(rewards), kl, loss_masks, kl_coef, gamma)


def get_reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, kl: list[torch.Tensor],
                                                loss_masks: list[torch.Tensor], kl_coef: float) -> list[torch.Tensor]:
    """(reward - group baseline, already subtracted) on every token, minus kl_coef * kl; not yet whitened."""
    return alg.reinforce_plus_plus_baseline_advantages(torch.as_tensor(rewards), kl, kl_coef)


def get_advantages_and_returns_batch(total_lengths: list[int], response_lengths: list[int],
                                     values_list: list[torch.Tensor], rewards_list: list[torch.Tensor], gamma: float,
                                     lambd: float, chunked: bool = True) -> tuple[list[torch.Tensor],
                                                                                  list[torch.Tensor]]:
    """GAE over each sample's token rewards and values: (advantages, returns) per sample (`chunked` picks nothing:
    slimeflow has one GAE)."""
    with torch.no_grad():
        rewards = alg.pad_rows([r[:n] for r, n in zip(rewards_list, response_lengths, strict=True)])
        values = alg.pad_rows([v[:n] for v, n in zip(values_list, response_lengths, strict=True)])
        advantages, returns = alg.gae(rewards, values, gamma, lambd)
    return alg.unpad_rows(advantages, response_lengths), alg.unpad_rows(returns, response_lengths)


def vanilla_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float,
                lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE along the last dimension of [B, T] rows: (advantages, returns)."""
    return alg.gae(rewards, values, gamma, lambd)


def chunked_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float,
                chunk_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """vanilla_gae (slime's chunked scan is a speed-up of the same sums; `chunk_size` changes nothing here)."""
    return alg.gae(rewards, values, gamma, lambd)


def chunked_discounted_returns(rewards: torch.Tensor, discount: float, chunk_size: int = 128) -> torch.Tensor:
    """G_t = r_t + discount * G_{t+1} along the last dimension of [B, T] rewards."""
    if rewards.ndim != 2:
        raise ValueError(f"chunked_discounted_returns takes [batch, tokens] rewards, got shape {tuple(rewards.shape)}")
    return alg.discounted_cumsum(rewards, discount)


def calculate_log_probs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, tp_group: Any,
                                    with_entropy: bool = False, chunk_size: int = -1,
                                    log_prob_keep_mask: torch.Tensor | None = None,
                                    with_entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [T, 1] ([0] when T is 0), entropy [T] or None) of `tokens` under `logits`, the vocabulary sharded
    over `tp_group`; as slime, tp_group None means the default process group when one is initialised."""
    group = tp_group if tp_group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    log_probs, entropy = log_probs_and_entropy(logits, tokens, with_entropy=with_entropy, keep_mask=log_prob_keep_mask,
                                               group=group, chunk_size=chunk_size, entropy_grad=with_entropy_grad)
    return (log_probs.unsqueeze(-1) if log_probs.numel() else log_probs), entropy


def __getattr__(name: str) -> Any:
    if name == "compute_opsm_mask":
        raise ImportError("slime.utils.ppo_utils.compute_opsm_mask is not provided: slimeflow does not support "
                          "off-policy sequence masking (--use-opsm) yet", name=name)
    raise AttributeError(f"module 'slime.utils.ppo_utils' has no attribute {name!r}")
