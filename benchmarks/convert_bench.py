"""HF -> torch_dist conversion of a synthetic ~2 GB bf16 Llama-style model, against `cp` of the same files.

    .venv/bin/python benchmarks/convert_bench.py [--layers 20] [--rounds 3] [--workdir /tmp] [--family deepseek_v3]
                                                 [--against CHECKOUT]

`--family deepseek_v3` writes a ~2 GB DeepSeek-V3-style mixture of experts instead (8 layers by default: MLA, one
dense first layer, 16 experts of which each layer stores every one, a shared expert, the fp32 expert bias), whose
experts the converter writes as shards of each layer's [experts, ...] tensor straight from the HF files, and whose
layers it keys one by one; with two processes each rank converts 8 of every MoE layer's 16 experts
(expert-sharded), and prints what it read and held.

Prints, for 1 and 2 conversion processes: wall time as a ratio to `cp -r` + `sync` of the HF directory, timed
after a `sync` so that it flushes only the copy (goal <= 2x); cp and the two conversions run interleaved for
--rounds rounds, and the ratio of medians is the figure (a single cp moved between 1.7 and 5 s here). The last
round prints each rank's timeline from its launch (start-up and imports, tensors read and fused, saved: the last
span is writing the data files, their fsync and rank 0's index); and each rank's peak RSS as a fraction of the
model's size (goals <= 1.1 with one process, <= 0.6 with two). Peak RSS is the rank's VmHWM: resident anonymous
and file-backed pages alike (the HF pages it maps as it writes them out count). The baseline RSS of a process
that has only imported what a rank imports is printed as well: it is part of every rank's figure. On a shared
machine the wall-time ratio moves with the load (printed); the CPU seconds of the copy and of each conversion
(user + system, all their processes) do not, and say what the load will cost.

`--against CHECKOUT` also times, in each round after this checkout's, the same conversions by another checkout of
slimeflow (say `git archive <commit> | tar -x -C CHECKOUT`, with a .venv whose editable install points there): its
.venv/bin/python converts in a process of its own, timed as here (after its imports), for a before/after ratio
under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, publish_release, read_hf_source
from slimeflow.families.tiny import build_tiny_tokenizer
from slimeflow.io.storage import Storage

SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 4,
         "vocab_size": 32000}


def write_shards(path: Path, shards: list[dict[str, torch.Tensor]]) -> int:
    """Each dict as one safetensors shard, with the index HF writes; returns the total bytes."""
    weight_map, total = {}, 0
    for n, tensors in enumerate(shards, start=1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def write_synthetic_model(path: Path, layers: int) -> int:
    """A Llama-architecture HF directory with random bf16 weights, one safetensors shard per layer; its bytes."""
    path.mkdir(parents=True)
    h, ffn, heads, kv, vocab = (SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                   "num_key_value_heads", "vocab_size"))
    head_dim = h // heads
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    shards = [{"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": rand(h),
               "lm_head.weight": rand(vocab, h)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append({p + "input_layernorm.weight": rand(h), p + "post_attention_layernorm.weight": rand(h),
                       p + "self_attn.q_proj.weight": rand(heads * head_dim, h),
                       p + "self_attn.k_proj.weight": rand(kv * head_dim, h),
                       p + "self_attn.v_proj.weight": rand(kv * head_dim, h),
                       p + "self_attn.o_proj.weight": rand(h, heads * head_dim),
                       p + "mlp.gate_proj.weight": rand(ffn, h), p + "mlp.up_proj.weight": rand(ffn, h),
                       p + "mlp.down_proj.weight": rand(h, ffn)})
    total = write_shards(path, shards)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "head_dim": head_dim,
              "dtype": "bfloat16", **SHAPE}
    (path / "config.json").write_text(json.dumps(config))
    build_tiny_tokenizer("llama").save_pretrained(path)
    return total


MOE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": 512, "kv_lora_rank": 256, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 2, "topk_group": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 32000,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False, "rope_interleave": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "dtype": "bfloat16",
}


def write_synthetic_moe(path: Path, layers: int) -> int:
    """A DeepSeek-V3-architecture HF directory with random bf16 weights (the expert bias fp32, as DeepSeek ships
    it), every tensor the family's name map expects, one safetensors shard per layer; its bytes."""
    from slimeflow.checkpoint.mapping import ModelShape, expected_hf_tensors
    from slimeflow.families import FAMILIES

    path.mkdir(parents=True)
    config = {**MOE_CONFIG, "num_hidden_layers": layers}
    shapes = expected_hf_tensors(ModelShape.from_hf_config(config, FAMILIES["deepseek_v3"]))
    generator = torch.Generator().manual_seed(0)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in shapes.items():
        shard = name.split(".")[2] if name.startswith("model.layers.") else "globals"
        dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        shards.setdefault(shard, {})[name] = (torch.randn(*shape, generator=generator) * 0.02).to(dtype)
    total = write_shards(path, list(shards.values()))
    (path / "config.json").write_text(json.dumps(config))
    build_tiny_tokenizer("deepseek_v3").save_pretrained(path)
    return total


