"""One GRPO optimizer step of the real model (SmolLM2-135M-Instruct, fp32, CPU), against two references.

    .venv/bin/python benchmarks/real_step.py [--rounds 3] [--sides plain,torch,megatron,trl,torch-1t] [--threads N]
        [--model gguf:smollm2-135m-instruct | HF_DIR] [--prompts 4] [--samples-per-prompt 8] [--profile]

The batch is examples/demo-real.yaml's rollout, fixed and seeded: --prompts questions of
examples/times_tables/data/times-train.jsonl rendered through the model's chat template (its default system
prompt included, as the preprocess stage renders them), each with --samples-per-prompt replies of up to
--max-response tokens drawn from a few phrasings a chat model gives ("9 times 12 is 108.", "The answer is 108.",
an explanation cut at the length limit, ...); a reply that fits ends with the end-of-turn token. Rewards are the
demo's (times_reward.score), the rollout log-probs the policy's own (one no-grad pass before timing). Every side
trains from the same weights on these same token ids, fp32, with the same torch thread count (--threads, default:
this process's CPUs), and the sides alternate within each round, so each sees the same load:

- plain: the limit. A plain PyTorch step on the same micro-batch: right-padded rows, the decoder, the output
  layer on the response positions only, log-softmax, -(advantage x log-prob) averaged over tokens, backward, fused
  AdamW. Nothing else (no clipping, no entropy, no metrics).
- torch-1t (not by default): the torch backend's step at one torch thread, what the loop gives a trainer on a
  2-core machine (slimeflow.cluster.cpu_threads keeps a core spare).
- torch / megatron: slimeflow's step as the TrainActor runs it with the demo's config (GRPO, --use-rollout-logprobs,
  --use-dynamic-batch-size --max-tokens-per-gpu 4096, temperature 0.8, lr 2e-5, clip 1.0): train_step.prepare
  (advantages; the demo runs no log-prob pass), accumulate_gradients (forward with entropies, loss, backward) and
  optimizer_step (clip, AdamW, schedule). megatron: the Megatron backend at TP1 in a one-rank gloo world, loaded
  from a torch_dist conversion of the same model.
- trl: TRL's GRPOTrainer (beta 0, num_iterations 1, loss_type grpo, the same lr, temperature and clip) on the same
  batch as its generation step hands it over (left-padded prompt ids and masks, right-padded completions,
  advantages), built outside the timing. Timed: Trainer.training_step (its _compute_loss: the forward with
  entropies over prompt + completion columns, the output layer on the completion columns, the loss, backward), then
  what Trainer's loop does after it: clip_grad_norm_, optimizer.step, lr_scheduler.step, zero_grad. Not timed: its
  generation, reward and advantage computation (_generate_and_score_completions).

Each side's step: median wall seconds and tokens/s (prompt + response tokens of the batch / step seconds) over
--rounds rounds after one warm-up step each, its ratio to plain, and the CPU seconds of this process. Apart from the
step: one no-grad log-prob pass over the batch (what slimeflow runs for the old policy without
--use-rollout-logprobs and for the reference model with --use-kl-loss or --kl-coef > 0; TRL's
_get_per_token_logps_and_entropies for its old and reference log-probs). --profile: per-phase seconds of the torch
backend's step and torch.profiler's top operators, and the top operators of a plain and a Megatron step (the sides
run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from slimeflow.checkpoint.hf_source import materialise
from slimeflow.config.model import ModelConfig
from slimeflow.config.train import TrainConfig
from slimeflow.io.storage import Storage
from slimeflow.rollout.types import TrainBatch
from slimeflow.train.backends.common import RowLayout
from slimeflow.train.train_step import prepare

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "times_tables"))
from times_reward import score  # noqa: E402

DATA = ROOT / "examples" / "times_tables" / "data" / "times-train.jsonl"
PHRASINGS = ["{p}", "{a} times {b} is {p}.", "The answer is {p}.", "{a} x {b} = {p}", "{a} * {b} = {p}",
             "{a} times {b} equals {p}.", "To find {a} times {b}, we can multiply {a} by {b}, which gives {p}.",
             "Sure! {a} multiplied by {b} is {p}. Let me know if you need anything else."]
"""Reply shapes of the demo's rollouts (short answers, and explanations cut at the length limit)."""


