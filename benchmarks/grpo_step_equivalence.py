"""slimeflow's RL update vs TRL's GRPOTrainer update, step by step on identical rollout batches.

loop_bench.py's setting (the demo's tiny Llama and increment task, 16 prompts x 16 one-token responses at
temperature 1.5, GRPO advantages with group std, no KL, AdamW lr 1e-3 constant, clip 1.0), both sides from the same
weights, each side built by loop_bench's own code. Each step draws one batch (16 training prompts, 16 responses
each from a fixed torch generator, under slimeflow's current weights; rewards by slimeflow's prefix_match) and hands
the same token ids to:

- slimeflow: the TrainActor's path in process: TorchBackend, TrainBatch.from_samples, train_step.prepare and
  accumulate_gradients (train_on_rollout's body, split to read the gradient), TorchBackend.optimizer_step;
- TRL: loop_bench.run_trl's GRPOTrainer: its own _generate_and_score_completions (prompt tokenisation, padding,
  reward function, advantages) with only the sampling replaced by these tokens, Trainer.training_step (loss and
  backward), then what Trainer's loop does: clip_grad_norm_, the optimizer and scheduler it creates.

Printed per step: advantages, loss, gradient norm before clipping, and the gradient, weight and Adam-state
differences (max abs, relative L2, cosine overall and the worst parameter's). The one known difference is the
group-std epsilon (slime 1e-6, TRL 1e-4); --match-eps sets slimeflow's to TRL's for the run, so what is left is
float rounding. --tilt p samples from (1 - p) x the policy + p x uniform over the digit tokens, so that most groups
have a reward spread (the untrained policy answers right ~0.4% of the time: most on-policy batches carry no signal);
the update is the same function of the batch either way (both sides take the ratio against their training forward).

2026-11-23, TRL 1.16.0, seed 1234, 3 steps: with --match-eps the advantages agree to 2.4e-7, the gradient to 4.8e-7
relative L2 (1 - cos 1.3e-13) at step 1 and 2e-5 by step 3, the weights to 6e-6 / 1.1e-5 relative L2 after steps 1 / 3
(Adam's first steps turn float noise in near-zero gradient entries into differences of up to lr): the same update.
Without it, the epsilon alone moves the advantages by 4e-4 relative and the gradient by 3.5e-4 to 8.5e-4.
CPU, about ten seconds; needs TRL (see loop_bench.py):

    .venv/bin/python benchmarks/grpo_step_equivalence.py [--steps 5] [--tilt 0.5] [--match-eps] [--seed 1234]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.loop_bench import (  # noqa: E402
    DATA,
    PROMPTS,
    SAMPLES,
    TEMPERATURE,
    prepare,
    read_jsonl,
    run_trl,
    slimeflow_config,
)


def build_slimeflow(hf: str, train: str, held_out: str, seed: int):
    """The TorchBackend a TrainActor builds from loop_bench's train config, and that config."""
    from slimeflow.train.backends.torch.backend import TorchBackend

    config = slimeflow_config(argparse.Namespace(max_rollouts=300, eval_interval=10, seed=seed), hf, train, held_out)
    backend = TorchBackend(hf_checkpoint=hf, optimizer=config.optimizer, algorithm=config.algorithm,
                           batch=config.batch, seed=config.seed, total_steps=config.batch.num_rollout,
                           ref_load=config.checkpoint.ref_load, temperature=config.rollout.rollout_temperature,
                           device="cpu")
    return backend, config


def build_trl(hf: str, seed: int, workdir: Path):
    """loop_bench.run_trl's GRPOTrainer, caught at trainer.train() (not run), with its optimizer and scheduler."""
    from trl import GRPOTrainer

    built = []
    train = GRPOTrainer.train
    GRPOTrainer.train = lambda self, *args, **kwargs: built.append(self)  # run_trl builds; we step by hand
    try:
        run_trl(argparse.Namespace(seed=seed, eval_interval=10, max_rollouts=300, max_seconds=1e9, target=1.0),
                hf, workdir)
    finally:
        GRPOTrainer.train = train
    trainer = built[0]
    trainer.create_optimizer_and_scheduler(num_training_steps=trainer.args.max_steps)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by Trainer's loop
    return trainer


def draw_batch(model, tokenizer, rows: list[dict], gen: torch.Generator, tilt: float):
    """Prompt ids (no BOS, as both sides tokenise them), SAMPLES response tokens per prompt and their log-probs
    under the policy at TEMPERATURE (one unpadded forward per prompt, positions from 0)."""
    digits = [t for t in range(len(tokenizer)) if tokenizer.decode([t]).strip() in set("0123456789")]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    responses, log_probs = [], []
    with torch.no_grad():
        for ids in prompts:
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float() / TEMPERATURE, -1)
            probs = lp.exp() * (1 - tilt)
            probs[digits] += tilt / len(digits)
            tokens = torch.multinomial(probs, SAMPLES, replacement=True, generator=gen)
            responses.append(tokens.tolist())
            log_probs.append(lp[tokens].tolist())
    return prompts, responses, log_probs


