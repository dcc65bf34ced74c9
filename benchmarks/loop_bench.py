"""The RL loop: slimeflow's train stage vs TRL's GRPOTrainer, same model, task, batch and hyperparameters.

The demo's task (examples/demo.yaml): a tiny Llama from the factory learns the last digit of n + 1 from "n+1="
(80 prompts to train on, 20 held out). Both sides: 16 prompts x 16 samples per step, one optimizer step per
rollout, 1-token responses at temperature 1.5, AdamW lr 1e-3 (constant, clip 1.0), GRPO advantages with group
std, no KL, reward 1.0 when the response starts with the label; greedy held-out accuracy every --eval-interval
steps. Each side stops when that accuracy first reaches --target, after --max-rollouts steps, or after
--max-seconds of loop time. The two run one after the other in this run (slimeflow first).

Both sides train on the log-probs of the sampling distribution (logits / temperature), as slime and TRL do, so
their updates are the same function of the same rollout: benchmarks/grpo_step_equivalence.py feeds both the same
batches and finds the same advantages, gradient and weights (to float rounding once the group-std epsilon, slime's
1e-6 against TRL's 1e-4, is matched), and slimeflow's train_rollout_logprob_abs_diff (engine against trainer
log-probs of the sampled tokens, at most 3.4e-7 here) shows its rollouts are sampled with the weights it trains.
What differs is each side's random streams (sampled responses, prompt order), so steps to target is one draw per
--seed and its spread over seeds is wide on both sides. At --target 0.7 (steps, eval every 10): seeds 1-6 and 8-11,
slimeflow 90 to 160 and twice not within 300 (median 130), TRL 80 to 180 and once not (median 115), TRL first on 8;
seeds 12-19, slimeflow 80 to 180 (median 95), TRL 60 to 120 and once not (median 105), each first on 3, 2 ties.
TRL was first on 11 of those 18 seeds: were each seed a coin flip, 11 or more would come up 24% of the time.
Compare several seeds before reading anything into one.

- slimeflow: the train stage in a subprocess (Ray, the embedded engine, the torch backend); rollouts.jsonl is
  tailed as it grows. Start-up (imports, Ray, engine, the eval before training) is reported apart from the loop.
- TRL: GRPOTrainer in this process (transformers.generate on the CPU); the eval is a TrainerCallback. Start-up
  is building the trainer plus what a fresh process takes to import torch, transformers, datasets and TRL (timed
  in a subprocess: this process had imported them already), so that both start-ups are a fresh process's; its
  loop clock starts after the eval before training, as slimeflow's does.

completions/s is completions trained / loop seconds without eval time. TRL needs an extra install:

    .venv/bin/pip install -c constraints.txt trl==1.16.0
    .venv/bin/python benchmarks/loop_bench.py [--target 0.8] [--max-rollouts 300] [--eval-interval 10]
    .venv/bin/python benchmarks/loop_bench.py --target 0.7 --seeds 7,12,13,1,2,3   # medians over seeds
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"
MODEL = "tiny:llama?seed=0&hidden_size=128&intermediate_size=256"
EVAL_KEY = "eval/increment/avg_at_1"
PROMPTS, SAMPLES, LR, TEMPERATURE = 16, 16, 1.0e-3, 1.5
TRL_INSTALL = ".venv/bin/pip install -c constraints.txt trl==1.16.0"

STAGE_SCRIPT = """
import sys
from pathlib import Path
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.config.train import TrainConfig
from slimeflow.stages.train.stage import run
config = TrainConfig.model_validate_json(Path(sys.argv[1]).read_text())
run(config, StageContext(Storage(), Path(sys.argv[2]), sys.argv[2]))
"""


@dataclass
class SideResult:
    """One side's figures: seconds are loop seconds unless named start-up."""

    name: str
    startup_s: float
    seed: int = 0
    cold_imports_s: float = 0.0
    """TRL only: what a fresh process takes to import what this process had imported before `startup_s` began
    (slimeflow's start-up is a fresh process's from the start)."""
    steps: int = 0
    loop_s: float = 0.0
    eval_s: float = 0.0
    target_step: int | None = None
    target_s: float | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    per_step: int = PROMPTS * SAMPLES
    """Completions trained per step."""
    target_cpu_s: float | None = None
    """CPU seconds (user + system) of the side's processes from their start to the target, where measured."""

    @property
    def completions_per_s(self) -> float:
        return self.steps * self.per_step / max(self.loop_s - self.eval_s, 1e-9)


