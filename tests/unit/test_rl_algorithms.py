"""RL mathematics against values computed by hand (slime-notes.md §5), edge cases included."""

from __future__ import annotations

import math

import pytest
import torch

from slimeflow.config.train import AlgorithmConfig
from slimeflow.train import algorithms as alg
from slimeflow.train.advantages import AdvantageInputs, compute_advantages


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def close(actual: torch.Tensor, expected: list[float] | torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-9)


LOGP, BASE = t(0.0, -1.0, 2.0), t(0.0, 0.0, -20.0)  # log ratios 0, -1, 22


@pytest.mark.parametrize("kind, expected", [
    ("k1", [0.0, -1.0, 22.0]),
    ("k2", [0.0, 0.5, 242.0]),
    ("k3", [0.0, math.e - 2, math.exp(-22) + 21]),
    ("low_var_kl", [0.0, math.e - 2, 10.0]),  # clamped to [-10, 10]
])
def test_kl_estimators(kind, expected):
    close(alg.compute_approx_kl(LOGP, BASE, kind), expected)


def test_kl_estimator_unknown_type_names_the_allowed_ones():
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        alg.compute_approx_kl(LOGP, BASE, "k4")


RATIOS = t(1.5, 0.5, 1.0, 0.5, 5.0)
ADV = t(1.0, 1.0, -1.0, -2.0, -1.0)


def test_policy_loss_asymmetric_clip():
    losses, clipfrac = alg.compute_policy_loss(-torch.log(RATIOS), ADV, 0.2, 0.28)
    # t0: max(-1.5, -1.28); t1: max(-0.5, -0.8); t2: 1; t3: max(1.0, 1.6); t4: max(5, 1.28)
    close(losses, [-1.28, -0.5, 1.0, 1.6, 5.0])
    close(clipfrac, [1.0, 0.0, 0.0, 1.0, 0.0])


def test_policy_loss_dual_clip_bounds_negative_advantages_only():
    losses, _ = alg.compute_policy_loss(-torch.log(RATIOS), ADV, 0.2, 0.28, eps_clip_c=3.0)
    close(losses, [-1.28, -0.5, 1.0, 1.6, 3.0])  # t4: min(5, -3 x -1)
    with pytest.raises(ValueError, match="> 1"):
        alg.compute_policy_loss(-torch.log(RATIOS), ADV, 0.2, 0.28, eps_clip_c=1.0)


def test_cispo_stops_the_gradient_through_the_clipped_ratio():
    old = t(0.0, 0.0, 0.0)
    logp = torch.log(t(1.5, 0.5, 1.0)).requires_grad_()
    losses, clipfrac = alg.compute_cispo_loss(old - logp, logp, t(1.0, 1.0, -1.0), 0.2, 0.28)
    # -clip(r) * A * logp with clip(r) = 1.28, 0.8, 1.0
    close(losses, [-1.28 * math.log(1.5), -0.8 * math.log(0.5), math.log(1.0)])
    close(clipfrac, [1.0, 1.0, 0.0])
    losses.sum().backward()
    close(logp.grad, [-1.28, -0.8, 1.0])


def test_gspo_sequence_ratio_and_fully_masked_sample():
    kl = alg.compute_gspo_kl([t(-1, -2, -3), t(-1, -1)], [t(-1.5, -2, -2), t(0, 0)], [t(1, 1, 0), t(0, 0)])
    close(kl[0], [-0.25, -0.25, -0.25])  # masked mean of (old - new) = (-0.5 + 0) / 2
    close(kl[1], [0.0, 0.0])  # fully masked: 0 / max(0, 1)


