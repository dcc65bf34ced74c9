"""The whole loop at real size: slimeflow's train stage vs TRL's GRPOTrainer, time to a held-out accuracy target.

    .venv/bin/python benchmarks/real_loop.py [--seeds 1,2,3] [--target 0.5] [--max-rollouts 8] [--eval-interval 2]
        [--max-seconds 480] [--first slimeflow|trl] [--only slimeflow|trl]
        [--model gguf:smollm2-135m-instruct | HF_DIR]

The real demo (examples/demo-real.yaml, `make demo`): SmolLM2-135M-Instruct (fp32, CPU) learns to answer "What is a
times b?" briefly; 57 training questions, 64 held out (examples/times_tables/data), rendered with the model's chat
template (its default system prompt included); the reward is times_reward.py's (1.0 for a reply that ends by itself
within the length limit with the product as its last number). Both sides, per step: 4 prompts x 8 samples at
temperature 0.8 (top-p 1, no top-k), replies of up to 12 tokens, GRPO advantages with the group std, no KL, one
optimizer step per rollout (so the rollout's log-probs are the old policy's), AdamW lr 2e-5 constant, clip 1.0;
held-out greedy accuracy (64 prompts, one reply each, up to 12 tokens, the same reward) before training and every
--eval-interval steps. Each side stops at the first eval at or above --target, after --max-rollouts steps, or after
--max-seconds of loop time.

- slimeflow: the train stage in a fresh process (loop_bench.run_slimeflow: Ray, the embedded engine, the torch
  backend), with the demo's train section as `slimeflow run` reads it (load_stage_config), overridden only for
  the inputs (the model, prompt and held-out parquets made once by the model and preprocess stages, as the
  pipeline would hand them over), the seed, the step cap and --eval-interval.
- TRL: GRPOTrainer 1.16 (transformers.generate on the CPU) in a fresh process of this script (`--trl-child`), the
  same prompts as messages (TRL renders them with the same chat template: checked token for token against the
  preprocess stage's), the same reward through `completion_ids` (finished = ends with an end-of-turn token), the
  held-out eval as a TrainerCallback (left-padded batch of the 64 prompts, greedy generate). Torch threads: its
  default, one per core.

Seconds to target are from each side's process start (cold imports included) to the moment its first eval at or
above the target is known; start-up is from process start to the end of the eval before training. The sides of a
seed run one after the other, alternating which goes first from seed to seed; the 1-min load average is recorded
before and after each side. The model is dequantized once into --cache-dir (real_step.py's helper), the prompts
preprocessed once into --workdir; neither is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from loop_bench import HeldOutCallback, SideResult, run_slimeflow, summary, table

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "examples" / "times_tables"
DEMO = ROOT / "examples" / "demo-real.yaml"
EVAL_KEY = "eval/times/avg_at_1"
sys.path.insert(0, str(TASK))
from times_reward import score  # noqa: E402


def demo_sections() -> dict:
    return yaml.safe_load(DEMO.read_text())


def prepare(args, workdir: Path) -> tuple[str, str, str]:
    """The dequantized model and the demo's prompt parquets (train, held-out), as the model and preprocess stages
    make them for `slimeflow run examples/demo-real.yaml`."""
    from slimeflow.checkpoint.hf_source import materialise
    from slimeflow.config.model import ModelConfig
    from slimeflow.config.pipeline import load_stage_config
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext
    from slimeflow.stages.preprocess.stage import run as preprocess_run

    hf = str(materialise(ModelConfig(hf_checkpoint=args.model, cache_dir=str(args.cache_dir)), Storage(),
                         args.cache_dir))
    section = {**demo_sections()["preprocess"], "hf-checkpoint": hf}
    section["input"] = [str(ROOT / p) for p in section["input"]]
    section["eval_input"] = {k: str(ROOT / v) for k, v in section["eval_input"].items()}
    config = load_stage_config("preprocess", section)
    pre = preprocess_run(config, StageContext(Storage(), workdir, str(workdir)))
    return hf, pre.outputs["train"], pre.outputs["eval.times"]


def slimeflow_config(args, hf: str, train: str, held_out: str):
    """The demo's train section; only the inputs, seeds and caps overridden. One rollout more than the cap, saved
    only then: the loop is stopped before it, so no save is timed (TRL saves nothing either)."""
    from slimeflow.config.pipeline import load_stage_config

    last = args.max_rollouts + 1
    section = {**demo_sections()["train"], "num-rollout": last, "save-interval": last,
               "eval-interval": args.eval_interval, "seed": args.seed, "rollout-seed": args.seed,
               "hf-checkpoint": hf, "prompt-data": train, "eval-prompt-data": {"times": held_out}}
    return load_stage_config("train", section)


def run_trl(args, hf: str, workdir: Path) -> SideResult:
    """This script's --trl-child in a fresh process; its result back as JSON."""
    out = workdir / f"trl-{args.seed}-{time.time_ns()}.json"
    started = time.time()
    command = [sys.executable, __file__, "--trl-child", str(out), "--started", repr(started), "--hf", hf,
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("seed", "target", "max_rollouts", "eval_interval", "max_seconds"))]
    with open(workdir / f"trl-{args.seed}.log", "wb") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=args.max_seconds + 300)
    fields = json.loads(out.read_text())
    fields["evals"] = [tuple(e) for e in fields["evals"]]
    return SideResult(**fields)