def prepare(workdir: Path) -> tuple[str, str, str]:
    """The factory model and the demo's prompt parquets (train, held-out), as the pipeline's stages make them."""
    from slimeflow.config.model import ModelConfig
    from slimeflow.config.preprocess import PreprocessConfig
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext
    from slimeflow.stages.model.stage import run as model_run
    from slimeflow.stages.preprocess.stage import run as preprocess_run

    ctx = StageContext(Storage(), workdir, str(workdir))
    hf = model_run(ModelConfig(hf_checkpoint=MODEL), ctx).outputs["hf_checkpoint"]
    pre = preprocess_run(PreprocessConfig(input=[str(DATA / "increment-train.jsonl")], input_key="prompt",
                                          eval_input={"increment": str(DATA / "increment-eval.jsonl")},
                                          label_key="label"), ctx)
    return hf, pre.outputs["train"], pre.outputs["eval.increment"]


def slimeflow_config(args, hf: str, train: str, held_out: str):
    from slimeflow.config.pipeline import load_stage_config

    # One rollout more than the cap, saved only then: the loop is stopped before it, so no checkpoint save is timed
    # (TRL saves nothing either).
    last = args.max_rollouts + 1
    section = {"rollout-batch-size": PROMPTS, "n-samples-per-prompt": SAMPLES, "num-rollout": last,
               "rollout-max-response-len": 1, "rollout-temperature": TEMPERATURE, "rollout-shuffle": True,
               "rm-type": "prefix_match", "advantage-estimator": "grpo", "lr": LR, "use-dynamic-batch-size": True,
               "max-tokens-per-gpu": 8192, "eval-interval": args.eval_interval, "eval-temperature": 0.0,
               "eval-max-response-len": 1, "n-samples-per-eval-prompt": 1,
               "save-interval": last,
               "seed": args.seed, "rollout-seed": args.seed,
               "hf-checkpoint": hf, "prompt-data": train, "eval-prompt-data": {"increment": held_out}}
    return load_stage_config("train", section)


def run_slimeflow(args, hf: str, train: str, held_out: str, workdir: Path, config=None,
                  eval_key: str = EVAL_KEY) -> SideResult:
    """The train stage (`config`, default slimeflow_config's) in its own process group, tailed until `eval_key`
    reaches the target, the step cap or the time cap."""
    config = config or slimeflow_config(args, hf, train, held_out)
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(config.model_dump_json())
    log = workdir / "train" / "rollouts.jsonl"
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with open(workdir / "stage.log", "wb") as stage_log:
        proc = subprocess.Popen([sys.executable, "-c", STAGE_SCRIPT, str(workdir / "config.json"), str(workdir)],
                                start_new_session=True, stdout=stage_log, stderr=subprocess.STDOUT)
        try:
            result = tail_rollouts(args, proc, log, started, eval_key)
        finally:
            stop_group(proc)
    from slimeflow.cluster import cpu_threads

    result.notes.insert(0, f"1-min load average at start {load:.2f}, at end {os.getloadavg()[0]:.2f}; "
                           f"torch threads: trainer {cpu_threads(1)}, engine {cpu_threads(1)}")
    return result


