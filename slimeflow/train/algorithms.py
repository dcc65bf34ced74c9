"""The mathematics of slime's RL algorithms, as plain torch functions (the public API for custom losses).

Conventions: per-token quantities cover the response tokens of one sample as a 1-D tensor, or of several samples
concatenated; lists hold one such tensor per sample. `ppo_kl = old_log_probs - log_probs` per token, so
`ratio = exp(-ppo_kl) = pi / pi_old`. Definitions and constants follow slime (reference: slime-notes.md §5).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slimeflow.train.logprob_entropy import log_probs_and_entropy

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8
LOW_VAR_KL_CLAMP = 10.0


def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_loss_type: str,
                      importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate of pi against pi_base from log_ratio = log_probs - log_probs_base (at least fp32).

    k1 = log_ratio; k2 = log_ratio^2 / 2; k3 = low_var_kl = exp(-log_ratio) - 1 + log_ratio (slime's Schulman
    estimators). `importance_ratio` (pi / pi_old per token) weights the estimate, for an unbiased one when the
    tokens were sampled from pi_old; low_var_kl is clamped to [-10, 10] after the weighting.
    """
    log_ratio = _upcast(log_probs) - _upcast(log_probs_base)
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio.pow(2) / 2.0
    elif kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        raise ValueError(f"kl_loss_type {kl_loss_type!r} is not one of k1, k2, k3, low_var_kl")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP) if kl_loss_type == "low_var_kl" else kl


def compute_policy_loss(ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float,
                        eps_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: (pg_losses, clipfrac), clipfrac 1.0 where the clipped term won.

    l = max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A); with dual clip (eps_clip_c > 1),
    l = min(l, -eps_clip_c * A) where A < 0.
    """
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    losses = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c (dual clip) must be > 1, got {eps_clip_c}")
        losses = torch.where(advantages < 0, torch.minimum(losses, -eps_clip_c * advantages), losses)
    return losses, clipfrac


def compute_cispo_loss(ppo_kl: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
                       eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO per token: l = -stopgrad(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_probs.

    Returns (losses, clipfrac), clipfrac 1.0 where the ratio lay outside the clip range.
    """
    ratio = torch.exp(-ppo_kl).detach()
    clipped = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    return -clipped * advantages * log_probs, (clipped != ratio).float()


def compute_gspo_kl(log_probs: Sequence[torch.Tensor], old_log_probs: Sequence[torch.Tensor],
                    loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """GSPO's sequence-level ppo_kl: the masked mean of (old - new) log-probs of each sample, on every token.

    A fully masked sample gets 0 (slime divides by max(mask sum, 1)).
    """
    if not log_probs:
        return []
    lengths = [lp.numel() for lp in log_probs]
    index = sample_index(lengths, log_probs[0].device)
    flat = gspo_kl_flat(torch.cat(list(log_probs)), torch.cat(list(old_log_probs)), torch.cat(list(loss_masks)),
                        index, len(lengths))
    return list(torch.split(flat, lengths))


def gspo_kl_flat(log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                 index: torch.Tensor, num_samples: int) -> torch.Tensor:
    """`compute_gspo_kl` on flat tokens: several samples concatenated, `index` the sample of each (sample_index)."""
    return sample_means(old_log_probs - log_probs, loss_mask, index, num_samples)[index]


def compute_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[t]) under logits[t] ([T, V] and [T]); at least fp32 (log_probs_and_entropy for both at once)."""
    return log_probs_and_entropy(logits, tokens)[0]


def compute_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax of each row of `logits` ([T, V] -> [T]); at least fp32."""
    tokens = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    entropy = log_probs_and_entropy(logits, tokens, with_entropy=True)[1]
    assert entropy is not None
    return entropy


