"""On-policy distillation (slime's --use-opd): the reverse KL to a teacher as a penalty in the advantages, the
teacher's log-probs from the samples (--opd-type sglang) or from a teacher model the trainer runs (--opd-type
megatron: the torch backend loads it from --opd-teacher-load)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paths import DATA

from slimeflow.config.train import AlgorithmConfig, TrainConfig
from slimeflow.families.tiny import TinyModelSpec
from slimeflow.rollout.types import PackedBatch, Sample, Status, TrainBatch
from slimeflow.train.advantages import AdvantageInputs, compute_advantages
from slimeflow.train.backends.torch.backend import TorchBackend
from slimeflow.train.train_step import prepare, train_on_rollout

LENGTHS = [(7, 3), (9, 4), (5, 2), (12, 5)]


@pytest.fixture(scope="module")
def models(tiny_torch_dist) -> dict[str, Path]:
    """The student (HF) and two torch_dist teachers: the student's own weights, and another model's (converted once
    for the session, read-only)."""
    student = tiny_torch_dist(TinyModelSpec(seed=7))
    return {"student": student["hf"], "same": student["release"],
            "other": tiny_torch_dist(TinyModelSpec(seed=8))["release"]}


def make_batch(teacher: bool = False) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    return TrainBatch(tokens=[torch.randint(3, 250, (total,), generator=g) for total, _ in LENGTHS],
                      response_lengths=[n for _, n in LENGTHS], loss_masks=[torch.ones(n) for _, n in LENGTHS],
                      rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), group_indices=[0, 0, 1, 1],
                      teacher_log_probs=[-torch.rand(n, generator=g) for _, n in LENGTHS] if teacher else None)


def make_config(**algorithm) -> TrainConfig:
    return TrainConfig(batch={"rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 1},
                       algorithm=algorithm, optimizer={"lr": 1e-3})


def backend(models, config: TrainConfig) -> TorchBackend:
    return TorchBackend(models["student"], config.optimizer, config.algorithm, config.batch, seed=3, device="cpu")


@pytest.mark.parametrize("fields, message", [
    ({"use_opd": True}, "--use-opd needs --opd-type"),
    ({"use_opd": True, "opd_type": "megatron"}, "--opd-type megatron needs --opd-teacher-load"),
    ({"use_opd": True, "opd_type": "sglang", "opd_teacher_load": "/t"}, "is read only with --use-opd --opd-type megatron"),
    ({"opd_teacher_load": "/t"}, "is read only with --use-opd --opd-type megatron"),
])
def test_opd_flags_are_checked_as_slime_checks_them(fields, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(**fields)


@pytest.mark.parametrize("normalize", [False, True])
def test_the_reverse_kl_to_the_teacher_is_subtracted_from_the_advantages_before_whitening(normalize):
    g = torch.Generator().manual_seed(1)
    masks = [torch.ones(n) for _, n in LENGTHS]
    policy = [-torch.rand(n, generator=g) for _, n in LENGTHS]
    teacher = [-torch.rand(n, generator=g) for _, n in LENGTHS]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    plain = AlgorithmConfig(normalize_advantages=normalize)
    opd = AlgorithmConfig(normalize_advantages=normalize, use_opd=True, opd_type="sglang", opd_kl_coef=0.5)
    base = compute_advantages(AlgorithmConfig(), AdvantageInputs(rewards, masks, log_probs=policy), 2).advantages
    got = compute_advantages(opd, AdvantageInputs(rewards, masks, log_probs=policy, teacher_log_probs=teacher),
                             2).advantages
    expected = [a - 0.5 * (p - t) for a, p, t in zip(base, policy, teacher, strict=True)]
    if normalize:  # whitened after the penalty, as slime
        from slimeflow.train.advantages import whiten_batch

        expected = whiten_batch(expected, masks)
    for g_, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g_, e)
    assert compute_advantages(plain, AdvantageInputs(rewards, masks, log_probs=policy), 2).advantages[0].shape == \
        got[0].shape


def test_a_teacher_with_the_policys_weights_changes_nothing_and_another_teacher_pulls_towards_it(models):
    """--opd-type megatron: the trainer runs the teacher from --opd-teacher-load. The student's own checkpoint as
    teacher: reverse KL exactly 0, the same step as without OPD. Another model: advantages move by -coef x KL."""
    batch = make_batch()
    plain = make_config()
    same = make_config(use_opd=True, opd_type="megatron", opd_teacher_load=str(models["same"]), opd_kl_coef=0.7)
    other = make_config(use_opd=True, opd_type="megatron", opd_teacher_load=str(models["other"]), opd_kl_coef=0.7)
    shares = [list(range(len(batch)))]  # one optimizer step of every sample

    with_same = backend(models, same)
    prepared = prepare(with_same, batch, same, shares, 1)
    assert all(torch.equal(kl, torch.zeros_like(kl)) for kl in prepared.opd_reverse_kl)
    without = backend(models, plain)
    expected = train_on_rollout(without, batch, plain)
    got = train_on_rollout(with_same, batch, same)
    assert got["opd_reverse_kl"] == 0.0 and got["pg_loss"] == pytest.approx(expected["pg_loss"], abs=1e-7)
    weights, trained = with_same.named_weights(), without.named_weights()
    assert all(torch.allclose(weights[k], trained[k], atol=1e-7) for k in trained)

    with_other = backend(models, other)
    prepared = prepare(with_other, batch, other, shares, 1)
    base = prepare(backend(models, plain), batch, make_config(use_kl_loss=False), shares, 1)
    teacher = with_other.compute_log_probs(batch, teacher=True).log_probs
    assert not torch.allclose(torch.cat(teacher), torch.cat(prepared.old_log_probs))
    for got_, adv, old, t in zip(prepared.advantages, base.advantages, prepared.old_log_probs, teacher, strict=True):
        torch.testing.assert_close(got_, adv - 0.7 * (old - t))
    # slime's opd_reverse_kl: the mean over samples of each one's token mean (a k1 estimate: random tokens here, not
    # the policy's samples, so its sign is not that of the KL)
    expected = sum(float((old - t).mean()) for old, t in zip(prepared.old_log_probs, teacher, strict=True)) / 4
    assert train_on_rollout(with_other, batch, other)["opd_reverse_kl"] == pytest.approx(expected, abs=1e-6)


def test_sglang_teacher_log_probs_come_with_the_samples_and_their_absence_is_named(models):
    """--opd-type sglang: a reward post-process sets each sample's teacher_log_probs (slime's on_policy_distillation
    does it from a teacher server's input-token log-probs); they travel into the TrainBatch and the Ray hop."""
    samples = []
    for i, (total, n) in enumerate(LENGTHS):
        samples.append(Sample(group_index=i // 2, index=i, prompt="p", tokens=list(range(3, 3 + total)),
                              response_length=n, reward=float(i % 2), status=Status.COMPLETED,
                              teacher_log_probs=[-0.5] * n))
    batch = TrainBatch.from_samples(samples)
    assert [t.tolist() for t in batch.teacher_log_probs] == [[-0.5] * n for _, n in LENGTHS]
    unpacked = PackedBatch.pack(batch).unpack()
    assert [t.tolist() for t in unpacked.teacher_log_probs] == [[-0.5] * n for _, n in LENGTHS]
    assert [t.tolist() for t in batch.select([3, 0]).teacher_log_probs] == [[-0.5] * 5, [-0.5] * 3]

    config = make_config(use_opd=True, opd_type="sglang")
    student = backend(models, config)
    prepared = prepare(student, batch, config, [list(range(len(batch)))], 1)
    assert [kl.numel() for kl in prepared.opd_reverse_kl] == [n for _, n in LENGTHS]
    samples[1].teacher_log_probs = None
    with pytest.raises(ValueError, match="needs every sample's teacher_log_probs"):
        prepare(student, TrainBatch.from_samples(samples), config, [list(range(len(batch)))], 1)
    with pytest.raises(ValueError, match="teacher_log_probs has 2 entries, response_length is 4"):
        TrainBatch(tokens=batch.tokens, response_lengths=batch.response_lengths, loss_masks=batch.loss_masks,
                   rewards=batch.rewards, teacher_log_probs=[torch.zeros(3), torch.zeros(2), torch.zeros(2),
                                                             torch.zeros(5)])