def tail_rollouts(args, proc: subprocess.Popen, log: Path, started: float, eval_key: str = EVAL_KEY) -> SideResult:
    """Read rollouts.jsonl as it grows; the loop clock starts when the eval before training lands."""
    result, seen, loop_start, phases = None, 0, None, {}
    while True:
        text = log.read_text() if log.exists() else ""
        lines = text[: text.rfind("\n") + 1].splitlines()  # whole lines only: the stage may be mid-write
        now = time.perf_counter()
        for line in lines[seen:]:
            record = json.loads(line)
            if eval_key in record and loop_start is None:
                loop_start = now
                result = SideResult("slimeflow", startup_s=now - started, evals=[(0, record[eval_key])])
            elif eval_key in record:
                result.evals.append((record["step"], record[eval_key]))
                if result.target_step is None and record[eval_key] >= args.target:
                    result.target_step, result.target_s = record["step"], now - loop_start
                    result.target_cpu_s = tree_cpu_seconds(proc.pid)
            else:
                result.steps = record["step"] + 1
                result.eval_s += record.get("time/eval", 0.0)
                for key, value in record.items():
                    if key.startswith(("time/", "rollout/completions_per_s")):
                        phases.setdefault(key, []).append(value)
        seen = len(lines)
        if result is not None:
            result.loop_s = now - loop_start
            done = (result.target_step is not None and result.steps >= result.target_step) \
                or result.steps >= args.max_rollouts or result.loop_s > args.max_seconds
            if done:
                break
        if proc.poll() is not None:
            if result is None:
                raise RuntimeError(f"the train stage exited ({proc.returncode}) before its first eval; "
                                   f"see {log.parent.parent / 'stage.log'}")
            break
        time.sleep(0.1)
    result.notes += phase_notes(phases, result.loop_s)
    return result


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and its live descendants, their reaped children's included."""
    tick, stats = os.sysconf("SC_CLK_TCK"), {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue  # ended while listed
        fields = text[text.rindex(")") + 2:].split()
        stats[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / tick)  # ppid; utime..cstime
    total, frontier = 0.0, [root]
    while frontier:
        pid = frontier.pop()
        total += stats.get(pid, (0, 0.0))[1]
        frontier += [child for child, (parent, _) in stats.items() if parent == pid]
    return total


def phase_notes(phases: dict[str, list[float]], loop_s: float) -> list[str]:
    """Min, median and mean of each `time/*` phase per rollout and its share of the loop (a wide min-to-median
    gap on identical work means the phase waited for the CPU)."""
    notes = []
    for key, values in sorted(phases.items()):
        ordered = sorted(values)
        share = f", {100 * sum(values) / loop_s:.0f}% of the loop" if key.startswith("time/") else ""
        notes.append(f"{key}: min {ordered[0]:.3f} median {ordered[len(values) // 2]:.3f} "
                     f"mean {sum(values) / len(values):.3f}{share} over {len(values)} rollouts")
    return notes


def stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the stage (Ray shuts down in its `finally`), then SIGKILL to whatever is left of its group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def cold_import_seconds() -> float:
    """Wall seconds of a fresh Python importing torch, transformers, datasets and TRL's GRPOTrainer, less those of
    a fresh Python that imports nothing: the part of a TRL script's start-up that this process had already paid."""
    def timed(code: str) -> float:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        return time.perf_counter() - started

    return (timed("import torch, transformers, datasets; from trl import GRPOConfig, GRPOTrainer")
            - timed("pass"))


def run_trl(args, hf: str, workdir: Path) -> SideResult:
    """GRPOTrainer on the same prompt tokens (no BOS: TRL tokenises with add_special_tokens left on)."""
    cold_imports = cold_import_seconds()
    started = time.perf_counter()  # start-up: importing TRL, loading the model, building the trainer
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    load = os.getloadavg()[0]
    tokenizer = AutoTokenizer.from_pretrained(hf, add_bos_token=False)
    # TRL tokenises plain-text prompts as tokenizer(text=prompts), special tokens on: without add_bos_token=False
    # it would see a BOS that slimeflow's rollouts (add_special_tokens=False) do not.
    if tokenizer(text=["1+1="])["input_ids"][0] != tokenizer("1+1=", add_special_tokens=False)["input_ids"]:
        raise RuntimeError("TRL's prompt tokens differ from slimeflow's (a BOS is still added)")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    train = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]}
                               for r in read_jsonl(DATA / "increment-train.jsonl")])
    held_out = read_jsonl(DATA / "increment-eval.jsonl")
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), seed=args.seed, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=args.eval_interval, disable_tqdm=True, max_steps=args.max_rollouts,
        per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,  # counts completions
        num_generations=SAMPLES, max_completion_length=1, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, num_iterations=1, epsilon=0.2, scale_rewards="group", loss_type="grpo",
        bf16=False, gradient_checkpointing=False, use_vllm=False)
    callback = HeldOutCallback(held_out, tokenizer, args)
    trainer = GRPOTrainer(model=model, reward_funcs=prefix_match, args=config, train_dataset=train,
                          processing_class=tokenizer, callbacks=[callback])
    callback.result = SideResult("TRL", startup_s=time.perf_counter() - started, cold_imports_s=cold_imports)
    trainer.train()
    callback.result.notes.append(f"1-min load average at start {load:.2f}, at end {os.getloadavg()[0]:.2f}; "
                                 f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS sets them)")
    return callback.result


