"""Generated tokens/s: the embedded engine serving 64 concurrent requests vs `model.generate`, same run and model.

The model: by default a tiny Llama (hidden 256, 4 layers) from the factory, with 64 prompts of 16-64 byte tokens
sampled at temperature 1; with --model (an HF directory or a GGUF source such as gguf:smollm2-135m-instruct,
dequantized once into --cache-dir as real_step.py does) the real model, fp32, on the demo's held-out questions
(examples/times_tables/data/times-eval.jsonl, "What is 9 times 12?") rendered through its chat template (default
system prompt included, as the preprocess stage renders them), decoded greedily, so the two sides' outputs are
compared token by token. Two workloads:

- equal: every request generates exactly --max-new-tokens (EOS ignored on both sides: model.generate runs with no
  EOS id). The baseline is model.generate on the whole left-padded batch at once (the fair one), and one-by-one on
  the first --one-by-one prompts.
- varied (tiny model): request i stops after its own length, drawn from 16..--max-new-tokens, as RL responses do.
  stop at EOS (--model): every request stops at the model's EOS or --max-new-tokens, as the demo's evaluation
  asks; model.generate stops when every row has. A static batch runs until its longest row; only the tokens each
  request asked for (up to and including its EOS) are counted for both.

With --samples-per-prompt N (and --model), the workload is a GRPO rollout's instead of an evaluation's: requests/N
questions, each sent N times and sampled at the demo's rollout temperature, as slime's rollout sends a group's
samples; model.generate gets the same repeated rows in one batch, as TRL's GRPOTrainer generates. The engine
prefills a group's shared prompt once; model.generate prefills every row.

The engine runs as a subprocess reached over HTTP (its time includes HTTP and JSON), and again in this process
(its Batcher driven directly), so the HTTP share is visible; every side computes with --threads torch threads on
one long-lived thread: the engine's scheduler thread (model.generate runs on the in-process one; see hf_batch). The HTTP
rows send 64 concurrent requests on fresh connections, as 64 users would; one more row sends SGLang's batch form
(one /generate carrying every prompt, as slimeflow's rollout sends a group).

On a shared machine one run of each side moves with the load, so each side runs --repeats times, interleaved,
and the rows give each side's best run; the CPU-time rows move least with the load: this process's CPU seconds
(the in-process engine against model.generate), and the engine process's CPU seconds over HTTP (the server's
parsing, scheduling and responses; not the client's). A last equal-lengths row splits the in-process runs into
prefill (runs of one new token) and each later token's step, the two ratios the whole-run one is made of.

    .venv/bin/python benchmarks/engine_bench.py [--max-new-tokens 128] [--threads 1] [--one-by-one 8] [--repeats 3]
        [--model gguf:smollm2-135m-instruct --max-new-tokens 12 [--samples-per-prompt 8]]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimeflow.checkpoint.hf_source import materialise
from slimeflow.config.model import ModelConfig
from slimeflow.engine.batcher import Batcher, GenerateRequest
from slimeflow.engine.client import EngineClient
from slimeflow.engine.launch import new_api_key, start_engine
from slimeflow.engine.sampling import SamplingParams
from slimeflow.engine.weights import load_model
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.storage import Storage

SPEC = TinyModelSpec(family="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=512, max_position_embeddings=1024, seed=0)
QUESTIONS = Path(__file__).resolve().parent.parent / "examples" / "times_tables" / "data"
"""times-eval.jsonl (the demo's 64 held-out questions), then times-train.jsonl when more requests are asked for."""

API_KEY = new_api_key()  # the engine's; every request sends it
ROLLOUT_TEMPERATURE = 0.8
"""The real demo's --rollout-temperature (examples/demo-real.yaml), for the rollout workload (--samples-per-prompt)."""


@dataclass(frozen=True)
class Workload:
    """What both sides serve: the prompts, how they decode, and the second workload's per-request lengths (with
    `stop_at_eos`, every request may stop early at EOS; without, it generates exactly its length)."""

    label: str
    prompts: list[list[int]]
    temperature: float
    lengths: list[int]
    stop_at_eos: bool
    eos_ids: tuple[int, ...]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_workload(n: int, max_new: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n prompts of 16-64 ASCII byte tokens and n varied response lengths in [16, max_new]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(32, 127) for _ in range(rng.randint(16, 64))] for _ in range(n)]
    return prompts, [rng.randint(min(16, max_new), max_new) for _ in range(n)]


