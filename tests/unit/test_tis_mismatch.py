"""TIS with --tis-clip-low, --get-mismatch-metrics and --use-rollout-logprobs as slime's policy loss computes them,
a custom TIS function, and the critic flags refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from slimeflow.config.pipeline import load_stage_config
from slimeflow.config.train import AlgorithmConfig, TrainConfig
from slimeflow.errors import ConfigError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.rollout.types import TrainBatch
from slimeflow.train.backends.torch.backend import TorchBackend
from slimeflow.train.loss import LossInputs, LossNormalizer, compute_loss
from slimeflow.train.train_step import train_on_rollout


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def hand_batch(**overrides) -> LossInputs:
    """Two samples, trainer's old log-probs 0: pi / pi_old = s0 [1.5, 0.5] (A = 1), s1 [1, 0.5, 2] (A = -2).
    Per-token PPO losses (eps 0.2 / 0.28): s0 [-1.28, -0.5], s1 [2, 1.6, 4]."""
    base = dict(log_probs=[torch.log(t(1.5, 0.5)), torch.log(t(1.0, 0.5, 2.0))], old_log_probs=[t(0, 0), t(0, 0, 0)],
                advantages=[t(1, 1), t(-2, -2, -2)], loss_masks=[t(1, 1), t(1, 1, 1)])
    return LossInputs(**{**base, **overrides})


# pi_train_old / pi_rollout = s0 [1, 3], s1 [0.25, 1, 1]
ROLLOUT = [t(0, -math.log(3)), t(math.log(4), 0, 0)]


def run(inputs: LossInputs, tis_function=None, **algorithm):
    config = AlgorithmConfig(eps_clip_high=0.28, **algorithm)
    return compute_loss(config, inputs, LossNormalizer.for_batch(inputs.loss_masks), tis_function=tis_function)


def approx(value: torch.Tensor, expected: float) -> None:
    assert value.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


MISMATCH = {  # per-sample means, then the mean over the 2 samples
    "tis": ((1 + 3) / 2 + (0.25 + 1 + 1) / 3) / 2,
    "tis_abs": ((0 + 2) / 2 + (0.75 + 0 + 0) / 3) / 2,
    "ois": ((1.5 + 0.5) / 2 + (1 + 0.5 + 2) / 3) / 2,
}


def test_tis_weights_clip_to_tis_clip_low_and_tis_clip():
    out = run(hand_batch(rollout_log_probs=ROLLOUT), use_tis=True, tis_clip=2.0, tis_clip_low=0.5)
    # weights s0 [1, 2], s1 [0.5, 1, 1]
    approx(out.loss, ((-1.28 - 0.5 * 2) / 2 + (2 * 0.5 + 1.6 + 4) / 3) / 2)
    approx(out.metrics["tis_clipfrac"], ((0 + 1) / 2 + (1 + 0 + 0) / 3) / 2)  # clipped either side
    for key, value in MISMATCH.items():
        approx(out.metrics[key], value)
    no_low = run(hand_batch(rollout_log_probs=ROLLOUT), use_tis=True, tis_clip=2.0)  # slime's default 0
    approx(no_low.loss, ((-1.28 - 0.5 * 2) / 2 + (2 * 0.25 + 1.6 + 4) / 3) / 2)
    approx(no_low.metrics["tis_clipfrac"], ((0 + 1) / 2) / 2)


def test_get_mismatch_metrics_reports_without_reweighting_the_loss():
    plain = run(hand_batch())
    out = run(hand_batch(rollout_log_probs=ROLLOUT), get_mismatch_metrics=True, tis_clip=2.0, tis_clip_low=0.5)
    approx(out.loss, plain.loss.item())
    for key, value in MISMATCH.items():
        approx(out.metrics[key], value)
    assert "tis" not in plain.metrics and "ois" not in plain.metrics
    with pytest.raises(ValueError, match="--get-mismatch-metrics need the rollout engine's log-probs"):
        run(hand_batch(), get_mismatch_metrics=True)


def test_use_rollout_logprobs_makes_the_engine_the_old_policy():
    rollout = [torch.log(t(1.5, 0.5)), t(0, 0, 0)]  # s0: the engine had the current policy; ratio 1
    out = run(hand_batch(rollout_log_probs=rollout), use_rollout_logprobs=True)
    approx(out.loss, ((-1 - 1) / 2 + (2 + 1.6 + 4) / 3) / 2)
    approx(out.metrics["ppo_kl"], (0 + (0 - math.log(0.5) - math.log(2)) / 3) / 2)
    # slime compares the current log-probs with the engine's then: s0 0, s1 [0, log 2, log 2]
    approx(out.metrics["train_rollout_logprob_abs_diff"], (0 + 2 * math.log(2) / 3) / 2)
    with pytest.raises(ValueError, match="--use-rollout-logprobs needs the rollout engine's log-probs"):
        run(hand_batch(), use_rollout_logprobs=True)


def reject_above_two(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                     response_lengths):
    """A rejection-sampling TIS function (slime's contract): tokens with ratio > 2 are masked out."""
    ratios = [torch.exp(tr - ro) for tr, ro in zip(train_log_probs, rollout_log_probs, strict=True)]
    masks = [m * (r <= 2) for m, r in zip(loss_masks, ratios, strict=True)]
    assert response_lengths == [2, 3] and total_lengths == [5, 7]
    return pg_loss, masks, {"rejected": torch.cat([(r > 2).double() for r in ratios])}


def test_a_tis_function_that_rejects_tokens_keeps_the_original_normaliser():
    out = run(hand_batch(rollout_log_probs=ROLLOUT, total_lengths=[5, 7]), tis_function=reject_above_two,
              use_tis=True)
    approx(out.metrics["pg_loss"], ((-1.28 + 0) / 2 + (2 + 1.6 + 4) / 3) / 2)  # s0's rejected token: 0 of 2
    approx(out.metrics["rejected"], (1 / 2 + 0) / 2)  # metrics over the original masks, as slime


TRAIN = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1"]


def test_the_flags_parse_and_bad_combinations_are_refused():
    algo = load_stage_config("train", None, [*TRAIN, "--use-tis", "--tis-clip-low", "0.5", "--tis-clip", "3",
                                             "--get-mismatch-metrics"]).algorithm
    assert (algo.tis_clip_low, algo.tis_clip, algo.get_mismatch_metrics) == (0.5, 3.0, True)
    assert load_stage_config("train", None, [*TRAIN, "--use-rollout-logprobs"]).algorithm.use_rollout_logprobs
    with pytest.raises(ConfigError, match="--use-rollout-logprobs and --use-tis together"):
        load_stage_config("train", None, [*TRAIN, "--use-rollout-logprobs", "--use-tis"])
    with pytest.raises(ConfigError, match="--tis-clip-low 3.0 is above --tis-clip 2.0"):
        load_stage_config("train", None, [*TRAIN, "--tis-clip-low", "3"])


@pytest.mark.parametrize("flag, reason", [
    (["--use-critic"], "PPO with a critic is not built yet"),
    (["--value-clip", "0.2"], "value loss clipped by --value-clip"),
    (["--num-critic-only-steps", "2"], "PPO with a critic is not built yet"),
    (["--critic-lr", "1e-5"], "PPO with a critic is not built yet"),
    (["--opd-teacher-ckpt-step", "3"], "name its iter_XXXXXXX/ directory in --opd-teacher-load"),
])
def test_critic_flags_are_refused_by_name_at_parse(flag, reason):
    with pytest.raises(ConfigError) as err:
        load_stage_config("train", None, [*TRAIN, *flag])
    assert f"{flag[0]}: not supported yet" in str(err.value) and reason in str(err.value)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "hf", TinyModelSpec(seed=7))


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    lengths = [(7, 3), (9, 4), (5, 2), (8, 4)]
    masks = [torch.ones(n) for _, n in lengths]
    masks[1][1] = 0.0
    return TrainBatch(tokens=[torch.randint(3, 250, (total,), generator=g) for total, _ in lengths],
                      response_lengths=[n for _, n in lengths], loss_masks=masks, rewards=torch.tensor([1., 0, 0, 1]))