def prefix_match(completions: list[str], label: list[str], **_) -> list[float]:
    """slimeflow's prefix_match for these labels: 1.0 when the response starts with the label."""
    return [1.0 if c.startswith(answer) else 0.0 for c, answer in zip(completions, label, strict=True)]


class HeldOutCallback(TrainerCallback):
    """Greedy held-out accuracy before training and every --eval-interval steps; stops at the target or a cap."""

    def __init__(self, held_out: list[dict], tokenizer, args):
        self.prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in held_out]
        self.labels = [r["label"] for r in held_out]
        self.tokenizer, self.args = tokenizer, args
        self.result: SideResult | None = None
        self.loop_start = 0.0

    def greedy(self, model, max_new_tokens: int, **generate_kwargs):
        """The new tokens of greedy `model.generate` over the held-out prompts, left-padded into one batch."""
        import torch

        pad = self.tokenizer.pad_token_id
        width = max(map(len, self.prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in self.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in self.prompts])
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, **generate_kwargs)
        model.train(was_training)
        return out[:, width:]

    def accuracy(self, model) -> float:
        texts = self.tokenizer.batch_decode(self.greedy(model, 1), skip_special_tokens=True)
        return sum(prefix_match(texts, self.labels)) / len(self.labels)

    def on_train_begin(self, args, state, control, model=None, **_):
        self.result.evals.append((0, self.accuracy(model)))
        self.loop_start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **_):
        result, step = self.result, state.global_step
        result.steps, result.loop_s = step, time.perf_counter() - self.loop_start
        if step % self.args.eval_interval == 0 or step == args.max_steps:
            started = time.perf_counter()
            accuracy = self.accuracy(model)
            result.eval_s += time.perf_counter() - started
            result.loop_s = time.perf_counter() - self.loop_start
            result.evals.append((step, accuracy))
            if result.target_step is None and accuracy >= self.args.target:
                result.target_step, result.target_s = step, result.loop_s
                control.should_training_stop = True
        if result.loop_s > self.args.max_seconds:
            control.should_training_stop = True
        return control


def table(args, sides: list[SideResult]) -> list[str]:
    def reached(side: SideResult) -> str:
        if side.target_s is None:
            return f"not reached in {side.steps} steps"
        return f"{side.target_s:.1f}"

    rows = [f"{'':10} {'start-up s':>10} {'completions/s':>13} {'s to target':>26} {'steps to target':>15} "
            f"{'steps run':>9} {'best acc':>8}"]
    for s in sides:
        best = max(acc for _, acc in s.evals)
        rows.append(f"{s.name:10} {s.startup_s + s.cold_imports_s:10.1f} {s.completions_per_s:13.0f} "
                    f"{reached(s):>26} {s.target_step if s.target_step is not None else '-':>15} {s.steps:9d} "
                    f"{best:8.2f}")
    if len(sides) == 2:
        ours, trl = sides
        rows.append(f"slimeflow/TRL completions/s: {ours.completions_per_s / trl.completions_per_s:.2f}x")
        if ours.target_s is not None and trl.target_s is not None:
            rows.append(f"TRL/slimeflow seconds to target: {trl.target_s / ours.target_s:.2f}x "
                        f"(start-up + loop from a fresh process: slimeflow {ours.startup_s + ours.target_s:.1f} s, "
                        f"TRL {trl.cold_imports_s + trl.startup_s + trl.target_s:.1f} s, of which "
                        f"{trl.cold_imports_s:.1f} s importing what this process had imported)")
    return rows


