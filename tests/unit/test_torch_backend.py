"""The torch training backend on tiny models: log-probs, packing-invariant gradients, the step, the schedule, DP, bf16."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from paths import DATA

from slimeflow.config.train import OptimizerConfig, TrainConfig
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.rollout.types import TrainBatch
from slimeflow.train.backends.torch.backend import TorchBackend
from slimeflow.train.schedule import build_scheduler, lr_at
from slimeflow.train.train_step import Prepared, accumulate_gradients, train_on_rollout

LENGTHS = [(7, 3), (9, 4), (5, 2), (12, 5), (6, 3), (10, 1), (8, 4), (11, 6)]
"""(prompt + response tokens, response tokens) of the test rollout: 4 groups of 2."""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "hf", TinyModelSpec(seed=7))


def make_batch(rewards: list[float] | None = None, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, 250, (total,), generator=g) for total, _ in LENGTHS]
    masks = [torch.ones(n) for _, n in LENGTHS]
    masks[3][1] = 0.0  # a tool token inside a response
    rewards = rewards if rewards is not None else [float(i % 3 == 0) for i in range(len(LENGTHS))]
    return TrainBatch(tokens=tokens, response_lengths=[n for _, n in LENGTHS], loss_masks=masks,
                      rewards=torch.tensor(rewards), rollout_log_probs=[-torch.rand(n, generator=g) for _, n in LENGTHS])


def make_config(**groups) -> TrainConfig:
    batch = {"rollout_batch_size": 4, "n_samples_per_prompt": 2, "num_rollout": 1, **groups.pop("batch", {})}
    return TrainConfig(batch=batch, **groups)


def make_backend(hf_dir: Path, config: TrainConfig, **kwargs) -> TorchBackend:
    return TorchBackend(hf_dir, config.optimizer, config.algorithm, config.batch, seed=3, device="cpu", **kwargs)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_log_probs_equal_a_plain_hf_forward(hf_dir, temperature):
    """At the rollout temperature, as slime (and TRL) compute them: log_softmax(logits / temperature)."""
    from transformers import AutoModelForCausalLM

    config = make_config(batch={"micro_batch_size": 3})  # padded micro-batches of 3, 3 and 2 samples
    batch = make_batch()
    out = make_backend(hf_dir, config, temperature=temperature).compute_log_probs(batch, with_entropy=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for i, (tokens, n) in enumerate(zip(batch.tokens, batch.response_lengths, strict=True)):
        with torch.no_grad():
            logits = model(tokens[None]).logits[0, -n - 1 : -1] / temperature
        logp = torch.log_softmax(logits, -1)
        expected = logp.gather(-1, tokens[-n:, None])[:, 0]
        torch.testing.assert_close(out.log_probs[i], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.entropy[i], -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=1e-5)


def gradients(backend: TorchBackend, batch: TrainBatch, prepared: Prepared, config: TrainConfig) -> torch.Tensor:
    backend.optimizer.zero_grad(set_to_none=True)
    indices = list(range(len(batch)))
    accumulate_gradients(backend, batch, indices, indices, prepared, config)
    return torch.cat([p.grad.reshape(-1) for p in backend.model.parameters()])


@pytest.mark.parametrize("per_token", [False, True])
def test_packed_micro_batches_give_the_one_pass_gradients(hf_dir, per_token):
    algorithm = {"calculate_per_token_loss": per_token, "entropy_coef": 0.01}
    one = make_config(batch={"micro_batch_size": 8}, algorithm=algorithm)
    packed = make_config(batch={"use_dynamic_batch_size": True, "max_tokens_per_gpu": 20}, algorithm=algorithm)
    batch = make_batch()
    g = torch.Generator().manual_seed(1)
    prepared = Prepared(  # old log-probs off the current policy, so some ratios are clipped
        old_log_probs=[lp + 0.3 * torch.randn(lp.shape, generator=g)
                       for lp in make_backend(hf_dir, one).compute_log_probs(batch).log_probs],
        advantages=[torch.randn(n, generator=g) for n in batch.response_lengths], ref_log_probs=None)
    packed_backend = make_backend(hf_dir, packed)
    assert len(packed_backend.micro_batches(batch.total_lengths)) >= 4
    reference = gradients(make_backend(hf_dir, one), batch, prepared, one)
    got = gradients(packed_backend, batch, prepared, packed)
    assert reference.norm() > 0
    assert ((got - reference).norm() / reference.norm()).item() < 1e-6


def test_first_step_ppo_kl_is_exactly_zero_with_packed_micro_batches(hf_dir):
    """slime's gate under --use-dynamic-batch-size with two steps per rollout: the log-prob passes run the training
    steps' own micro-batches (packed step by step), so the first step's ppo_kl and kl_loss are exactly 0. Packing
    the rank's whole share at once, as the passes did before, groups these samples otherwise (checked): ppo_kl and
    kl_loss were -4e-8 and 4e-8."""
    from megatron_steps import train_steps

    config = make_config(batch={"use_dynamic_batch_size": True, "max_tokens_per_gpu": 24, "global_batch_size": 4},
                         optimizer={"lr": 1e-3}, algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1})
    batch = make_batch()
    backend = make_backend(hf_dir, config)
    lengths = batch.total_lengths
    per_step = [[start + i for i in micro] for start in (0, 4) for micro in backend.micro_batches(lengths[start:start + 4])]
    assert backend.micro_batches(lengths) != per_step
    first, second = train_steps(backend, batch, config, 0, 1)
    assert first["ppo_kl"] == 0.0 and first["kl_loss"] == 0.0 and first["pg_clipfrac"] == 0.0
    assert second["ppo_kl"] != 0.0  # the second step is off-policy: the gate is not vacuous
    with pytest.raises(ValueError, match="must hold each of the 8 samples once"):
        backend.compute_log_probs(batch, steps=[[[0, 1, 2, 3]], [[4, 5, 6]]])


def make_group_batch() -> TrainBatch:
    """Two prompts with four one-token responses each (two the same), and one sample whose tokens but the last
    equal a prompt while its response is two tokens long: a GRPO rollout of one-token answers, plus a near miss."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 250, (n,), generator=g) for n in (5, 7)]
    tokens = [torch.cat([p, torch.tensor([tok])]) for p in prompts for tok in (10, 11, 11, 12)]
    tokens.append(torch.cat([prompts[0], torch.tensor([13])]))
    lengths = [1] * 8 + [2]
    return TrainBatch(tokens=tokens, response_lengths=lengths, loss_masks=[torch.ones(n) for n in lengths],
                      rewards=torch.zeros(len(tokens)))


