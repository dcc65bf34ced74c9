"""The assembled loss: hand-computed values and metrics, edge cases, and invariance under packing."""

from __future__ import annotations

import math

import pytest
import torch
from paths import ROOT

from slimeflow.config.train import AlgorithmConfig
from slimeflow.errors import PluginError
from slimeflow.train.loss import LossInputs, LossNormalizer, compute_loss, load_custom_loss
from slimeflow.train.packing import pack_micro_batches


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def hand_batch(**overrides) -> LossInputs:
    """Two samples with old log-probs 0, so ratio = exp(log_probs): s0 ratios 1.5, 0.5 (A = 1); s1 1, 0.5, 2 (A = -2)."""
    base = dict(
        log_probs=[torch.log(t(1.5, 0.5)), torch.log(t(1.0, 0.5, 2.0))],
        old_log_probs=[t(0, 0), t(0, 0, 0)],
        advantages=[t(1, 1), t(-2, -2, -2)],
        loss_masks=[t(1, 1), t(1, 1, 1)],
    )
    return LossInputs(**{**base, **overrides})


def run(config: AlgorithmConfig, inputs: LossInputs):
    return compute_loss(config, inputs, LossNormalizer.for_batch(inputs.loss_masks))


def approx(value: torch.Tensor, expected: float) -> None:
    assert value.item() == pytest.approx(expected, rel=1e-6, abs=1e-12)


# Per-token losses (eps 0.2 / 0.28): s0 [-1.28, -0.5] clipfrac [1, 0]; s1 [2, 1.6, 4] clipfrac [0, 1, 0].
def test_policy_loss_per_sample_and_per_token():
    out = run(AlgorithmConfig(eps_clip_high=0.28), hand_batch())
    approx(out.loss, ((-1.28 - 0.5) / 2 + (2 + 1.6 + 4) / 3) / 2)
    approx(out.metrics["pg_clipfrac"], (0.5 + 1 / 3) / 2)
    approx(out.metrics["ppo_kl"], (-(math.log(1.5) + math.log(0.5)) / 2 - (math.log(0.5) + math.log(2)) / 3) / 2)
    per_token = run(AlgorithmConfig(eps_clip_high=0.28, calculate_per_token_loss=True), hand_batch())
    approx(per_token.loss, (-1.28 - 0.5 + 2 + 1.6 + 4) / 5)
    approx(per_token.metrics["pg_clipfrac"], 2 / 5)


def test_dual_clip():
    out = run(AlgorithmConfig(eps_clip_high=0.28, eps_clip_c=1.5), hand_batch())
    approx(out.loss, ((-1.28 - 0.5) / 2 + (2 + 1.6 + 3) / 3) / 2)  # s1 t2: min(4, 1.5 x 2)


def test_tis_weights_and_metrics():
    rollout = [t(0, -math.log(3)), t(0, 0, 0)]  # pi_old / pi_rollout = 1, 3 | 1, 1, 1
    out = run(AlgorithmConfig(eps_clip_high=0.28, use_tis=True, tis_clip=2.0), hand_batch(rollout_log_probs=rollout))
    approx(out.loss, ((-1.28 - 0.5 * 2) / 2 + (2 + 1.6 + 4) / 3) / 2)
    approx(out.metrics["tis"], (2 + 1) / 2)
    approx(out.metrics["tis_clipfrac"], (0.5 + 0) / 2)
    with pytest.raises(ValueError, match="--use-tis / --get-mismatch-metrics need the rollout engine's log-probs"):
        run(AlgorithmConfig(use_tis=True), hand_batch())