def demo_config(samples_per_prompt: int, prompts: int) -> TrainConfig:
    """examples/demo-real.yaml's train section (what the step reads of it)."""
    return TrainConfig(batch={"rollout_batch_size": prompts, "n_samples_per_prompt": samples_per_prompt,
                              "num_rollout": 8, "use_dynamic_batch_size": True, "max_tokens_per_gpu": 4096},
                       algorithm={"advantage_estimator": "grpo", "use_rollout_logprobs": True},
                       optimizer={"lr": 2e-5}, rollout={"rollout_temperature": 0.8,
                                                        "rollout_max_response_len": 12})


def make_batch(tokenizer, prompts: int, per_prompt: int, max_response: int, seed: int) -> tuple[TrainBatch, list]:
    """The seeded rollout (rollout log-probs left for the caller) and its prompt messages (for TRL)."""
    rng = random.Random(seed)
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    picked = rng.sample(rows, prompts)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens, lengths, rewards, groups = [], [], [], []
    for g, row in enumerate(picked):
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        a, b = (int(x) for x in row["id"].removeprefix("times-").split("x"))
        replies: dict[tuple[int, ...], tuple[list[int], str, bool]] = {}
        while len(replies) < per_prompt:  # distinct token ids: each sample a forward row of its own
            product = a * b if rng.random() < 0.6 else a * b + rng.choice([-a, a, 1, 10, -10, 2 * a])
            ids = tokenizer(rng.choice(PHRASINGS).format(a=a, b=b, p=product), add_special_tokens=False)["input_ids"]
            finished = len(ids) < max_response
            ids = ids + [eos] if finished else ids[:max_response]
            replies.setdefault(tuple(ids[:-1]), (ids, tokenizer.decode(ids), finished))  # the row's key
        for ids, reply, finished in sorted(replies.values(), key=lambda _: rng.random()):
            tokens.append(torch.tensor(prompt + ids))
            lengths.append(len(ids))
            rewards.append(score(reply, row["label"], finished))
            groups.append(g)
    batch = TrainBatch(tokens=tokens, response_lengths=lengths, loss_masks=[torch.ones(n) for n in lengths],
                       rewards=torch.tensor(rewards), group_indices=groups)
    return batch, [row["prompt"] for row in picked for _ in range(per_prompt)]


# -- the sides --------------------------------------------------------------------------------------------------


class PlainStep:
    """The limit: forward, -(advantage x log-prob) over the response tokens, backward, fused AdamW."""

    def __init__(self, model_dir: Path, batch: TrainBatch, advantages: torch.Tensor, lr: float):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=True)
        layout = RowLayout.of(batch)  # right-padded rows and the positions that predict a response token
        assert layout.row_of is None, "the benchmark's samples are all distinct"
        self.ids, self.mask, self.keep = layout.ids, layout.mask, layout.keep
        self.targets = layout.ids[:, 1:][layout.keep[:, :-1]]
        self.weights = torch.repeat_interleave(advantages, layout.lengths) / int(layout.lengths.sum())

    def step(self) -> None:
        hidden = self.model.model(input_ids=self.ids, attention_mask=self.mask, use_cache=False).last_hidden_state
        logits = self.model.lm_head(hidden[self.keep])
        log_probs = torch.log_softmax(logits / 0.8, dim=-1).gather(1, self.targets[:, None]).squeeze(1)
        (-(self.weights * log_probs).sum()).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def slimeflow_step(backend, batch: TrainBatch, config: TrainConfig) -> None:
    """train_on_rollout's body: plan, prepare (advantages; the demo's config runs no log-prob pass), then each
    optimizer step's forward/backward and optimizer step (the demo's: one per rollout)."""
    from slimeflow.train.train_step import accumulate_gradients, plan_steps, prepare

    plan = plan_steps(batch, config.batch.global_batch_size, 0, 1, config.batch.balance_data)
    prepared = prepare(backend, batch, config, [share for _, share in plan], 1, single_step=len(plan) == 1)
    for indices, share in plan:
        accumulate_gradients(backend, batch, indices, share, prepared, config)
        backend.optimizer_step()