def test_samples_that_share_their_inputs_share_one_forward_row(hf_dir):
    from slimeflow.train.backends.common import distinct_rows

    batch = make_group_batch()
    firsts, row_of = distinct_rows(batch.tokens, batch.response_lengths)
    assert firsts == [0, 4, 8] and row_of.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    nine = {"rollout_batch_size": 3, "n_samples_per_prompt": 3}  # the 9 samples of make_group_batch
    shared, alone = make_config(batch={**nine, "micro_batch_size": 9}), make_config(batch={**nine, "micro_batch_size": 1})
    g = torch.Generator().manual_seed(3)
    prepared = Prepared(old_log_probs=None, ref_log_probs=None,
                        advantages=[torch.randn(n, generator=g) for n in batch.response_lengths])
    results = []
    for config in (shared, alone):
        backend = make_backend(hf_dir, config, temperature=1.5)
        out = backend.compute_log_probs(batch, with_entropy=True)
        results.append((torch.cat(out.log_probs), torch.cat(out.entropy), gradients(backend, batch, prepared, config)))
    (logp, entropy, grads), (logp_alone, entropy_alone, grads_alone) = results
    torch.testing.assert_close(logp, logp_alone, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, entropy_alone, atol=1e-6, rtol=1e-6)
    assert grads_alone.norm() > 0 and ((grads - grads_alone).norm() / grads_alone.norm()).item() < 1e-6