def slimeflow_step(backend, config, samples) -> tuple[dict, dict, torch.Tensor]:
    """train_on_rollout's body for one rollout of one optimizer step: (metrics, gradients before the step,
    advantages)."""
    from slimeflow.rollout.types import TrainBatch
    from slimeflow.train.train_step import accumulate_gradients, plan_steps
    from slimeflow.train.train_step import prepare as prepare_train

    batch = TrainBatch.from_samples(samples)
    plan = plan_steps(batch, config.batch.global_batch_size, 0, 1, config.batch.balance_data)
    assert len(plan) == 1, "loop_bench's setting is one optimizer step per rollout"
    (indices, share), = plan
    prepared = prepare_train(backend, batch, config, [share], 1, single_step=True)
    log_probs = torch.cat(backend.compute_log_probs(batch).log_probs)  # the training forward's, without grad
    metrics = accumulate_gradients(backend, batch, indices, share, prepared, config)
    grads = {n: p.grad.detach().clone() for n, p in backend.model.named_parameters()}
    metrics.update(backend.optimizer_step())
    metrics["old_log_probs"] = "the training forward's, detached" if prepared.old_log_probs is None else "recomputed"
    metrics["log_probs"] = log_probs
    return metrics, grads, torch.cat(prepared.advantages)


def trl_step(trainer, rows: list[dict], prompts, responses) -> tuple[dict, dict, torch.Tensor]:
    """One GRPOTrainer step on `responses`: (metrics, gradients before clipping, advantages)."""
    by_prompt = {tuple(ids): iter(tokens) for ids, tokens in zip(prompts, responses, strict=True)}

    def given_tokens(prompt_ids, *_args, **_kwargs):
        return [[next(by_prompt[tuple(ids)])] for ids in prompt_ids], None

    model = trainer.model
    model.train()
    trainer._generate_single_turn = given_tokens  # the only replaced piece: sampling
    inputs = trainer._generate_and_score_completions([{"prompt": r["prompt"], "label": r["label"]}
                                                      for r in rows for _ in range(SAMPLES)])
    del trainer._generate_single_turn
    fed = [ids[mask.bool()].tolist() for ids, mask in zip(inputs["prompt_ids"], inputs["prompt_mask"], strict=True)]
    assert fed == [ids for ids in prompts for _ in range(SAMPLES)], "TRL tokenised the prompts differently"
    assert inputs["completion_ids"][:, 0].tolist() == [t for tokens in responses for t in tokens]
    metrics = {"old_log_probs": "recomputed" if "old_per_token_logps" in inputs else "the training forward's, detached",
               "left_padded_rows": int((inputs["prompt_mask"] == 0).any(dim=1).sum())}
    with torch.no_grad():  # the training forward's log-probs: left-padded rows, default (arange) position ids
        metrics["log_probs"] = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), 1)[0][:, 0]
    generate = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: batch  # the batch is generated and scored already
    try:
        metrics["pg_loss"] = float(trainer.training_step(model, inputs, inputs["num_items_in_batch"]))
    finally:
        trainer._prepare_inputs = generate
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm))
    metrics["lr"] = trainer.optimizer.param_groups[0]["lr"]
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad(set_to_none=True)
    return metrics, grads, inputs["advantages"].float()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity in float64 without torch's norm clamp (Adam's second moments are ~1e-11 here)."""
    a, b = a.flatten().double(), b.flatten().double()
    denominator = a.norm() * b.norm()
    return float(a @ b / denominator) if denominator > 0 else float("nan")


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    """Max abs difference, relative L2, cosine overall and the lowest per-parameter cosine of two named sets."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    flat_a = torch.cat([a[k].detach().flatten().double() for k in a])
    flat_b = torch.cat([b[k].detach().flatten().double() for k in a])
    per = {k: cosine(a[k].detach(), b[k].detach()) for k in a}
    worst = min(per, key=lambda k: per[k] if per[k] == per[k] else 2.0)
    return (f"max|diff| {float((flat_a - flat_b).abs().max()):.2e} (max|x| {float(flat_a.abs().max()):.2e}), "
            f"rel L2 {float((flat_a - flat_b).norm() / flat_a.norm().clamp_min(1e-300)):.2e}, "
            f"1-cos {1 - cosine(flat_a, flat_b):.1e}, worst parameter 1-cos {1 - per[worst]:.1e} ({worst})")