def trl_child(args) -> None:
    """GRPOTrainer on the demo's task; writes its SideResult to args.trl_child. Start-up counts from args.started,
    the parent's clock when it started this process."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    train_section = demo_sections()["train"]
    samples, prompts = train_section["n-samples-per-prompt"], train_section["rollout-batch-size"]
    tokenizer = AutoTokenizer.from_pretrained(args.hf)
    check_prompt_tokens(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
    eos = {*([model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id, int)
             else model.generation_config.eos_token_id), tokenizer.eos_token_id}
    rows = read_jsonl(TASK / "data" / "times-train.jsonl")
    config = GRPOConfig(
        output_dir=str(Path(args.trl_child).parent / "trl"), seed=args.seed, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=args.eval_interval, disable_tqdm=True, max_steps=args.max_rollouts,
        per_device_train_batch_size=prompts * samples, gradient_accumulation_steps=1,  # counts completions
        num_generations=samples, max_completion_length=train_section["rollout-max-response-len"],
        temperature=train_section["rollout-temperature"], top_p=1.0, top_k=0,
        learning_rate=train_section["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, num_iterations=1, epsilon=0.2, scale_rewards="group", loss_type="grpo",
        bf16=False, gradient_checkpointing=False, use_vllm=False)

    def reward(completions, label, completion_ids, **_) -> list[float]:
        return [score(c[0]["content"], answer, bool(ids) and ids[-1] in eos)
                for c, answer, ids in zip(completions, label, completion_ids, strict=True)]

    callback = ChatHeldOutCallback(read_jsonl(TASK / "data" / "times-eval.jsonl"), tokenizer, args, eos)
    callback.result = SideResult("TRL", startup_s=0.0, seed=args.seed, per_step=per_step())
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[callback])
    trainer.train()
    callback.result.notes.append(f"torch threads {torch.get_num_threads()}")
    Path(args.trl_child).write_text(json.dumps(dataclasses.asdict(callback.result)))


def per_step() -> int:
    train = demo_sections()["train"]
    return train["rollout-batch-size"] * train["n-samples-per-prompt"]


def check_prompt_tokens(tokenizer) -> None:
    """TRL tokenises a chat prompt with apply_chat_template(tokenize=True); slimeflow's engine gets the preprocess
    stage's rendered text and tokenises it without special tokens. Both must give the same ids."""
    messages = read_jsonl(TASK / "data" / "times-train.jsonl")[0]["prompt"]
    trl_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if trl_ids != tokenizer(text, add_special_tokens=False)["input_ids"]:
        raise RuntimeError("TRL's prompt tokens differ from slimeflow's: the comparison would not be fair")