def test_group_reward_normalisation():
    rewards = t(1, 0, 0, 1, 1, 1, 1, 1)
    std = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1)
    close(alg.normalize_group_rewards(rewards, 4), [0.5 / (std + 1e-6) * s for s in (1, -1, -1, 1)] + [0.0] * 4)
    close(alg.normalize_group_rewards(rewards, 4, std_normalization=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="groups of 3"):
        alg.normalize_group_rewards(rewards, 3)
    with pytest.raises(ValueError, match=">= 2 samples"):
        alg.normalize_group_rewards(rewards, 1)


def test_masked_whiten_unbiased_and_empty_mask_raises():
    close(alg.masked_whiten(t(1, 2, 3, 100), t(1, 1, 1, 0)), [v / math.sqrt(1 + 1e-8) for v in (-1, 0, 1, 98)])
    close(alg.masked_whiten(t(1, 2, 3, 100), t(1, 1, 1, 0), shift_mean=False),
          [v / math.sqrt(1 + 1e-8) + 2 for v in (-1, 0, 1, 98)])
    with pytest.raises(ValueError, match="empty"):
        alg.masked_whiten(t(1, 2), t(0, 0))


def test_reinforce_plus_plus_returns():
    (returns,) = alg.reinforce_plus_plus_returns(t(1.0), [t(0.1, 0.2, 0.3, 0.4)], [t(1, 1, 1, 0)], 0.5, 0.9)
    # token rewards -0.05, -0.1, -0.15 + 1 (last masked-in token), 0 (masked out: no KL penalty, as slime);
    # discounted backwards with 0.9
    close(returns, [0.5485, 0.665, 0.85, 0.0])
    with pytest.raises(ValueError, match="fully masked"):
        alg.reinforce_plus_plus_returns(t(1.0), [t(0.1)], [t(0)], 0.5, 0.9)


def test_reinforce_plus_plus_baseline_and_ppo_token_rewards():
    (adv,) = alg.reinforce_plus_plus_baseline_advantages(t(0.5), [t(0.1, 0.2)], 0.5)
    close(adv, [0.45, 0.4])
    (rewards,) = alg.ppo_token_rewards(t(1.0), [t(0.1, 0.2, 0.3)], 0.1)
    close(rewards, [-0.01, -0.02, 0.97])
    with pytest.raises(ValueError, match="zero-length"):
        alg.ppo_token_rewards(t(1.0), [t()], 0.1)


def test_gae():
    advantages, returns = alg.gae(t(0, 0, 1), t(0.5, 0.6, 0.7), gamma=0.9, lambd=0.8)
    # deltas 0.04, 0.03, 0.3; A_t = delta_t + 0.72 A_{t+1}
    close(advantages, [0.21712, 0.246, 0.3])
    close(returns, [0.71712, 0.846, 1.0])


VALUES = [t(1, 2, 3), t(4, 5), t(), t(7)]
MASKS = [t(1, 1, 0), t(0, 0), t(), t(1)]


def test_aggregations_with_zero_length_and_fully_masked_samples():
    close(alg.sum_of_sample_mean(VALUES, MASKS), 1.5 + 0 + 0 + 7)
    close(alg.sum_of_token(VALUES, MASKS), 10.0)


def ragged(seed: int, n: int = 40) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random fp32 per-sample values (requiring grad) and 0/1 masks: lengths 0-9, some samples fully masked."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 10, (n,), generator=gen).tolist()
    values = [torch.randn(k, generator=gen).requires_grad_() for k in lengths]
    masks = [(torch.rand(k, generator=gen) > (0.3 if i % 5 else 1.0)).float() for i, k in enumerate(lengths)]
    return values, masks


def loop_sum_of_sample_mean(values, masks):
    """The per-sample loop these aggregations replaced (slime's form), as the reference."""
    total = torch.zeros(())
    for v, m in zip(values, masks, strict=True):
        total = total + (v * m).sum() / m.sum().clamp_min(1)
    return total


def loop_gspo_kl(log_probs, old_log_probs, masks):
    return [(((old - lp) * m).sum() / m.sum().clamp_min(1)).expand_as(lp)
            for lp, old, m in zip(log_probs, old_log_probs, masks, strict=True)]


def grads_of(values, total):
    return torch.autograd.grad(total, values, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_aggregations_equal_the_per_sample_loop(seed):
    values, masks = ragged(seed)
    expected = loop_sum_of_sample_mean(values, masks)
    got = alg.sum_of_sample_mean(values, masks)
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads_of(values, got), grads_of(values, expected), strict=True):
        torch.testing.assert_close(g, e)
    expected = sum(((v * m).sum() for v, m in zip(values, masks, strict=True)), torch.zeros(()))
    got = alg.sum_of_token(values, masks)
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads_of(values, got), grads_of(values, expected), strict=True):
        torch.testing.assert_close(g, e)
    old = [v.detach() + 0.1 * torch.randn(v.shape) for v in values]
    got_kl, expected_kl = alg.compute_gspo_kl(values, old, masks), loop_gspo_kl(values, old, masks)
    for g, e in zip(got_kl, expected_kl, strict=True):
        torch.testing.assert_close(g, e)
    weights = [torch.randn(v.shape) for v in values]  # a gradient through every token of the expanded means
    got = sum(((k * w).sum() for k, w in zip(got_kl, weights, strict=True)), torch.zeros(()))
    expected = sum(((k * w).sum() for k, w in zip(expected_kl, weights, strict=True)), torch.zeros(()))
    for g, e in zip(grads_of(values, got), grads_of(values, expected), strict=True):
        torch.testing.assert_close(g, e)


def loop_discounted_cumsum(values, gamma):
    out, running = torch.empty_like(values), values.new_zeros(())
    for i in range(values.numel() - 1, -1, -1):
        running = values[i] + gamma * running
        out[i] = running
    return out