def test_train_rollout_logprob_abs_diff_is_the_masked_mean_drift_and_changes_no_loss():
    # The engine's log-probs against the trainer's old ones (0): |drift| s0 [0.5, 2.0], s1 [0.1, 0.3 (masked), 0.2].
    rollout = [t(0.5, -2.0), t(-0.1, 0.3, 0.2)]
    masks = [t(1, 1), t(1, 0, 1)]
    plain = run(AlgorithmConfig(eps_clip_high=0.28), hand_batch(loss_masks=masks))
    out = run(AlgorithmConfig(eps_clip_high=0.28), hand_batch(loss_masks=masks, rollout_log_probs=rollout))
    approx(out.metrics["train_rollout_logprob_abs_diff"], ((0.5 + 2.0) / 2 + (0.1 + 0.2) / 2) / 2)
    approx(out.loss, plain.loss.item())  # a metric only: without --use-tis the engine's log-probs weight nothing
    assert "train_rollout_logprob_abs_diff" not in plain.metrics
    per_token = run(AlgorithmConfig(calculate_per_token_loss=True), hand_batch(loss_masks=masks,
                                                                              rollout_log_probs=rollout))
    approx(per_token.metrics["train_rollout_logprob_abs_diff"], (0.5 + 2.0 + 0.1 + 0.2) / 4)


def test_kl_loss_and_entropy_terms():
    inputs = hand_batch()
    inputs.ref_log_probs = [lp - 0.1 for lp in inputs.log_probs]  # k1 = 0.1 on every token
    inputs.entropy = [t(0.5, 0.5), t(1.0, 1.0, 1.0)]
    config = AlgorithmConfig(eps_clip_high=0.28, use_kl_loss=True, kl_loss_coef=0.2, entropy_coef=0.01)
    out = run(config, inputs)
    pg = ((-1.28 - 0.5) / 2 + (2 + 1.6 + 4) / 3) / 2
    approx(out.metrics["kl_loss"], 0.1)
    approx(out.metrics["entropy"], 0.75)
    approx(out.loss, pg - 0.01 * 0.75 + 0.2 * 0.1)


def test_at_entropy_coef_0_the_entropy_is_a_metric_and_out_of_the_loss():
    inputs = hand_batch()
    inputs.log_probs = [lp.requires_grad_() for lp in inputs.log_probs]
    inputs.entropy = [t(0.5, 0.5).requires_grad_(), t(1.0, 1.0, 1.0).requires_grad_()]
    out = run(AlgorithmConfig(eps_clip_high=0.28), inputs)
    approx(out.metrics["entropy"], 0.75)
    out.loss.backward()
    assert all(e.grad is None for e in inputs.entropy)  # nothing flows back through the entropy (its [T, V] backward)


def test_gspo_uses_the_sequence_ratio():
    out = run(AlgorithmConfig(advantage_estimator="gspo", eps_clip=1.0, eps_clip_high=1.0), hand_batch())
    r0 = math.sqrt(1.5 * 0.5)  # exp(mean log ratio)
    r1 = (1.0 * 0.5 * 2.0) ** (1 / 3)
    approx(out.loss, (-r0 + 2 * r1) / 2)


def test_cispo_loss():
    out = run(AlgorithmConfig(advantage_estimator="cispo", eps_clip_high=0.28), hand_batch())
    s0 = (-1.28 * math.log(1.5) - 0.8 * math.log(0.5)) / 2
    s1 = (2 * 0 + 2 * 0.8 * math.log(0.5) + 2 * 1.28 * math.log(2.0)) / 3
    approx(out.loss, (s0 + s1) / 2)


def test_sft_loss():
    out = run(AlgorithmConfig(loss_type="sft_loss"), hand_batch(loss_masks=[t(1, 0), t(1, 1, 1)]))
    approx(out.loss, (-math.log(1.5) - (math.log(1.0) + math.log(0.5) + math.log(2.0)) / 3) / 2)


def test_zero_length_and_fully_masked_samples():
    inputs = hand_batch(log_probs=[*hand_batch().log_probs, t()], old_log_probs=[*hand_batch().old_log_probs, t()],
                        advantages=[*hand_batch().advantages, t()], loss_masks=[t(0, 0), t(1, 1, 1), t()])
    out = run(AlgorithmConfig(eps_clip_high=0.28), inputs)
    approx(out.loss, (0 + (2 + 1.6 + 4) / 3 + 0) / 3)  # they add 0 and still count as samples
    masked = hand_batch(loss_masks=[t(0, 0), t(0, 0, 0)])
    approx(run(AlgorithmConfig(), masked).loss, 0.0)
    with pytest.raises(ValueError, match="per-token mean is undefined"):
        run(AlgorithmConfig(calculate_per_token_loss=True), masked)


