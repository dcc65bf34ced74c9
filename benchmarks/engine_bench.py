"""Generated tokens/s: the embedded engine serving 64 concurrent requests vs `model.generate`, same run and model.

A tiny Llama (hidden 256, 4 layers) from the factory; 64 prompts of 16-64 byte tokens, temperature 1. Two
workloads:

- equal: every request generates exactly --max-new-tokens (EOS ignored). The baseline is model.generate on the
  whole left-padded batch of 64 at once (the fair one), and one-by-one on the first --one-by-one prompts.
- varied: request i stops after its own length, drawn from 16..--max-new-tokens, as RL responses do. A static
  batch runs until its longest row; only the tokens each request asked for are counted for both.

The engine runs as a subprocess reached over HTTP (its time includes HTTP and JSON), and again in this process
(its Batcher driven directly), so the HTTP share is visible; every side computes with --threads torch threads on
one long-lived thread: the engine's scheduler thread (model.generate runs on the in-process one; see hf_batch). The HTTP
rows send 64 concurrent requests on fresh connections, as 64 users would; one more row sends SGLang's batch form
(one /generate carrying every prompt, as slimeflow's rollout sends a group), for information.

On a shared machine one run of each side moves with the load, so each side runs --repeats times, interleaved,
and the rows give each side's best run; the CPU-time rows move least with the load: this process's CPU seconds
(the in-process engine against model.generate), and the engine process's CPU seconds over HTTP (the server's
parsing, scheduling and responses; not the client's). A last equal-lengths row splits the in-process runs into
prefill (runs of one new token) and each later token's step, the two ratios the whole-run one is made of.

    .venv/bin/python benchmarks/engine_bench.py [--max-new-tokens 128] [--threads 1] [--one-by-one 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM

from slimeflow.engine.batcher import Batcher, GenerateRequest
from slimeflow.engine.client import EngineClient
from slimeflow.engine.launch import new_api_key, start_engine
from slimeflow.engine.sampling import SamplingParams
from slimeflow.engine.weights import load_model
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

SPEC = TinyModelSpec(family="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=512, max_position_embeddings=1024, seed=0)

API_KEY = new_api_key()  # the engine's; every request sends it


def make_workload(n: int, max_new: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n prompts of 16-64 ASCII byte tokens and n varied response lengths in [16, max_new]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(32, 127) for _ in range(rng.randint(16, 64))] for _ in range(n)]
    return prompts, [rng.randint(min(16, max_new), max_new) for _ in range(n)]


def hf_batch(batcher: Batcher, model, prompts: list[list[int]], max_new: int, pad_id: int) -> float:
    """Seconds for model.generate over the whole left-padded batch, sampling exactly max_new tokens per row.

    It runs on the in-process engine's scheduler thread (idle in between), so that both sides compute on the same
    long-lived thread with the same torch threads. Compute on any other thread would make a second OpenMP team,
    and GNU OpenMP stops spin-waiting once a process has more team threads than cores: with 2 threads, a decode
    step took 9.2 ms instead of 4.7 ms, and model.generate 1.8 s instead of 1.2 s.
    """
    return batcher._call(lambda: _hf_batch(model, prompts, max_new, pad_id)).result()


def _hf_batch(model, prompts: list[list[int]], max_new: int, pad_id: int) -> float:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id)
    seconds = time.perf_counter() - start
    assert out.shape[1] - longest == max_new
    return seconds


async def engine_run(url: str, prompts: list[list[int]], lengths: list[int]) -> tuple[float, int]:
    """Seconds and generated tokens for all requests sent at once to the engine."""
    async with EngineClient(url, api_key=API_KEY, timeout_s=600) as client:
        start = time.perf_counter()
        responses = await asyncio.gather(*(
            client.generate(p, {"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": i})
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))))
        seconds = time.perf_counter() - start
    return seconds, sum(r["meta_info"]["completion_tokens"] for r in responses)


async def engine_batch_run(url: str, prompts: list[list[int]], lengths: list[int]) -> tuple[float, int]:
    """Seconds and generated tokens for the same requests sent as one batched /generate."""
    async with EngineClient(url, api_key=API_KEY, timeout_s=600) as client:
        start = time.perf_counter()
        responses = await client.generate_batch(prompts, [
            {"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": i}
            for i, n in enumerate(lengths)])
        seconds = time.perf_counter() - start
    return seconds, sum(r["meta_info"]["completion_tokens"] for r in responses)


def in_process_run(batcher: Batcher, prompts: list[list[int]], lengths: list[int]) -> tuple[float, int]:
    """Seconds and generated tokens for the same requests submitted straight to a Batcher (no HTTP, no JSON)."""
    start = time.perf_counter()
    futures = [batcher.submit(GenerateRequest(rid=str(i), input_ids=p, params=SamplingParams(
        temperature=1.0, max_new_tokens=n, ignore_eos=True, sampling_seed=i)))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    results = [f.result() for f in futures]
    seconds = time.perf_counter() - start
    return seconds, sum(len(r.output_ids) for r in results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one-by-one", type=int, default=8, help="prompts for the one-by-one baseline")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, interleaved; the best is reported")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # this thread only orchestrates: see hf_batch
    prompts, lengths = make_workload(args.requests, args.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", SPEC)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        pad = int(model.generation_config.pad_token_id)
        with start_engine(model_dir, num_threads=args.threads, max_batch_size=args.requests,
                          api_key=API_KEY) as engine:
            batcher = Batcher(load_model(model_dir, device="cpu"), max_batch_size=args.requests,
                              num_threads=args.threads)
            batcher.start()
            try:
                asyncio.run(engine_run(engine.url, prompts[:4], [8] * 4))  # warm-up
                in_process_run(batcher, prompts[:4], [8] * 4)
                hf_batch(batcher, model, prompts[:4], 8, pad)
                engines = Engines(url=engine.url, server=psutil.Process(engine.process.pid), batcher=batcher)
                rows = report(args, model, pad, engines, prompts, lengths)
            finally:
                batcher.stop()
    print(f"\n{' '.join([sys.executable, *sys.argv])}")
    for row in rows:
        print(row)


@dataclass(frozen=True)
class Engines:
    """The engine twice: a server process at `url`, and a Batcher in this process (whose scheduler thread also
    runs model.generate: see hf_batch)."""

    url: str
    server: psutil.Process
    batcher: Batcher


def report(args, model, pad: int, engines: Engines, prompts: list[list[int]],
           lengths: list[int]) -> list[str]:
    n, max_new = len(prompts), args.max_new_tokens
    rows = [f"model: tiny llama hidden 256, 4 layers, fp32, CPU, {args.threads} torch thread(s); "
            f"{n} requests, prompts 16-64 tokens, temperature 1; best of {args.repeats} interleaved runs per side"]
    http, one_post, local, batch = _best_runs(args.repeats, engines, model, pad, prompts, [max_new] * n, max_new)
    single = prompts[: args.one_by_one]
    single_s = sum(hf_batch(engines.batcher, model, [p], max_new, pad) for p in single)
    batch_tps, single_tps = n * max_new / batch.wall_s, len(single) * max_new / single_s
    rows += [f"equal lengths ({max_new} new tokens each):",
             *_engine_rows(f"engine, {n} concurrent over HTTP", n, http, one_post, local, batch_tps),
             f"  model.generate, batch of {n}     : {batch_tps:8.0f} tok/s ({batch.wall_s:.2f} s)",
             f"  model.generate, one by one ({len(single)}) : {single_tps:8.0f} tok/s  "
             f"engine/one-by-one = {http.tokens / http.wall_s / single_tps:.2f}x",
             _cpu_row(local, batch, n * max_new), _http_cpu_row(http, batch, n * max_new),
             _split_row(args.repeats, engines.batcher, model, pad, prompts, local, batch, max_new)]
    http, one_post, local, batch = _best_runs(args.repeats, engines, model, pad, prompts, lengths, max(lengths))
    useful_tps = sum(lengths) / batch.wall_s
    rows += [f"varied lengths (16..{max_new}, {sum(lengths)} tokens asked for; the static batch runs to the longest):",
             *_engine_rows("engine over HTTP", n, http, one_post, local, useful_tps),
             f"  model.generate, batch of {n}     : {useful_tps:8.0f} useful tok/s ({batch.wall_s:.2f} s)",
             _cpu_row(local, batch, sum(lengths)), _http_cpu_row(http, batch, sum(lengths))]
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
    the HTTP sides) and tokens generated."""

    wall_s: float
    cpu_s: float
    tokens: int