@pytest.mark.slow  # builds a tiny model (~4 s, ~12 s on a loaded machine) and trains it a few times
def test_torch_backend_trains_with_the_engines_log_probs_and_reports_the_mismatch(hf_dir):
    """The engine's log-probs are the trainer's shifted by -0.1 per token, so every ratio and metric is known."""
    def train(**algorithm) -> tuple[dict[str, float], int]:
        config = TrainConfig(batch={"rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 1},
                             optimizer={"lr": 1e-4}, algorithm=algorithm)
        backend = TorchBackend(hf_dir, config.optimizer, config.algorithm, config.batch, seed=3, device="cpu")
        batch = _batch()
        batch.rollout_log_probs = [lp - 0.1 for lp in backend.compute_log_probs(batch).log_probs]
        calls = []
        forward = backend.compute_log_probs
        backend.compute_log_probs = lambda *a, **k: calls.append(1) or forward(*a, **k)  # count old-log-prob passes
        return train_on_rollout(backend, batch, config), len(calls)

    metrics, passes = train(use_rollout_logprobs=True, advantage_estimator="reinforce_plus_plus",
                            normalize_advantages=True)
    assert passes == 0  # slime: no recompute of the old log-probs
    assert metrics["ppo_kl"] == pytest.approx(-0.1, abs=1e-5)  # old (engine) - current
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(0.1, abs=1e-5)
    metrics, passes = train(get_mismatch_metrics=True)
    # --custom-pg-loss-reducer-function-path (slime's signature) reduces the backend's pg_loss, and only it
    doubled, _ = train(get_mismatch_metrics=True, custom_pg_loss_reducer_function_path="test_tis_mismatch:doubled")
    assert doubled["pg_loss"] == pytest.approx(2 * metrics["pg_loss"], rel=1e-6)
    assert doubled["pg_clipfrac"] == metrics["pg_clipfrac"] and doubled["tis"] == metrics["tis"]
    assert passes == 0  # one optimizer step, grpo: the training forward's log-probs are the old ones
    assert metrics["ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["tis"] == pytest.approx(math.exp(0.1), abs=1e-5)
    assert metrics["tis_abs"] == pytest.approx(math.exp(0.1) - 1, abs=1e-5)
    assert metrics["ois"] == pytest.approx(1.0, abs=1e-6) and metrics["tis_clipfrac"] == 0
    # --custom-tis-function-path (slime's contract) replaces the vanilla TIS in the backend's train step
    metrics, _ = train(use_tis=True, custom_tis_function_path="test_tis_mismatch:halve_and_count")
    assert metrics["halved"] == 1.0 and [n for lengths in HALVED for n in lengths] == [3, 4, 2, 4]  # a call a micro-batch
    assert metrics["pg_loss"] == pytest.approx(0.5 * train(use_tis=True, tis_clip=10.0)[0]["pg_loss"] / math.exp(0.1),
                                               rel=1e-4)


HALVED: list[list[int]] = []


def halve_and_count(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                    response_lengths):
    """A custom TIS function (slime's keywords): weight 0.5 on every token, its calls recorded."""
    HALVED.append(list(response_lengths))
    return pg_loss * 0.5, loss_masks, {"halved": torch.ones_like(pg_loss)}


def doubled(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """A pg-loss reducer (slime's signature): twice slime's default sum of sample means."""
    def reduce(x):
        parts = x.split(response_lengths, dim=0)
        return 2 * sum((x_i * m).sum() / torch.clamp_min(m.sum(), 1) for x_i, m in zip(parts, loss_masks, strict=True))

    return reduce