def chat_prompts(model_dir: Path, n: int) -> list[list[int]]:
    """The first n demo questions as token ids through the model's chat template (system prompt included)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for name in ("times-eval.jsonl", "times-train.jsonl")
            for line in (QUESTIONS / name).read_text(encoding="utf-8").splitlines()]
    if n > len(rows):
        raise SystemExit(f"--requests {n}: the times-table files hold {len(rows)} questions; ask for fewer")
    texts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
             for row in rows[:n]]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def build_workload(args: argparse.Namespace, model_dir: Path, eos_ids: tuple[int, ...]) -> Workload:
    n, max_new = args.requests, args.max_new_tokens
    if args.model is None:
        if args.samples_per_prompt != 1:
            raise SystemExit("--samples-per-prompt groups the real model's chat prompts: give --model too")
        prompts, lengths = make_workload(n, max_new)
        return Workload("tiny llama hidden 256, 4 layers; prompts 16-64 byte tokens", prompts,
                        1.0 if args.temperature is None else args.temperature, lengths, False, eos_ids)
    group = args.samples_per_prompt
    if n % group:
        raise SystemExit(f"--requests {n} is not a multiple of --samples-per-prompt {group}: every prompt's group is "
                         "whole; pick a multiple")
    # A rollout's groups: each question sent `group` times in a row, as the rollout sends a group's samples.
    prompts = [prompt for prompt in chat_prompts(model_dir, n // group) for _ in range(group)]
    default_t = 0.0 if group == 1 else ROLLOUT_TEMPERATURE
    label = ("the demo's times-table questions through the chat template" if group == 1 else
             f"{n // group} of the demo's times-table questions x {group} samples each (a rollout's groups)")
    return Workload(f"{args.model}; {label}", prompts, default_t if args.temperature is None else args.temperature,
                    [max_new] * n, True, eos_ids)


def hf_batch(batcher: Batcher, model, prompts: list[list[int]], max_new: int, pad_id: int, temperature: float,
             eos_ids: tuple[int, ...] | None = None) -> tuple[float, list[list[int]]]:
    """Seconds for model.generate over the whole left-padded batch, and each row's new tokens; without `eos_ids`
    every row generates exactly max_new tokens (no EOS id: none is suppressed, none stops a row; `model`'s
    generation_config must hold no eos_token_id, which generate would fill in: see main).

    It runs on the in-process engine's scheduler thread (idle in between), so that both sides compute on the same
    long-lived thread with the same torch threads. Compute on any other thread would make a second OpenMP team,
    and GNU OpenMP stops spin-waiting once a process has more team threads than cores: with 2 threads, a decode
    step took 9.2 ms instead of 4.7 ms, and model.generate 1.8 s instead of 1.2 s.
    """
    return batcher._call(lambda: _hf_batch(model, prompts, max_new, pad_id, temperature, eos_ids)).result()


def _hf_batch(model, prompts: list[list[int]], max_new: int, pad_id: int, temperature: float,
              eos_ids: tuple[int, ...] | None) -> tuple[float, list[list[int]]]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    config = copy.deepcopy(model.generation_config)
    config.pad_token_id, config.eos_token_id = pad_id, list(eos_ids) if eos_ids else None
    config.max_new_tokens, config.do_sample = max_new, temperature > 0
    config.temperature, config.top_k, config.top_p = (temperature, 0, 1.0) if temperature > 0 else (None, None, None)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    seconds = time.perf_counter() - start
    assert eos_ids or out.shape[1] - longest == max_new, "model.generate stopped early: an EOS id was set"
    return seconds, out[:, longest:].tolist()


def _request(i: int, n: int, temperature: float, stop_at_eos: bool) -> dict:
    return {"temperature": temperature, "max_new_tokens": n, "ignore_eos": not stop_at_eos, "sampling_seed": i}


async def engine_run(url: str, prompts: list[list[int]], lengths: list[int], temperature: float,
                     stop_at_eos: bool = False) -> tuple[float, list[list[int]]]:
    """Seconds and each request's output ids, all requests sent at once to the engine."""
    async with EngineClient(url, api_key=API_KEY, timeout_s=600) as client:
        start = time.perf_counter()
        responses = await asyncio.gather(*(client.generate(p, _request(i, n, temperature, stop_at_eos))
                                           for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))))
        seconds = time.perf_counter() - start
    return seconds, [r["output_ids"] for r in responses]