def response_log_prob(backend: TorchBackend, batch: TrainBatch, i: int) -> float:
    return backend.compute_log_probs(batch.select([i])).log_probs[0].sum().item()


def test_a_step_moves_the_policy_in_the_direction_of_the_advantage(hf_dir):
    config = make_config(batch={"rollout_batch_size": 1}, optimizer={"lr": 1e-3},
                         algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
                                    "use_tis": True})
    batch = make_batch().select([0, 1])
    batch.rewards = torch.tensor([1.0, 0.0])  # sample 0: positive advantage, sample 1: negative
    backend = make_backend(hf_dir, config)
    batch.rollout_log_probs = backend.compute_log_probs(batch).log_probs  # the engine agrees with the trainer
    before = [response_log_prob(backend, batch, i) for i in (0, 1)]
    metrics = train_on_rollout(backend, batch, config)
    after = [response_log_prob(backend, batch, i) for i in (0, 1)]
    assert after[0] > before[0] and after[1] < before[1]
    # First step: policy == old == reference, so ratio 1, no clipping, KL 0; lr is the peak (constant schedule).
    assert metrics["ppo_kl"] == pytest.approx(0, abs=1e-6) and metrics["pg_clipfrac"] == 0
    assert metrics["kl_loss"] == pytest.approx(0, abs=1e-6) and metrics["lr"] == 1e-3
    assert metrics["tis"] == pytest.approx(1.0) and metrics["tis_clipfrac"] == 0
    assert {"pg_loss", "entropy", "grad_norm", "train_tokens_per_s"} <= set(metrics)
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0


def test_lr_schedule_follows_megatron():
    linear = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_style="linear", lr_decay_iters=10)
    assert [lr_at(linear, s) for s in (0, 1, 2)] == [0.0, 0.5, 1.0]  # warm-up from 0
    assert lr_at(linear, 6) == pytest.approx(0.1 + 0.5 * 0.9)
    assert lr_at(linear, 10) == pytest.approx(0.1) and lr_at(linear, 50) == 0.1  # min_lr after the decay
    cosine = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_style="cosine")
    assert lr_at(cosine, 4, total_steps=10) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(cosine, 6, total_steps=10) == pytest.approx(0.55)
    assert lr_at(OptimizerConfig(lr=0.3), 1000) == 0.3
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        lr_at(OptimizerConfig(lr_decay_style="linear"), 5)
    # The scheduler the backend steps gives the same values, one per optimizer step.
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, cosine, total_steps=10)
    seen = []
    for _ in range(12):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([lr_at(cosine, s, 10) for s in range(12)])