def custom_loss(config, inputs, reduce):
    """A custom loss built from the public pieces: plain REINFORCE on the masked tokens."""
    from slimeflow.train.algorithms import compute_approx_kl
    pg = reduce([-a * lp for a, lp in zip(inputs.advantages, inputs.log_probs, strict=True)])
    kl = reduce([compute_approx_kl(lp, old, "k3") for lp, old in zip(inputs.log_probs, inputs.old_log_probs,
                                                                        strict=True)])
    return pg + 0.1 * kl, {"pg_loss": pg, "kl": kl}


def test_custom_loss_through_its_plugin_path():
    config = AlgorithmConfig(loss_type="custom_loss", custom_loss_function_path=f"{__name__}:custom_loss")
    inputs = hand_batch()
    out = compute_loss(config, inputs, LossNormalizer.for_batch(inputs.loss_masks), load_custom_loss(config))
    pg = (-(math.log(1.5) + math.log(0.5)) / 2 + 2 * (math.log(0.5) + math.log(2.0)) / 3) / 2
    approx(out.metrics["pg_loss"], pg)
    assert set(out.metrics) == {"pg_loss", "kl"}
    bad = AlgorithmConfig(loss_type="custom_loss", custom_loss_function_path=f"{__name__}:no_such_loss")
    with pytest.raises(PluginError, match="no_such_loss"):
        load_custom_loss(bad)