def baseline_rss() -> int:
    """Peak RSS of a fresh process that imports what a conversion rank imports, and nothing more."""
    code = "from slimeflow.checkpoint import worker\nprint(worker.peak_rss_bytes()['peak_rss'])"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
               .stdout.split()[-1])


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children (and theirs, once waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_copy(hf: Path, work: Path) -> tuple[float, float]:
    """Wall and CPU seconds of `cp -r` + `sync` of the HF directory, after a `sync` (the model's own dirty
    pages are not the copy's to flush)."""
    subprocess.run(["sync"], check=True)
    started, cpu = time.perf_counter(), children_cpu_seconds()
    subprocess.run(["cp", "-r", str(hf), str(work / "copy")], check=True)
    subprocess.run(["sync"], check=True)
    seconds, cpu = time.perf_counter() - started, children_cpu_seconds() - cpu
    shutil.rmtree(work / "copy")
    return seconds, cpu


def time_conversion(source, root: Path, processes: int) -> tuple[float, float, list[dict]]:
    """Wall and CPU seconds of converting, publishing and `sync`, and each rank's report."""
    subprocess.run(["sync"], check=True)
    started, launched, cpu = time.perf_counter(), time.time(), children_cpu_seconds()
    staged, ranks = convert_hf_to_torch_dist(source, root, processes)
    publish_release(Storage(), staged, str(root))
    subprocess.run(["sync"], check=True)
    seconds, cpu = time.perf_counter() - started, children_cpu_seconds() - cpu
    shutil.rmtree(root)
    return seconds, cpu, [{**r, "launched": launched} for r in ranks]


AGAINST = """
import subprocess, shutil, sys, time
from pathlib import Path
from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, publish_release, read_hf_source
from slimeflow.io.storage import Storage
source, root = read_hf_source(Path(sys.argv[1])), Path(sys.argv[2])
subprocess.run(["sync"], check=True)
started = time.perf_counter()
staged, _ = convert_hf_to_torch_dist(source, root, int(sys.argv[3]))
publish_release(Storage(), staged, str(root))
subprocess.run(["sync"], check=True)
print(time.perf_counter() - started)
shutil.rmtree(root)
"""


def time_conversion_of(checkout: Path, hf: Path, root: Path, processes: int) -> float:
    """Wall seconds of the conversion as time_conversion measures it, by the slimeflow of `checkout`."""
    done = subprocess.run([str(checkout / ".venv/bin/python"), "-c", AGAINST, str(hf), str(root), str(processes)],
                          cwd=checkout, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def print_ranks(ranks: list[dict], size: int, base: int, goal: float) -> None:
    for r in ranks:
        print(f"  rank {r['rank']}: peak RSS {r['peak_rss'] / 1e9:.2f} GB = {r['peak_rss'] / size:.2f} "
              f"of the model (goal <= {goal}); net of the baseline {(r['peak_rss'] - base) / size:.2f}")
        if r["experts"][1]:
            print(f"    routed experts [{r['experts'][0]}, {r['experts'][1]}) of every MoE layer; read "
                  f"{r['read_tensors']} HF tensors, {r['read_bytes'] / size:.2f} of the model; held and wrote "
                  f"{r['bytes'] / size:.2f}")
        launched = r["launched"]
        print(f"    seconds from launch: start-up and imports {r['started_at'] - launched:.2f}, tensors "
              f"read and fused {r['read_at'] - launched:.2f}, saved {r['saved_at'] - launched:.2f}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=("llama", "deepseek_v3"), default="llama")
    parser.add_argument("--layers", type=int, default=None, help="default: 20 (llama), 8 (deepseek_v3)")
    parser.add_argument("--rounds", type=int, default=3, help="cp, 1 and 2 processes, interleaved this many times")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--against", type=Path, help="another slimeflow checkout to time in each round too")
    options = parser.parse_args()
    Path(options.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="convert-bench-", dir=options.workdir))
    try:
        hf = work / "hf"
        moe = options.family == "deepseek_v3"
        layers = options.layers or (8 if moe else 20)
        size = (write_synthetic_moe if moe else write_synthetic_model)(hf, layers)
        print(f"synthetic {options.family} model: {layers} layers, {size / 1e9:.2f} GB bf16 in {len(list(hf.glob('*.safetensors')))} files")
        base = baseline_rss()
        print(f"baseline RSS of a process importing what a rank imports: {base / 1e9:.2f} GB "
              f"({base / size:.2f} of the model)")
        source = read_hf_source(hf)
        walls: dict[str | int, list[float]] = {"cp": [], 1: [], 2: [], -1: [], -2: []}
        for round_ in range(1, options.rounds + 1):
            seconds, cpu = time_copy(hf, work)
            walls["cp"].append(seconds)
            print(f"round {round_}: cp -r + sync {seconds:.2f} s, {cpu:.2f} CPU s; load average {load()}")
            for processes in (1, 2):
                seconds, cpu, ranks = time_conversion(source, work / f"ckpt-{processes}", processes)
                walls[processes].append(seconds)
                print(f"round {round_}: {processes} process(es) {seconds:.2f} s = {seconds / walls['cp'][-1]:.2f}x "
                      f"this round's cp, {cpu:.2f} CPU s; load average {load()}")
                if round_ == options.rounds:
                    print_ranks(ranks, size, base, 1.1 if processes == 1 else 0.6)
                if options.against:
                    seconds = time_conversion_of(options.against, hf, work / f"against-{processes}", processes)
                    walls[-processes].append(seconds)
                    print(f"round {round_}: {options.against}, {processes} process(es) {seconds:.2f} s = "
                          f"{seconds / walls['cp'][-1]:.2f}x this round's cp; load average {load()}")
        copy = statistics.median(walls["cp"])
        for processes in (1, 2):
            median = statistics.median(walls[processes])
            print(f"median of {options.rounds} rounds, {processes} process(es): {median:.2f} s against cp's "
                  f"{copy:.2f} s = {median / copy:.2f}x cp (goal <= 2x)")
            if options.against:
                median = statistics.median(walls[-processes])
                print(f"  {options.against}: {median:.2f} s = {median / copy:.2f}x cp")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("command: .venv/bin/python benchmarks/convert_bench.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