def build_torch(model_dir: Path, config: TrainConfig):
    from slimeflow.train.backends.torch.backend import TorchBackend

    return TorchBackend(model_dir, config.optimizer, config.algorithm, config.batch, device="cpu",
                        temperature=config.rollout.rollout_temperature)


def build_megatron(model_dir: Path, config: TrainConfig, tmp: Path):
    from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, read_hf_source
    from slimeflow.train.backends.megatron.backend import MegatronBackend
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint

    staged, _ = convert_hf_to_torch_dist(read_hf_source(model_dir), tmp / "ckpt")
    release = staged.rename(tmp / "ckpt" / "release")
    backend = MegatronBackend(model_dir, release, config.optimizer, config.algorithm, config.batch, config.megatron,
                              init_method=(tmp / "rendezvous").as_uri(),
                              temperature=config.rollout.rollout_temperature)
    load_checkpoint(backend, release, weights_only=True)
    return backend


class TrlStep:
    """GRPOTrainer on the batch as its generation step hands it over; step() is its training step (see above)."""

    def __init__(self, model_dir: Path, batch: TrainBatch, messages: list, advantages: torch.Tensor,
                 config: TrainConfig, workdir: Path):
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        n = config.batch.n_samples_per_prompt
        args = GRPOConfig(output_dir=str(workdir / "trl"), use_cpu=True, report_to="none", save_strategy="no",
                          disable_tqdm=True, max_steps=8, per_device_train_batch_size=len(batch),
                          gradient_accumulation_steps=1, num_generations=n,
                          max_completion_length=config.rollout.rollout_max_response_len,
                          temperature=config.rollout.rollout_temperature, learning_rate=config.optimizer.lr,
                          lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                          max_grad_norm=config.optimizer.clip_grad, beta=0.0, num_iterations=1, loss_type="grpo",
                          bf16=False, gradient_checkpointing=False, use_vllm=False)
        dataset = Dataset.from_list([{"prompt": m} for m in messages[::n]])
        self.trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                   args=args, train_dataset=dataset, processing_class=tokenizer)
        self.trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
        self.trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop
        self.trainer._prepare_inputs = lambda inputs: inputs  # the batch is generated and scored already
        self.inputs = self._inputs(batch, advantages, tokenizer.pad_token_id)

    @staticmethod
    def _inputs(batch: TrainBatch, advantages: torch.Tensor, pad: int) -> dict:
        prompts = [t[: len(t) - n] for t, n in zip(batch.tokens, batch.response_lengths, strict=True)]
        replies = [t[len(t) - n :] for t, n in zip(batch.tokens, batch.response_lengths, strict=True)]
        width, longest = max(map(len, prompts)), max(map(len, replies))
        prompt_ids = torch.full((len(batch), width), pad)
        prompt_mask = torch.zeros_like(prompt_ids)
        completion_ids = torch.full((len(batch), longest), pad)
        completion_mask = torch.zeros_like(completion_ids)
        for i, (p, r) in enumerate(zip(prompts, replies, strict=True)):
            prompt_ids[i, width - len(p):], prompt_mask[i, width - len(p):] = p, 1  # left-padded, as TRL's
            completion_ids[i, : len(r)], completion_mask[i, : len(r)] = r, 1
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                "completion_mask": completion_mask, "advantages": advantages,
                "num_items_in_batch": completion_mask.sum()}

    def step(self) -> None:
        trainer, model = self.trainer, self.trainer.model
        model.train()
        trainer.training_step(model, self.inputs, self.inputs["num_items_in_batch"])
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def log_prob_pass(self) -> None:
        x = self.inputs
        self.trainer._get_per_token_logps_and_entropies(
            self.trainer.model, torch.cat([x["prompt_ids"], x["completion_ids"]], 1),
            torch.cat([x["prompt_mask"], x["completion_mask"]], 1), x["completion_ids"].size(1))


# -- measuring --------------------------------------------------------------------------------------------------