def rollout(tokenizer, rows: list[dict], prompts, responses, log_probs) -> list:
    """The batch as slimeflow's rollout hands it over: scored Samples in group order (text decoded as its engine
    does, skip_special_tokens off; rewards by its prefix_match)."""
    from slimeflow.rollout.rule_rewards import prefix_match_reward
    from slimeflow.rollout.types import Sample, Status

    samples = []
    for g, (row, ids, tokens, lps) in enumerate(zip(rows, prompts, responses, log_probs, strict=True)):
        for j, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
            text = tokenizer.decode([token], skip_special_tokens=False)
            samples.append(Sample(group_index=g, index=g * SAMPLES + j, prompt=row["prompt"], label=row["label"],
                                  tokens=ids + [token], response=text, response_length=1, rollout_log_probs=[lp],
                                  reward=prefix_match_reward(text, row["label"], {}, None), status=Status.COMPLETED))
    return samples


def report(step: int, rewards: torch.Tensor, ours: tuple, theirs: tuple, backend, trainer) -> None:
    """One step's comparison: each side's (metrics, gradients, advantages), and both models after the step."""
    (ours, our_grads, our_adv), (theirs, their_grads, their_adv) = ours, theirs
    groups = rewards.view(PROMPTS, SAMPLES)
    print(f"\nstep {step}: mean reward {float(rewards.mean()):.3f}, groups with a reward spread "
          f"{int((groups.std(dim=1) > 0).sum())}/{PROMPTS}; TRL left-padded {theirs['left_padded_rows']} rows")
    print(f"  old log-probs: slimeflow {ours['old_log_probs']}, TRL {theirs['old_log_probs']}")
    print(f"  training-forward log-probs of the responses: max|diff| "
          f"{float((ours['log_probs'] - theirs['log_probs']).abs().max()):.2e}"
          + (" (identical weights: padding and positions only)" if step == 1 else ""))
    adv_diff = (our_adv - their_adv).abs()
    print(f"  advantages: max|diff| {float(adv_diff.max()):.2e} (max|A| {float(our_adv.abs().max()):.3f}, "
          f"max relative {float((adv_diff / our_adv.abs().clamp_min(1e-12)).max()):.2e})")
    print(f"  loss: slimeflow {ours['pg_loss']:.3e}, TRL {theirs['pg_loss']:.3e}, "
          f"|diff| {abs(ours['pg_loss'] - theirs['pg_loss']):.2e}")
    print(f"  grad norm before clipping: slimeflow {ours['grad_norm']:.7f}, TRL {theirs['grad_norm']:.7f}; "
          f"lr {ours['lr']:g} / {theirs['lr']:g}")
    print(f"  gradient: {diff(our_grads, their_grads)}")
    mine, other = dict(backend.model.named_parameters()), dict(trainer.model.named_parameters())
    print(f"  weights after the step: {diff(mine, other)}")
    for moment in ("exp_avg", "exp_avg_sq"):
        print(f"  Adam {moment}: " + diff({n: backend.optimizer.state[p][moment] for n, p in mine.items()},
                                          {n: trainer.optimizer.state[p][moment] for n, p in other.items()}))


def describe(optimizer) -> str:
    groups = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "fused")} | {"params": len(g["params"])}
              for g in optimizer.param_groups]
    return f"{type(optimizer).__name__} {groups}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tilt", type=float, default=0.5, help="share of the uniform-over-digits draw (0: on-policy)")
    parser.add_argument("--match-eps", action="store_true", help="slimeflow's group-std epsilon set to TRL's 1e-4")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    from slimeflow.train import algorithms as alg

    if args.match_eps:
        alg.GROUP_STD_EPS = 1e-4  # read at call time by normalize_group_rewards
    with tempfile.TemporaryDirectory() as tmp:
        hf, train, held_out = prepare(Path(tmp) / "prep")
        backend, config = build_slimeflow(hf, train, held_out, args.seed)
        trainer = build_trl(hf, args.seed, Path(tmp))
        tokenizer = trainer.processing_class
        print(f"optimizers: slimeflow {describe(backend.optimizer)}; TRL ({trainer.args.optim}) "
              f"{describe(trainer.optimizer)}")
        print(f"group-std epsilon: slimeflow {alg.GROUP_STD_EPS}, TRL 1e-4")
        print("weights at start: "
              + diff(dict(backend.model.named_parameters()), dict(trainer.model.named_parameters())))
        train_rows = read_jsonl(DATA / "increment-train.jsonl")
        gen = torch.Generator().manual_seed(args.seed)
        for step in range(1, args.steps + 1):
            rows = [train_rows[i] for i in torch.randperm(len(train_rows), generator=gen)[:PROMPTS].tolist()]
            prompts, responses, log_probs = draw_batch(backend.model, tokenizer, rows, gen, args.tilt)
            samples = rollout(tokenizer, rows, prompts, responses, log_probs)
            ours = slimeflow_step(backend, config, samples)
            theirs = trl_step(trainer, rows, prompts, responses)
            report(step, torch.tensor([s.reward for s in samples]), ours, theirs, backend, trainer)


if __name__ == "__main__":
    main()