def test_a_slime_post_process_storing_a_tensor_reaches_slimeflows_sample():
    """slime's post_process_rewards stores a float32 tensor in sample.teacher_log_probs."""
    from slimeflow.rollout.slime_plugins import returned_sample

    origin = Sample(group_index=0, index=0, prompt="p", tokens=[1, 2, 3], response_length=2)
    theirs = origin  # slime's Sample is slimeflow's: the post-process writes the rollout's own sample
    theirs.teacher_log_probs = torch.tensor([-0.25, -1.5])
    assert returned_sample(theirs, "post-process", origin).teacher_log_probs == [-0.25, -1.5]


def test_the_teachers_answer_is_kept_for_the_post_process_which_sets_teacher_log_probs(monkeypatch):
    """With --custom-reward-post-process-path a custom reward's dict answer stays whole until the post-process
    (slime's on_policy_distillation.post_process_rewards) turns it into teacher_log_probs and 0 rewards."""
    import asyncio

    from slimeflow import slime_compat
    from slimeflow.config.train import RewardConfig
    from slimeflow.rollout.rewards import RewardScorer
    from slimeflow.rollout.slime_rollout_hooks import post_process_rewards

    monkeypatch.syspath_prepend(str(DATA / "slime_plugins"))
    slime_compat.install()
    from slime.rollout.on_policy_distillation import post_process_rewards as opd_post_process

    samples = [Sample(group_index=0, index=i, prompt="p", tokens=[5, 6, 7, 8][: 2 + i], response_length=1 + i)
               for i in range(2)]
    scorer = RewardScorer(RewardConfig(custom_rm_path="slime_style_hooks:teacher_answer"), post_processed=True)
    try:
        asyncio.run(scorer.score_group(samples))
    finally:
        scorer.close()
    assert all(isinstance(s.reward, dict) and s.status is not Status.FAILED for s in samples)
    post_process_rewards(opd_post_process, None, [samples])
    assert [s.reward for s in samples] == [0.0, 0.0]
    assert samples[0].teacher_log_probs == [pytest.approx(-0.1)]
    assert samples[1].teacher_log_probs == [pytest.approx(-0.1), pytest.approx(-0.2)]
    # Without a post-process the dict must be a reward by itself: it has no reward/score key, so the sample fails.
    alone = Sample(group_index=0, index=0, prompt="p", tokens=[5, 6], response_length=1)
    unkept = RewardScorer(RewardConfig(custom_rm_path="slime_style_hooks:teacher_answer"))
    try:
        asyncio.run(unkept.score_group([alone]))
    finally:
        unkept.close()
    assert alone.status is Status.FAILED and "teacher_answer" in alone.failure_reason