class TinyPolicy(torch.nn.Module):
    """Token -> logits; each sample's log-probs depend on its own tokens only, as with per-sample attention."""

    def __init__(self, vocab: int = 11, hidden: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden, dtype=torch.float64)
        self.head = torch.nn.Linear(hidden, vocab, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        from slimeflow.train.algorithms import compute_entropy_from_logits, compute_log_probs
        logits = self.head(torch.tanh(self.embed(tokens[:-1]).cumsum(0)))[-response_length:]
        target = tokens[-response_length:]
        return compute_log_probs(logits, target), compute_entropy_from_logits(logits)


@pytest.fixture(scope="module")
def random_batch():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(12):
        prompt_len, response_len = int(torch.randint(2, 6, (1,), generator=gen)), int(torch.randint(1, 20, (1,), generator=gen))
        tokens = torch.randint(0, 11, (prompt_len + response_len,), generator=gen)
        mask = (torch.rand(response_len, generator=gen) > 0.2).double()
        if i == 3:
            mask.zero_()  # a fully masked sample
        samples.append(dict(
            tokens=tokens, response_length=response_len, loss_mask=mask,
            old=-torch.rand(response_len, generator=gen, dtype=torch.float64),
            ref=-torch.rand(response_len, generator=gen, dtype=torch.float64),
            rollout=-torch.rand(response_len, generator=gen, dtype=torch.float64),
            advantage=torch.full((response_len,), float(torch.randn(1, generator=gen)), dtype=torch.float64),
        ))
    return samples


def loss_and_grads(config: AlgorithmConfig, samples, micro_batches: list[list[int]]):
    torch.manual_seed(1)
    model = TinyPolicy()
    normalizer = LossNormalizer.for_batch([s["loss_mask"] for s in samples])
    total, metrics = 0.0, {}
    for micro in micro_batches:
        picked = [samples[i] for i in micro]
        outputs = [model(s["tokens"], s["response_length"]) for s in picked]
        inputs = LossInputs(
            log_probs=[lp for lp, _ in outputs], entropy=[e for _, e in outputs],
            old_log_probs=[s["old"] for s in picked], advantages=[s["advantage"] for s in picked],
            loss_masks=[s["loss_mask"] for s in picked], ref_log_probs=[s["ref"] for s in picked],
            rollout_log_probs=[s["rollout"] for s in picked],
        )
        out = compute_loss(config, inputs, normalizer)
        out.loss.backward()
        total += out.loss.item()
        for key, value in out.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value.item()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return total, metrics, grads


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
def test_loss_and_gradients_do_not_change_with_packing(random_batch, per_token, estimator):
    config = AlgorithmConfig(advantage_estimator=estimator, calculate_per_token_loss=per_token, eps_clip_c=3.0,
                             use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl", entropy_coef=0.01,
                             use_tis=True)
    n = len(random_batch)
    lengths = [int(s["tokens"].numel()) for s in random_batch]
    packed = pack_micro_batches(lengths, max_tokens=30)
    assert 1 < len(packed) < n
    one_pass = loss_and_grads(config, random_batch, [list(range(n))])
    for split in ([[i] for i in range(n)], packed):
        total, metrics, grads = loss_and_grads(config, random_batch, split)
        assert total == pytest.approx(one_pass[0], rel=1e-6)
        assert metrics == pytest.approx(one_pass[1], rel=1e-6, abs=1e-12)
        torch.testing.assert_close(grads, one_pass[2], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_the_reducer_equals_the_per_sample_loop(per_token):
    """The reducer's per-token weights (called on per-sample tensors or on the flat tokens) give the values and
    gradients of slime's loop over samples, on ragged samples with zero-length and fully masked ones."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 9, (50,), generator=gen).tolist()
    masks = [(torch.rand(k, generator=gen) > (0.3 if i % 7 else 1.0)).float() for i, k in enumerate(lengths)]
    values = [torch.randn(k, generator=gen).requires_grad_() for k in lengths]
    normalizer = LossNormalizer(num_samples=64, num_tokens=float(sum(m.sum() for m in masks)) + 5)
    expected = torch.zeros(())
    for v, m in zip(values, masks, strict=True):
        expected = expected + ((v * m).sum() if per_token else (v * m).sum() / m.sum().clamp_min(1))
    expected = expected / (normalizer.num_tokens if per_token else normalizer.num_samples)
    reduce = normalizer.reducer(masks, per_token)
    expected_grads = torch.autograd.grad(expected, values, allow_unused=True, materialize_grads=True)
    for got in (reduce(values), reduce.flat(torch.cat(values))):
        torch.testing.assert_close(got, expected)
        grads = torch.autograd.grad(got, values, allow_unused=True, materialize_grads=True)
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e)


def test_the_documented_custom_loss_runs_and_is_packing_invariant(random_batch):
    doc = (ROOT / "docs" / "rl-api.md").read_text()
    section = doc.split("## A custom loss", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/rl-api.md", "exec"), namespace)
    custom = namespace["clipped_reinforce"]
    config = AlgorithmConfig(loss_type="custom_loss", custom_loss_function_path="docs.example:clipped_reinforce")

    def run_custom(micro_batches):
        torch.manual_seed(1)
        model = TinyPolicy()
        normalizer = LossNormalizer.for_batch([s["loss_mask"] for s in random_batch])
        total = 0.0
        for micro in micro_batches:
            picked = [random_batch[i] for i in micro]
            inputs = LossInputs(log_probs=[model(s["tokens"], s["response_length"])[0] for s in picked],
                                old_log_probs=[s["old"] for s in picked], advantages=[s["advantage"] for s in picked],
                                loss_masks=[s["loss_mask"] for s in picked])
            out = compute_loss(config, inputs, normalizer, custom)
            out.loss.backward()
            total += out.loss.item()
        assert set(out.metrics) == {"pg_loss", "pg_clipfrac", "kl"}
        return total, torch.cat([p.grad.flatten() for p in model.parameters()])

    n = len(random_batch)
    whole, whole_grads = run_custom([list(range(n))])
    single, single_grads = run_custom([[i] for i in range(n)])
    assert single == pytest.approx(whole, rel=1e-6)
    torch.testing.assert_close(single_grads, whole_grads, rtol=1e-6, atol=1e-12)