def normalize_group_rewards(rewards: torch.Tensor, n_samples_per_prompt: int,
                            std_normalization: bool = True) -> torch.Tensor:
    """Rewards of consecutive groups of `n_samples_per_prompt`: r - group mean, then / (group std + 1e-6).

    std is torch's unbiased std (NaN for a group of one, so a group of one needs std_normalization=False,
    which the train config sets automatically, as slime does).
    """
    rewards = rewards.float()
    if rewards.numel() % n_samples_per_prompt:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {n_samples_per_prompt}")
    groups = rewards.reshape(-1, n_samples_per_prompt)
    centered = groups - groups.mean(dim=-1, keepdim=True)
    if std_normalization:
        if n_samples_per_prompt == 1:
            raise ValueError("std normalisation needs groups of >= 2 samples; pass std_normalization=False")
        centered = centered / (groups.std(dim=-1, keepdim=True) + GROUP_STD_EPS)
    return centered.reshape(-1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  epsilon: float = WHITEN_EPS) -> torch.Tensor:
    """(values - mean) / sqrt(var + epsilon) over masked entries; var is unbiased when >= 2 entries are masked.

    Raises ValueError when nothing is masked in (slime raises too). shift_mean=False adds the mean back.
    """
    count = mask.sum()
    if count.item() == 0:
        raise ValueError("cannot whiten: the loss mask of the whole batch is empty (no response token trains)")
    mean = (values * mask).sum() / count
    var = (values.pow(2) * mask).sum() / count - mean.pow(2)
    if count.item() >= 2:
        var = var * count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    return whitened if shift_mean else whitened + mean


def broadcast_returns(rewards: torch.Tensor, response_lengths: Sequence[int]) -> list[torch.Tensor]:
    """GRPO/GSPO/CISPO: each sample's (normalised) reward on every response token."""
    if rewards.numel() != len(response_lengths):
        raise ValueError(f"{rewards.numel()} rewards for {len(response_lengths)} response lengths")
    lengths = torch.tensor(list(response_lengths), dtype=torch.long, device=rewards.device)
    per_token = torch.repeat_interleave(rewards.to(torch.get_default_dtype()), lengths)
    return list(torch.split(per_token, list(response_lengths)))


def reinforce_plus_plus_returns(rewards: torch.Tensor, kl: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor],
                                kl_coef: float, gamma: float) -> list[torch.Tensor]:
    """REINFORCE++ discounted returns: token rewards -kl_coef * kl on loss-masked tokens (a masked-out token, a
    tool's output say, carries no KL penalty), plus the reward at the last loss-masked token.

    G_t = r_t + gamma * G_{t+1}. A fully masked sample has no last token and raises (slime asserts).
    """
    token_rewards = []
    for i, (reward, kl_i, mask) in enumerate(zip(rewards.tolist(), kl, loss_masks, strict=True)):
        if mask.sum().item() == 0:
            raise ValueError(f"REINFORCE++: sample {i} is fully masked (no token to put its reward on)")
        per_token = -kl_coef * (kl_i.float() * mask)
        per_token[int(mask.nonzero()[-1])] += reward
        token_rewards.append(per_token)
    return unpad_rows(discounted_cumsum(pad_rows(token_rewards), gamma), [r.numel() for r in token_rewards])


def pad_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """[samples, longest]: each 1-D tensor as a row, right-padded with zeros (a zero after a response's last token
    leaves its discounted sums and GAE unchanged, bit for bit)."""
    if not tensors:
        return torch.zeros(0, 0)
    return torch.nn.utils.rnn.pad_sequence(list(tensors), batch_first=True)