def test_batched_returns_and_gae_equal_the_per_sample_loop():
    """REINFORCE++ returns and GAE over zero-padded rows give each sample's own values, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 12, (30,), generator=gen).tolist()
    rewards = torch.randn(30, generator=gen)
    kl = [torch.randn(n, generator=gen) for n in lengths]
    masks = [torch.ones(n) for n in lengths]
    masks[4][-1] = 0.0  # the reward lands on the last masked-in token
    got = alg.reinforce_plus_plus_returns(rewards, kl, masks, kl_coef=0.1, gamma=0.97)
    for i, (g, k, m) in enumerate(zip(got, kl, masks, strict=True)):
        token_rewards = -0.1 * (k * m)
        token_rewards[int(m.nonzero()[-1])] += rewards[i].item()
        assert torch.equal(g, loop_discounted_cumsum(token_rewards, 0.97))
    values = [torch.randn(n, generator=gen) for n in lengths]
    advantages, returns = alg.gae(alg.pad_rows(kl), alg.pad_rows(values), gamma=0.99, lambd=0.95)
    for a, r, k, v in zip(alg.unpad_rows(advantages, lengths), alg.unpad_rows(returns, lengths), kl, values,
                          strict=True):
        expected_a, expected_r = alg.gae(k, v, gamma=0.99, lambd=0.95)
        assert torch.equal(a, expected_a) and torch.equal(r, expected_r)


def test_log_probs_and_entropy_from_logits():
    logits = t(0.0, 0.0, math.log(2.0)).reshape(1, 3)  # probabilities 1/4, 1/4, 1/2
    close(alg.compute_log_probs(logits, torch.tensor([2])), [math.log(0.5)])
    close(alg.compute_entropy_from_logits(logits), [-(0.5 * math.log(0.25) + 0.5 * math.log(0.5))])


def _inputs(**kw):
    base = dict(rewards=t(1.0, 0.0), loss_masks=[t(1, 1), t(1, 1, 0)])
    return AdvantageInputs(**{**base, **kw})


def test_grpo_gspo_cispo_advantages_broadcast_normalised_rewards():
    for estimator in ("grpo", "gspo", "cispo"):
        out = compute_advantages(AlgorithmConfig(advantage_estimator=estimator), _inputs(), n_samples_per_prompt=2)
        a = 0.5 / (math.sqrt(0.5) + 1e-6)
        close(out.advantages[0], [a, a])
        close(out.advantages[1], [-a, -a, -a])
    plain = compute_advantages(AlgorithmConfig(disable_grpo_std_normalization=True), _inputs(), 2)
    close(plain.advantages[1], [-0.5, -0.5, -0.5])


def test_reinforce_plus_plus_is_whitened_over_masked_tokens():
    inputs = _inputs(log_probs=[t(0, 0), t(0, 0, 0)], ref_log_probs=[t(-0.1, -0.1), t(-0.1, -0.1, -0.1)])
    out = compute_advantages(AlgorithmConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.5), inputs, 2)
    # k1 = 0.1 per token, token rewards -0.05 on masked-in tokens (+ reward at the last one), 0 on the masked-out
    # one, summed backwards (gamma 1): s0 [0.9, 0.95], s1 [-0.1, -0.05, 0]; whitened over the 4 masked tokens
    raw = [0.9, 0.95, -0.1, -0.05, 0.0]
    masked = torch.tensor(raw[:4], dtype=torch.float64)
    expected = [(v - masked.mean()) / math.sqrt(masked.var().item() + 1e-8) for v in raw]
    close(torch.cat(out.advantages), expected)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    out = compute_advantages(AlgorithmConfig(advantage_estimator="reinforce_plus_plus_baseline"), _inputs(), 2)
    raw = torch.tensor([0.5, 0.5, -0.5, -0.5, -0.5], dtype=torch.float64)
    masked = raw[:4]
    close(torch.cat(out.advantages), (raw - masked.mean()) / math.sqrt(masked.var().item() + 1e-8))


def test_ppo_gae_with_values_and_returns():
    inputs = AdvantageInputs(rewards=t(1.0), loss_masks=[t(1, 1, 1)], values=[t(0.5, 0.6, 0.7)])
    out = compute_advantages(AlgorithmConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8), inputs, 1)
    close(out.advantages[0], [0.21712, 0.246, 0.3])
    close(out.returns[0], [0.71712, 0.846, 1.0])
    with pytest.raises(ValueError, match="values"):
        compute_advantages(AlgorithmConfig(advantage_estimator="ppo"), _inputs(), 2)


def test_normalize_advantages_whitens_grpo():
    out = compute_advantages(AlgorithmConfig(normalize_advantages=True, disable_grpo_std_normalization=True),
                             _inputs(), 2)
    masked = torch.tensor([0.5, 0.5, -0.5, -0.5], dtype=torch.float64)
    close(torch.cat(out.advantages)[:4], (masked - masked.mean()) / math.sqrt(masked.var().item() + 1e-8))