def _timed(fn: Callable[[], tuple[float, int]], process: psutil.Process) -> Run:
    """Run `fn` (returning its own wall seconds, which leave out set-up, and its tokens) and count `process`'s CPU
    time."""
    def cpu() -> float:
        times = process.cpu_times()
        return times.user + times.system

    before = cpu()
    wall_s, tokens = fn()
    return Run(wall_s=wall_s, cpu_s=cpu() - before, tokens=tokens)


def _best_runs(repeats: int, engines: Engines, model, pad: int, prompts: list[list[int]],
               lengths: list[int], batch_new: int) -> tuple[Run, Run, Run, Run]:
    """The fastest of `repeats` runs of the engine over HTTP (concurrent requests, then one batched request), in
    process and model.generate, interleaved."""
    url, batcher, here = engines.url, engines.batcher, psutil.Process()
    sides: dict[str, Callable[[], tuple[float, int]]] = {
        "http": lambda: asyncio.run(engine_run(url, prompts, lengths)),
        "http_batch": lambda: asyncio.run(engine_batch_run(url, prompts, lengths)),
        "local": lambda: in_process_run(batcher, prompts, lengths),
        "batch": lambda: (hf_batch(batcher, model, prompts, batch_new, pad), len(prompts) * batch_new),
    }
    runs: dict[str, list[Run]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, fn in sides.items():
            runs[side].append(_timed(fn, engines.server if side.startswith("http") else here))
    http, one_post, local, batch = (min(runs[side], key=lambda r: r.wall_s) for side in sides)
    return http, one_post, local, batch


def _split_row(repeats: int, batcher: Batcher, model, pad: int, prompts: list[list[int]], local: Run,
               batch: Run, max_new: int) -> str:
    """Prefill (best of `repeats` interleaved runs of one new token) and each later token's step (the rest of the
    best equal-lengths runs), engine in process against model.generate: the two parts of the whole-run ratio."""
    engine_runs, batch_runs = [], []
    for _ in range(repeats):
        engine_runs.append(in_process_run(batcher, prompts, [1] * len(prompts))[0])
        batch_runs.append(hf_batch(batcher, model, prompts, 1, pad))
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