def test_warm_up_without_decay_steps_runs_in_megatrons_scheduler_and_a_too_long_one_is_refused():
    """--lr-warmup-iters with the constant schedule and no decay steps known: megatron-core's scheduler (which needs
    warm-up < decay) gets decay steps after the warm-up, and gives lr_at's values; a decaying schedule whose warm-up
    outlasts its decay is refused by both backends with the flags to change (megatron-core only asserts)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from slimeflow.train.schedule import schedule_steps

    constant = OptimizerConfig(lr=1.0, lr_warmup_iters=5)
    warmup, decay = schedule_steps(constant, None)
    assert (warmup, decay) == (5, 6)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=warmup,
                                        lr_decay_steps=decay, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=1, wd_incr_style="constant")
    seen = []
    for _ in range(9):
        seen.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    assert seen == pytest.approx([lr_at(constant, s) for s in range(9)])
    too_long = OptimizerConfig(lr_warmup_iters=10, lr_decay_style="cosine")
    for make in (lambda: schedule_steps(too_long, 10), lambda: build_scheduler(optimizer, too_long, 10)):
        with pytest.raises(ValueError, match="10 warm-up steps .* not fewer than the 10 decay steps"):
            make()


DP_CONFIG = {"batch": {"balance_data": True, "micro_batch_size": 2, "global_batch_size": 4}, "optimizer": {"lr": 1e-3}}


def _dp_rank(rank: int, hf_dir: Path, init_method: str, out: Path) -> None:
    torch.set_num_threads(1)
    backend = make_backend(hf_dir, make_config(**DP_CONFIG), rank=rank, world_size=2, init_method=init_method)
    try:
        metrics = train_on_rollout(backend, make_batch(), make_config(**DP_CONFIG), rank=rank, world_size=2)
        torch.save({"weights": backend.named_weights(), "metrics": metrics}, out / f"rank{rank}.pt")
    finally:
        backend.close()


def test_two_data_parallel_ranks_equal_one_process(hf_dir, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_dp_rank, args=(hf_dir, (tmp_path / "rendezvous").as_uri(), tmp_path), nprocs=2, join=True)
    config = make_config(**DP_CONFIG)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: MKL's sums round differently with another thread count
    try:
        single = make_backend(hf_dir, config)
        metrics = train_on_rollout(single, make_batch(), config)
    finally:
        torch.set_num_threads(threads)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    initial = make_backend(hf_dir, config).named_weights()
    for name, weight in single.named_weights().items():
        for rank in ranks:
            torch.testing.assert_close(rank["weights"][name], weight, atol=1e-6, rtol=0)
    assert any(not torch.equal(w, initial[n]) for n, w in single.named_weights().items())
    for key in ("pg_loss", "entropy", "grad_norm", "lr"):
        assert ranks[0]["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7)


def test_bf16_trains_under_autocast(hf_dir):
    config = make_config(optimizer={"bf16": True, "lr": 1e-3})
    backend = make_backend(hf_dir, config)
    batch = make_batch()
    bf16 = backend.compute_log_probs(batch).log_probs
    fp32 = make_backend(hf_dir, make_config()).compute_log_probs(batch).log_probs
    assert any(not torch.equal(a, b) for a, b in zip(bf16, fp32, strict=True))  # computed in bf16 ...
    for a, b in zip(bf16, fp32, strict=True):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0)  # ... and close to fp32
    before = response_log_prob(backend, batch, 0)
    metrics = train_on_rollout(backend, batch, config)
    assert all(math.isfinite(v) for v in metrics.values())
    assert response_log_prob(backend, batch, 0) != before


def test_rollout_data_postprocess_runs_on_the_torch_backend_and_its_masks_are_trained_on(hf_dir, monkeypatch):
    """slime's --rollout-data-postprocess-path (tests/data/slime_plugins/slime_megatron_hooks.py) on the torch
    backend: called once with the rollout id and slime's rollout_data, after the log-probs; it zeroes every loss
    mask, so the step has no gradient at all (without it this batch's grad_norm is 1.9)."""
    from slimeflow.train.train_hooks import TrainHooks
    from slimeflow.train.train_step import train_on_rollout

    monkeypatch.syspath_prepend(str(DATA / "slime_plugins"))
    import slime_megatron_hooks as plugin

    plugin.CALLS.clear()
    config = make_config(train_hooks={"rollout_data_postprocess_path": "slime_megatron_hooks:mask_everything"})
    hooks = TrainHooks.load(config)
    metrics = train_on_rollout(make_backend(hf_dir, config), make_batch(), config, rollout_id=4, hooks=hooks)
    assert plugin.CALLS == [("postprocess", 4, ["advantages", "loss_masks", "partition", "response_lengths",
                                                "returns", "rewards", "rollout_log_probs", "tokens", "total_lengths"])]
    assert metrics["grad_norm"] == 0.0