async def engine_batch_run(url: str, prompts: list[list[int]], lengths: list[int], temperature: float,
                           stop_at_eos: bool = False) -> tuple[float, list[list[int]]]:
    """Seconds and output ids for the same requests sent as one batched /generate."""
    async with EngineClient(url, api_key=API_KEY, timeout_s=600) as client:
        start = time.perf_counter()
        responses = await client.generate_batch(prompts, [_request(i, n, temperature, stop_at_eos)
                                                          for i, n in enumerate(lengths)])
        seconds = time.perf_counter() - start
    return seconds, [r["output_ids"] for r in responses]


def in_process_run(batcher: Batcher, prompts: list[list[int]], lengths: list[int], temperature: float,
                   stop_at_eos: bool = False) -> tuple[float, list[list[int]]]:
    """Seconds and output ids for the same requests submitted straight to a Batcher (no HTTP, no JSON)."""
    start = time.perf_counter()
    futures = [batcher.submit(GenerateRequest(rid=str(i), input_ids=p, params=SamplingParams(
        temperature=temperature, max_new_tokens=n, ignore_eos=not stop_at_eos, sampling_seed=i)))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    results = [f.result() for f in futures]
    seconds = time.perf_counter() - start
    return seconds, [r.output_ids for r in results]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one-by-one", type=int, default=8, help="prompts for the one-by-one baseline")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, interleaved; the best is reported")
    parser.add_argument("--model", default=None,
                        help="an HF directory or a GGUF source (gguf:smollm2-135m-instruct); default: the tiny model")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "slimeflow" / "bench-models",
                        help="where a GGUF source is dequantized (once)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="both sides' temperature (0: greedy); default 1 on the tiny model, 0 with --model, "
                             f"{ROLLOUT_TEMPERATURE} with --samples-per-prompt above 1")
    parser.add_argument("--samples-per-prompt", type=int, default=1,
                        help="with --model: requests/N questions, each sent N times (a GRPO rollout's groups, as "
                             "slime's --n-samples-per-prompt); model.generate gets the same repeated rows, as TRL's "
                             "GRPOTrainer batches them")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # this thread only orchestrates: see hf_batch
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (build_tiny_model(Path(tmp) / "tiny", SPEC) if args.model is None else
                     materialise(ModelConfig(hf_checkpoint=args.model, cache_dir=str(args.cache_dir)), Storage(),
                                 args.cache_dir))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        pad = int(model.generation_config.pad_token_id)
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None  # else generate fills it in when a call runs without EOS
        work = build_workload(args, model_dir, tuple(eos if isinstance(eos, list) else [eos]))
        with start_engine(model_dir, num_threads=args.threads, max_batch_size=args.requests,
                          api_key=API_KEY) as engine:
            batcher = Batcher(load_model(model_dir, device="cpu"), max_batch_size=args.requests,
                              num_threads=args.threads)
            batcher.start()
            try:
                few, t = work.prompts[:4], work.temperature
                asyncio.run(engine_run(engine.url, few, [8] * 4, t))  # warm-up
                in_process_run(batcher, few, [8] * 4, t)
                hf_batch(batcher, model, few, 8, pad, t)
                engines = Engines(url=engine.url, server=psutil.Process(engine.process.pid), batcher=batcher)
                rows = report(args, model, pad, engines, work)
            finally:
                batcher.stop()
    print(f"\n{' '.join([sys.executable, *sys.argv])}")
    print(f"1-min load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    for row in rows:
        print(row)


@dataclass(frozen=True)
class Engines:
    """The engine twice: a server process at `url`, and a Batcher in this process (whose scheduler thread also
    runs model.generate: see hf_batch)."""

    url: str
    server: psutil.Process
    batcher: Batcher


def report(args, model, pad: int, engines: Engines, work: Workload) -> list[str]:
    prompts = work.prompts
    n, max_new = len(prompts), args.max_new_tokens
    sizes = sorted(len(p) for p in prompts)
    rows = [f"model: {work.label}; fp32, CPU, {args.threads} torch thread(s); {n} requests, prompts "
            f"{sizes[0]}-{sizes[-1]} tokens ({sum(sizes)} in all), "
            f"{'greedy' if work.greedy else f'temperature {work.temperature:g}'}; "
            f"best of {args.repeats} interleaved runs per side"]
    http, one_post, local, batch = _best_runs(args.repeats, engines, model, pad, work, [max_new] * n, False)
    single = prompts[: args.one_by_one]
    single_s = sum(hf_batch(engines.batcher, model, [p], max_new, pad, work.temperature)[0] for p in single)
    batch_tps, single_tps = n * max_new / batch.wall_s, len(single) * max_new / single_s
    rows += [f"equal lengths ({max_new} new tokens each, EOS ignored):",
             *_engine_rows(f"engine, {n} concurrent over HTTP", n, http, one_post, local, batch_tps),
             f"  model.generate, batch of {n}     : {batch_tps:8.0f} tok/s ({batch.wall_s:.2f} s)",
             f"  model.generate, one by one ({len(single)}) : {single_tps:8.0f} tok/s  "
             f"engine/one-by-one = {http.tokens / http.wall_s / single_tps:.2f}x",
             _cpu_row(local, batch, n * max_new), _http_cpu_row(http, batch, n * max_new),
             _split_row(args.repeats, engines.batcher, model, pad, work, local, batch, max_new),
             _match_row(work, local, http, batch)]
    http, one_post, local, batch = _best_runs(args.repeats, engines, model, pad, work, work.lengths,
                                              work.stop_at_eos)
    useful = batch.tokens
    useful_tps = useful / batch.wall_s
    title = (f"stop at EOS (at most {max_new} new tokens; {useful} tokens produced)" if work.stop_at_eos else
             f"varied lengths (16..{max_new}, {sum(work.lengths)} tokens asked for)")
    rows += [f"{title}; the static batch runs to its longest row:",
             *_engine_rows("engine over HTTP", n, http, one_post, local, useful_tps),
             f"  model.generate, batch of {n}     : {useful_tps:8.0f} useful tok/s ({batch.wall_s:.2f} s)",
             _cpu_row(local, batch, useful), _http_cpu_row(http, batch, useful), _match_row(work, local, http, batch)]
    return rows


def _engine_rows(http_label: str, n: int, http: Run, one_post: Run, local: Run, baseline_tps: float) -> list[str]:
    """The engine's three rows (HTTP requests, one batched /generate, in process), each as a ratio to the baseline."""
    sides = ((f"{http_label:<32}", http), (f"{f'engine, one /generate of {n}':<32}", one_post),
             (f"{'engine in process (no HTTP)':<32}", local))
    return [f"  {label}: {run.tokens / run.wall_s:8.0f} tok/s  engine/batch = {run.tokens / run.wall_s / baseline_tps:.2f}x"
            for label, run in sides]


@dataclass(frozen=True)
class Run:
    """One side's run: wall seconds, the generating process's CPU seconds (this one, or the engine server's for
    the HTTP sides), tokens generated (model.generate's: the useful ones) and each request's output ids."""

    wall_s: float
    cpu_s: float
    tokens: int
    outputs: list[list[int]]


def _useful(outputs: list[list[int]], lengths: list[int], eos_ids: tuple[int, ...] | None) -> list[list[int]]:
    """Each row cut to the tokens its request asked for: its length, and (with `eos_ids`) up to its first EOS."""
    cut = []
    for row, length in zip(outputs, lengths, strict=True):
        row = row[:length]
        if eos_ids:
            ends = [i for i, token in enumerate(row) if token in eos_ids]
            row = row[: ends[0] + 1] if ends else row
        cut.append(row)
    return cut


def _timed(fn: Callable[[], tuple[float, list[list[int]]]], process: psutil.Process) -> Run:
    """Run `fn` (returning its own wall seconds, which leave out set-up, and its outputs, cut to the useful tokens)
    and count `process`'s CPU time."""
    def cpu() -> float:
        times = process.cpu_times()
        return times.user + times.system

    before = cpu()
    wall_s, outputs = fn()
    return Run(wall_s=wall_s, cpu_s=cpu() - before, tokens=sum(map(len, outputs)), outputs=outputs)


def _best_runs(repeats: int, engines: Engines, model, pad: int, work: Workload, lengths: list[int],
               stop_at_eos: bool) -> tuple[Run, Run, Run, Run]:
    """The fastest of `repeats` runs of the engine over HTTP (concurrent requests, then one batched request), in
    process and model.generate, interleaved."""
    url, batcher, here, prompts, t = engines.url, engines.batcher, psutil.Process(), work.prompts, work.temperature

    def batch() -> tuple[float, list[list[int]]]:
        eos_ids = work.eos_ids if stop_at_eos else None
        seconds, outputs = hf_batch(batcher, model, prompts, max(lengths), pad, t, eos_ids)
        return seconds, _useful(outputs, lengths, eos_ids)

    sides: dict[str, Callable[[], tuple[float, list[list[int]]]]] = {
        "http": lambda: asyncio.run(engine_run(url, prompts, lengths, t, stop_at_eos)),
        "http_batch": lambda: asyncio.run(engine_batch_run(url, prompts, lengths, t, stop_at_eos)),
        "local": lambda: in_process_run(batcher, prompts, lengths, t, stop_at_eos),
        "batch": batch,
    }
    runs: dict[str, list[Run]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, fn in sides.items():
            runs[side].append(_timed(fn, engines.server if side.startswith("http") else here))
    http, one_post, local, batch_run = (min(runs[side], key=lambda r: r.wall_s) for side in sides)
    return http, one_post, local, batch_run


def _match_row(work: Workload, local: Run, http: Run, batch: Run) -> str:
    """Greedy: how many of the engine's tokens equal model.generate's at the same position of the same request
    (float rounding can flip a near tie, after which a row goes its own way)."""
    if not work.greedy:
        return "  outputs                         : sampled (the sides draw differently): not compared"
    parts = []
    for label, run in (("in process", local), ("HTTP", http)):
        same = sum(a == b for ours, theirs in zip(run.outputs, batch.outputs, strict=True)
                   for a, b in zip(ours, theirs, strict=False))
        total = sum(max(len(a), len(b)) for a, b in zip(run.outputs, batch.outputs, strict=True))
        rows = sum(a == b for a, b in zip(run.outputs, batch.outputs, strict=True))
        parts.append(f"{label} {same}/{total} tokens ({same / total:.1%}), {rows}/{len(run.outputs)} rows identical")
    return "  greedy outputs vs model.generate: " + "; ".join(parts)


def _split_row(repeats: int, batcher: Batcher, model, pad: int, work: Workload, local: Run,
               batch: Run, max_new: int) -> str:
    """Prefill (best of `repeats` interleaved runs of one new token) and each later token's step (the rest of the
    best equal-lengths runs), engine in process against model.generate: the two parts of the whole-run ratio."""
    prompts, t = work.prompts, work.temperature
    engine_runs, batch_runs = [], []
    for _ in range(repeats):
        engine_runs.append(in_process_run(batcher, prompts, [1] * len(prompts), t)[0])
        batch_runs.append(hf_batch(batcher, model, prompts, 1, pad, t)[0])
    engine_first, batch_first = min(engine_runs), min(batch_runs)
    engine_step = (local.wall_s - engine_first) / max(max_new - 1, 1) * 1e3
    batch_step = (batch.wall_s - batch_first) / max(max_new - 1, 1) * 1e3
    return (f"  split (in process)              : prefill + first token engine {engine_first:.3f} s, model.generate "
            f"{batch_first:.3f} s ({batch_first / engine_first:.2f}x); each later token {engine_step:.2f} ms vs "
            f"{batch_step:.2f} ms ({batch_step / engine_step:.2f}x)")


def _cpu_row(local: Run, batch: Run, useful_tokens: int) -> str:
    engine_rate, batch_rate = local.tokens / local.cpu_s, useful_tokens / batch.cpu_s
    return (f"  per CPU second (in process)     : engine {engine_rate:6.0f} tok, model.generate {batch_rate:6.0f} "
            f"useful tok  engine/batch = {engine_rate / batch_rate:.2f}x")


def _http_cpu_row(http: Run, batch: Run, useful_tokens: int) -> str:
    engine_rate, batch_rate = http.tokens / http.cpu_s, useful_tokens / batch.cpu_s
    return (f"  per CPU second (HTTP, server)   : engine {engine_rate:6.0f} tok, model.generate {batch_rate:6.0f} "
            f"useful tok  engine/batch = {engine_rate / batch_rate:.2f}x")


if __name__ == "__main__":
    main()