def report(args, sides: list[SideResult]) -> None:
    print(f"\n{' '.join([sys.executable, *sys.argv])}  (seed {args.seed})")
    print(f"SmolLM2-135M-Instruct fp32, CPU, {os.cpu_count()} cores; the demo's task, {per_step()} completions per "
          f"step; target held-out greedy accuracy >= {args.target}, eval every {args.eval_interval} steps")
    for row in table(args, sides):
        print(row)
    print("CPU seconds to target (all the side's processes): "
          + ", ".join(f"{s.name} {s.target_cpu_s:.0f}" for s in sides if s.target_cpu_s is not None))
    print("completions/s (trained, over loop seconds less evals): "
          + ", ".join(f"{s.name} {s.completions_per_s:.2f}" for s in sides))
    for side in sides:
        print(f"{side.name} evals (step, acc): {side.evals}")
        for note in side.notes:
            print(f"  {note}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


class ChatHeldOutCallback(HeldOutCallback):
    """loop_bench's held-out eval on chat prompts: the demo's 12-token greedy replies scored by times_reward."""

    def __init__(self, held_out: list[dict], tokenizer, args, eos: set[int]):
        self.prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"] for r in held_out]
        self.labels = [r["label"] for r in held_out]
        self.tokenizer, self.args, self.eos = tokenizer, args, eos
        self.result: SideResult | None = None
        self.loop_start = 0.0

    def accuracy(self, model) -> float:
        right = 0
        replies = self.greedy(model, 12, eos_token_id=sorted(self.eos))
        for row, label in zip(replies.tolist(), self.labels, strict=True):
            ends = [i for i, t in enumerate(row) if t in self.eos]
            reply = row[: ends[0]] if ends else row
            right += score(self.tokenizer.decode(reply, skip_special_tokens=True), label, bool(ends))
        return right / len(self.labels)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        control = super().on_step_end(args, state, control, model=model, **kwargs)
        if self.result.target_step is not None and self.result.target_cpu_s is None:
            self.result.target_cpu_s = time.process_time()  # this fresh process's, from its start
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        self.result.startup_s = time.time() - self.args.started  # process start to the end of the first eval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=0.5, help="held-out greedy accuracy to reach")
    parser.add_argument("--max-rollouts", type=int, default=8, help="step cap of each side")
    parser.add_argument("--eval-interval", type=int, default=2, help="steps between held-out evals")
    parser.add_argument("--max-seconds", type=float, default=480.0, help="loop-time cap of each side")
    parser.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=[1, 2, 3])
    parser.add_argument("--first", choices=["slimeflow", "trl"], default="slimeflow",
                        help="the side that goes first on the first seed (then they alternate)")
    parser.add_argument("--only", choices=["slimeflow", "trl"], default=None, help="run one side")
    parser.add_argument("--model", default="gguf:smollm2-135m-instruct", help="an HF directory or a GGUF source")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "slimeflow" / "bench-models")
    parser.add_argument("--workdir", type=Path, default=None, help="kept when given (default: a temporary dir)")
    parser.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--hf", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(args)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TASK), os.environ.get("PYTHONPATH")]))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        hf, train, held_out = prepare(args, workdir / "prep")
        order = ["slimeflow", "trl"] if args.first == "slimeflow" else ["trl", "slimeflow"]
        order = [args.only] if args.only else order
        for i, seed in enumerate(args.seeds):
            seeded = argparse.Namespace(**{**vars(args), "seed": seed})
            sides = {}
            for name in order if i % 2 == 0 else order[::-1]:
                load = os.getloadavg()[0]
                if name == "slimeflow":
                    side = run_slimeflow(seeded, hf, train, held_out, workdir / f"slimeflow-{time.time_ns()}",
                                         slimeflow_config(seeded, hf, train, held_out), EVAL_KEY)
                    side.per_step = per_step()
                else:
                    side = run_trl(seeded, hf, workdir)
                side.seed = seed
                side.notes.insert(0, f"went {'first' if not sides else 'second'}; 1-min load before "
                                     f"{load:.2f}, after {os.getloadavg()[0]:.2f}")
                sides[name] = side
            runs.append([sides[name] for name in ("slimeflow", "trl") if name in sides])
            report(seeded, runs[-1])
    print()
    for row in summary(runs):
        print(row)
    for i, side in enumerate(runs[0]):
        cpu = sorted(run[i].target_cpu_s or float("inf") for run in runs)
        print(f"{side.name} CPU seconds to target, per seed sorted: {', '.join(f'{c:.0f}' for c in cpu)}")


if __name__ == "__main__":
    main()