def total_s(side: SideResult) -> float:
    """Seconds from a fresh process to the target (start-up + loop), inf when the target was not reached."""
    if side.target_s is None:
        return float("inf")
    return side.cold_imports_s + side.startup_s + side.target_s


def summary(runs: list[list[SideResult]]) -> list[str]:
    """Medians over seeds of each side's start-up, completions/s and seconds to target, and who got there first."""
    def median(values: list[float]) -> float:
        ordered = sorted(values)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    names = [side.name for side in runs[0]]
    rows = [f"over {len(runs)} seeds (medians): {'':1}{'start-up s':>10} {'completions/s':>13} "
            f"{'s to target':>11} {'steps to target':>15}"]
    for i, name in enumerate(names):
        sides = [run[i] for run in runs]
        steps = [float(s.target_step) if s.target_step is not None else float("inf") for s in sides]
        rows.append(f"{name:28} {median([s.startup_s + s.cold_imports_s for s in sides]):10.1f} "
                    f"{median([s.completions_per_s for s in sides]):13.0f} {median([total_s(s) for s in sides]):11.1f} "
                    f"{median(steps):15.0f}")
    if len(names) == 2:
        first = sum(total_s(ours) < total_s(trl) for ours, trl in runs)
        rows.append(f"slimeflow reached the target first on {first} of {len(runs)} seeds; per seed (slimeflow, TRL "
                    "s to target from a fresh process): "
                    + ", ".join(f"{ours.seed}: {total_s(ours):.1f} vs {total_s(trl):.1f}" for ours, trl in runs))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=0.8, help="held-out greedy accuracy to reach")
    parser.add_argument("--max-rollouts", type=int, default=300, help="step cap of each side")
    parser.add_argument("--eval-interval", type=int, default=10, help="steps between held-out evals")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="loop-time cap of each side")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=None,
                        help="comma-separated seeds, each run on both sides, with medians at the end "
                             "(steps to target is one draw per seed: compare several)")
    parser.add_argument("--only", choices=["both", "slimeflow", "trl"], default="both")
    parser.add_argument("--workdir", type=Path, default=None, help="kept when given (default: a temporary dir)")
    args = parser.parse_args(argv)
    if args.only != "slimeflow":
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit(f"TRL is a benchmark-only dependency; install it with:\n    {TRL_INSTALL}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        hf, train, held_out = prepare(workdir / "prep")
        for seed in args.seeds or [args.seed]:
            seeded = argparse.Namespace(**{**vars(args), "seed": seed})
            sides = []
            if args.only in ("both", "slimeflow"):
                sides.append(run_slimeflow(seeded, hf, train, held_out, workdir / f"slimeflow-{time.time_ns()}"))
            if args.only in ("both", "trl"):
                sides.append(run_trl(seeded, hf, workdir))
            for side in sides:
                side.seed = seed
            runs.append(sides)
            report(seeded, sides)
    if len(runs) > 1:
        print()
        for row in summary(runs):
            print(row)


def report(args, sides: list[SideResult]) -> None:
    print(f"\n{' '.join([sys.executable, *sys.argv])}  (seed {args.seed})")
    print(f"tiny llama hidden 128 (362k params), CPU, {os.cpu_count()} cores; {PROMPTS} prompts x {SAMPLES} samples "
          f"per step, target held-out greedy accuracy >= {args.target}, eval every {args.eval_interval} steps; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for row in table(args, sides):
        print(row)
    for side in sides:
        print(f"{side.name} evals (step, acc): {side.evals}")
        for note in side.notes:
            print(f"  {note}")


if __name__ == "__main__":
    main()