def with_threads(threads: int, fn: Callable[[], object]) -> Callable[[], None]:
    """fn run with `threads` torch threads, this process's count restored after."""
    def run() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            fn()
        finally:
            torch.set_num_threads(before)
    return run


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU seconds of this process) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


@contextlib.contextmanager
def phase_clocks(backend, phases: dict[str, float]) -> Iterator[None]:
    """Time, for as long as it is open, the torch backend's packing (RowLayout.of: rows, padding, kept positions),
    its forward (decoder, output layer on the kept positions, log-probs and entropies; packing excluded), every
    backward and its optimizer step (clip, AdamW, schedule), by wrapping them in this process (measurement only)."""
    originals = {"of": RowLayout.__dict__["of"], "backward": torch.autograd.backward,
                 "forward": backend.forward, "optimizer_step": backend.optimizer_step}

    def clocked(name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
        return run

    RowLayout.of = classmethod(clocked("packing", originals["of"].__func__))  # type: ignore[method-assign]
    torch.autograd.backward = clocked("backward", originals["backward"])
    backend.forward = clocked("forward (packing included)", originals["forward"])
    backend.optimizer_step = clocked("optimizer step (clip, AdamW, schedule)", originals["optimizer_step"])
    try:
        yield
    finally:
        RowLayout.of = originals["of"]  # type: ignore[method-assign]
        torch.autograd.backward = originals["backward"]
        del backend.forward, backend.optimizer_step  # the class's methods again


def profile_torch(backend, batch: TrainBatch, config: TrainConfig) -> None:
    """Per-phase seconds of one torch-backend step and of one log-prob pass, then torch.profiler's top operators
    of a step by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    phases: dict[str, float] = {}
    with phase_clocks(backend, phases):
        total = timed(lambda: slimeflow_step(backend, batch, config))[0]
    phases["forward"] = phases.pop("forward (packing included)") - phases["packing"]
    phases["advantages, loss, metrics (the rest)"] = total - sum(phases.values())
    print(f"torch backend step {total:.3f} s by phase: " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()))
    passes: dict[str, float] = {}
    with phase_clocks(backend, passes):
        total = timed(lambda: backend.compute_log_probs(batch))[0]
    print(f"log-prob pass {total:.3f} s: packing {passes['packing']:.3f} s, forward "
          f"{passes['forward (packing included)'] - passes['packing']:.3f} s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        slimeflow_step(backend, batch, config)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def profile_operators(steps: dict[str, Callable[[], None]], names: tuple[str, ...] = ("plain", "megatron")) -> None:
    """torch.profiler's top operators by self CPU time of one step of each side in `names` that runs, with the
    total self CPU time: where one side spends CPU that another does not."""
    from torch.profiler import ProfilerActivity, profile

    for name in (n for n in names if n in steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps[name]()
        table = prof.key_averages()
        print(f"{name} step, self CPU {sum(e.self_cpu_time_total for e in table) / 1e6:.3f} s; top operators:")
        print(table.table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gguf:smollm2-135m-instruct", help="an HF directory or a GGUF source")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "slimeflow" / "bench-models")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sides", default="plain,torch,megatron,trl",
                        help="of plain, torch, torch-1t (the torch backend at 1 thread), megatron, trl")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="per-phase times and top operators (torch backend; plain and megatron operators)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    from transformers import AutoTokenizer

    model_dir = materialise(ModelConfig(hf_checkpoint=args.model, cache_dir=str(args.cache_dir)), Storage(),
                            args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = demo_config(args.samples_per_prompt, args.prompts)
    batch, messages = make_batch(tokenizer, args.prompts, args.samples_per_prompt, args.max_response, args.seed)
    tokens = sum(batch.total_lengths)
    print(f"batch: {len(batch)} samples, {tokens} tokens (prompts {min(batch.total_lengths) - max(batch.response_lengths)}"
          f"-{max(t - r for t, r in zip(batch.total_lengths, batch.response_lengths, strict=True))}, replies "
          f"{min(batch.response_lengths)}-{max(batch.response_lengths)} tokens), mean reward "
          f"{float(batch.rewards.mean()):.2f}; {args.threads} torch threads")

    with tempfile.TemporaryDirectory(prefix="real-step-") as tmp:  # the Megatron side's torch_dist conversion
        return measure(args, model_dir, config, batch, messages, Path(tmp))


def measure(args: argparse.Namespace, model_dir: Path, config: TrainConfig, batch: TrainBatch, messages: list,
            tmp: Path) -> int:
    """Build the sides, time them round by round, print the figures."""
    sides, tokens = args.sides.split(","), sum(batch.total_lengths)
    torch_backend = build_torch(model_dir, config)  # also the rollout's log-probs: the policy's own
    batch.rollout_log_probs = torch_backend.compute_log_probs(batch).log_probs
    lp_seconds: dict[str, list[float]] = {}
    advantages = torch.stack([a[0] for a in prepare(torch_backend, batch, config, [list(range(len(batch)))], 1,
                                                     single_step=True).advantages])
    steps: dict[str, Callable[[], None]] = {}
    passes: dict[str, Callable[[], object]] = {}
    if "plain" in sides:
        plain = PlainStep(model_dir, batch, advantages, config.optimizer.lr)
        steps["plain"] = plain.step
    if "torch" in sides:
        steps["torch"] = lambda: slimeflow_step(torch_backend, batch, config)
        passes["torch"] = lambda: torch_backend.compute_log_probs(batch)
    if "torch-1t" in sides:  # the same backend at one torch thread, what the loop gives a trainer on 2 cores
        steps["torch-1t"] = with_threads(1, lambda: slimeflow_step(torch_backend, batch, config))
        passes["torch-1t"] = with_threads(1, lambda: torch_backend.compute_log_probs(batch))
    if "megatron" in sides:
        megatron = build_megatron(model_dir, config, tmp)
        steps["megatron"] = lambda: slimeflow_step(megatron, batch, config)
        passes["megatron"] = lambda: megatron.compute_log_probs(batch)
    if "trl" in sides:
        trl = TrlStep(model_dir, batch, messages, advantages, config, tmp)
        steps["trl"] = trl.step
        passes["trl"] = trl.log_prob_pass

    load_before = os.getloadavg()
    for step in steps.values():
        step()  # warm-up: Adam's state is allocated on the first step
    walls: dict[str, list[float]] = {name: [] for name in steps}
    cpus: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            wall, cpu = timed(step)
            walls[name].append(wall)
            cpus[name].append(cpu)
        for name, log_prob_pass in passes.items():
            lp_seconds.setdefault(name, []).append(timed(log_prob_pass)[0])
    load_after = os.getloadavg()
    if args.profile and "torch" in sides:
        profile_torch(torch_backend, batch, config)
    if args.profile:
        profile_operators(steps)

    limit = statistics.median(walls["plain"]) if "plain" in walls else None
    for name in steps:
        median = statistics.median(walls[name])
        ratio = f", {limit / median:.3f}x plain's tokens/s" if limit else ""
        print(f"step {name:9s} median {median:.3f} s ({min(walls[name]):.3f}-{max(walls[name]):.3f}), "
              f"{tokens / median:.1f} tokens/s{ratio}; CPU {statistics.median(cpus[name]):.3f} s")
    if "trl" in walls and "torch" in walls:
        print(f"TRL's step / torch backend's: {statistics.median(walls['trl']) / statistics.median(walls['torch']):.3f}x")
    for name, values in lp_seconds.items():
        print(f"log-prob pass {name:9s} (no grad, the whole batch) median {statistics.median(values):.3f} s "
              f"({min(values):.3f}-{max(values):.3f}, {len(values)} passes), "
              f"{statistics.median(values) / statistics.median(walls[name]):.2f}x its step")
    print("passes per step: the demo's config 0 (--use-rollout-logprobs: the engine's log-probs are the old "
          "policy's; no KL); with --use-kl-loss or --kl-coef > 0 one more (the reference model); without "
          "--use-rollout-logprobs one more (the old policy) unless on-policy with one step per rollout")
    print(f"load average (1, 5, 15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)}")
    if "megatron" in steps:
        megatron.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