def unpad_rows(rows: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """The inverse of pad_rows: row i's first lengths[i] entries."""
    return [row[:n] for row, n in zip(rows, lengths, strict=True)]


def discounted_cumsum(values: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = values_t + gamma * G_{t+1}, G_T = 0, along the last dimension (one response, or rows of them: a Python
    step per token position, not per token)."""
    out = torch.empty_like(values)
    running = values.new_zeros(values.shape[:-1])
    for t in range(values.shape[-1] - 1, -1, -1):
        running = values[..., t] + gamma * running
        out[..., t] = running
    return out


def reinforce_plus_plus_baseline_advantages(centered_rewards: torch.Tensor, kl: Sequence[torch.Tensor],
                                            kl_coef: float) -> list[torch.Tensor]:
    """REINFORCE++-baseline before whitening: (r - group mean) on every token, minus kl_coef * kl."""
    return [torch.ones_like(k, dtype=torch.float32) * r - kl_coef * k.float()
            for r, k in zip(centered_rewards.tolist(), kl, strict=True)]


def ppo_token_rewards(rewards: torch.Tensor, kl: Sequence[torch.Tensor], kl_coef: float) -> list[torch.Tensor]:
    """PPO token rewards: -kl_coef * kl, with the scalar reward added at the last response token."""
    out = []
    for i, (reward, k) in enumerate(zip(rewards.tolist(), kl, strict=True)):
        if k.numel() == 0:
            raise ValueError(f"PPO: sample {i} has a zero-length response (no token to put its reward on)")
        token_rewards = -kl_coef * k.float()
        token_rewards[-1] += reward
        out.append(token_rewards)
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one response, or rows of zero-padded responses (pad_rows), along the
    last dimension: (advantages, returns = advantages + values).

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token is 0); A_t = delta_t + gamma * lambd * A_{t+1}.
    """
    values = values.detach().float()
    next_values = torch.cat([values[..., 1:], values.new_zeros((*values.shape[:-1], 1))], dim=-1)
    deltas = token_rewards.float() + gamma * next_values - values
    advantages = discounted_cumsum(deltas, gamma * lambd)
    return advantages, advantages + values


def sum_of_sample_mean(values: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum over samples of (masked token sum / max(masked token count, 1)): a fully masked sample adds 0.

    Divided by the global batch's sample count this is the per-sample (default) aggregation.
    """
    if not values:
        return torch.zeros(())
    lengths = [v.numel() for v in values]
    index = sample_index(lengths, values[0].device)
    return sample_means(torch.cat(list(values)), torch.cat(list(loss_masks)), index, len(lengths)).sum()


def sum_of_token(values: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of all masked token values; divided by the global batch's masked token count it is the per-token mean."""
    if not values:
        return torch.zeros(())
    return (torch.cat(list(values)) * torch.cat(list(loss_masks))).sum()


# Flat forms: the tokens of several samples in one 1-D tensor and the sample of each token in `index`, so an
# aggregate over a micro-batch is a few tensor ops rather than a few per sample (256 samples made the loss
# thousands of tiny autograd nodes).

def sample_index(lengths: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The sample of each token of samples of `lengths` concatenated: [0] * lengths[0] + [1] * lengths[1] + ..."""
    counts = torch.tensor(list(lengths), dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.arange(len(counts), device=device), counts)


def segment_sum(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """[num_segments]: the sum of the `values` whose `index` is each segment (0 for a segment with none)."""
    return values.new_zeros(num_segments).index_add(0, index, values)


def sample_means(values: torch.Tensor, loss_mask: torch.Tensor, index: torch.Tensor,
                 num_samples: int) -> torch.Tensor:
    """[num_samples]: each sample's masked token sum / max(masked token count, 1), from flat tokens and `index`."""
    masked = values * loss_mask
    counts = segment_sum(loss_mask.to(masked.dtype), index, num_samples).clamp_min(1)
    return segment_sum(masked, index, num_samples) / counts


def sample_mean_weights(loss_mask: torch.Tensor, index: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Per-token weights w (flat, like `loss_mask`) with (values * w).sum() == sample_means(...).sum(): the mask over
    its sample's max(masked token count, 1)."""
    mask = loss_mask.float() if not loss_mask.is_floating_point() else loss_mask
    return mask / segment_sum(mask, index, num_samples).clamp_min(1)[index]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 (as slime computes these in fp32); fp32 and fp64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
