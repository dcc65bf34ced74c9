"""GPU smoke: the torch and Megatron training backends on one CUDA device, step time and memory.

For two models from the tiny factory, the demo's (examples/demo.yaml: a 2-layer Llama, hidden 128) and a Qwen3
(hidden 1024, 8 layers, head_dim 128, unequal head counts), both backends start from the same converted weights in
this process (the Megatron backend in a one-rank NCCL world, megatron-core's local layer spec or Transformer
Engine's where it is installed) and train the same GRPO batch for --steps steps, alternating. Printed per model
and backend: median and spread of seconds per step (CUDA-synchronised wall time), peak GPU memory allocated during
a step, and the largest weight difference between the backends after the steps (fp32, same batch: it should be
of the order of lr x 1e-2 or less). TP 2 is not run here: NCCL refuses two ranks on one device, and
tests/integration/test_megatron_backend.py checks TP 2 over gloo on CPU. `--device cpu` runs the same code without CUDA
(no memory figures): a check of the script itself. `--qwen3-4b` adds what examples/grpo-qwen3.yaml's trainer
needs: a randomly initialised model of Qwen3-4B's shape (built here, nothing downloaded), the torch backend as
that example runs it (fp32 weights and AdamW, the KL loss's reference model, --bf16 autocast), peak GPU memory of
one step on its batch shape (--samples-4b samples of 512 + --response-4b tokens, micro-batches of 1).

    python benchmarks/gpu_smoke.py [--steps 5]      (benchmarks/gpu_smoke.sh runs it with the gpu tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from megatron_step import make_batch  # benchmarks/ is on the path when a script here runs

from slimeflow.config.train import TrainConfig
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.rollout.types import TrainBatch

LR = 1e-5
MODELS = {
    "demo": TinyModelSpec(seed=0, hidden_size=128, intermediate_size=256),
    "qwen3": TinyModelSpec(family="qwen3", seed=1, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                           num_key_value_heads=4, head_dim=128, intermediate_size=3072, max_position_embeddings=2048),
}


def timed_step(backend, batch: TrainBatch, config: TrainConfig) -> tuple[float, int]:
    """(seconds, peak bytes allocated; 0 off CUDA) of one training step."""
    from slimeflow.train.train_step import train_on_rollout

    cuda = backend.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    train_on_rollout(backend, batch, config, rank=backend.dp_rank, world_size=backend.dp_size)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started, torch.cuda.max_memory_allocated() if cuda else 0


def smoke(name: str, spec: TinyModelSpec, steps: int, tmp: Path, batch: TrainBatch, device: str) -> None:
    from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, read_hf_source
    from slimeflow.train.backends.megatron.backend import MegatronBackend
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint
    from slimeflow.train.backends.torch.backend import TorchBackend

    hf = build_tiny_model(tmp / name / "hf", spec)
    staged, _ = convert_hf_to_torch_dist(read_hf_source(hf), tmp / name / "ckpt")
    release = staged.rename(tmp / name / "ckpt" / "release")
    config = TrainConfig(batch={"rollout_batch_size": len(batch.tokens) // 2, "n_samples_per_prompt": 2,
                                "num_rollout": 1, "micro_batch_size": 4}, optimizer={"lr": LR})
    backends = {
        "torch": TorchBackend(hf, config.optimizer, config.algorithm, config.batch, seed=3, device=device),
        "megatron": MegatronBackend(hf, release, config.optimizer, config.algorithm, config.batch, config.megatron,
                                    seed=3, init_method=(tmp / name / "rendezvous").as_uri()),
    }
    try:
        load_checkpoint(backends["megatron"], release, weights_only=True)
        params = sum(p.numel() for p in backends["torch"].model.parameters())
        print(f"{name}: {params / 1e6:.1f}M parameters, batch of {len(batch.tokens)} samples, "
              f"{sum(len(t) for t in batch.tokens)} tokens, micro-batches of 4, {steps} steps")
        results: dict[str, list[tuple[float, int]]] = {key: [] for key in backends}
        for step in range(steps + 1):  # the first step of each warms up (kernels, allocator): not counted
            for key, backend in backends.items():
                result = timed_step(backend, batch, config)
                if step:
                    results[key].append(result)
        for key, values in results.items():
            seconds = [s for s, _ in values]
            print(f"  {key:9s} median {statistics.median(seconds) * 1e3:8.1f} ms/step (spread "
                  f"{min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f}), peak {max(m for _, m in values) / 2**30:.2f} GiB")
        trained = backends["torch"].named_weights()
        got = backends["megatron"].named_weights()
        diff = max((got[k].float().cpu() - trained[k].float().cpu()).abs().max().item() for k in trained)
        print(f"  megatron vs torch after {steps + 1} steps: max |weight difference| {diff:.3g} (lr {LR})")
    finally:
        backends["megatron"].close()


QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
            "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16"}
"""Qwen3-4B's config.json (the published model's shape)."""


def qwen3_4b_memory(tmp: Path, samples: int, response: int, steps: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from slimeflow.train.backends.torch.backend import TorchBackend

    started = time.perf_counter()
    config = AutoConfig.for_model(**{k: v for k, v in QWEN3_4B.items() if k != "architectures"})
    config.architectures = QWEN3_4B["architectures"]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp / "qwen3-4b")
    del model
    torch.cuda.empty_cache()
    built = time.perf_counter() - started
    train = TrainConfig(batch={"rollout_batch_size": samples // 2, "n_samples_per_prompt": 2, "num_rollout": 1,
                               "micro_batch_size": 1},
                        optimizer={"lr": 1e-6, "weight_decay": 0.1, "adam_beta2": 0.98, "bf16": True},
                        algorithm={"use_kl_loss": True, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl"})
    backend = TorchBackend(tmp / "qwen3-4b", train.optimizer, train.algorithm, train.batch, seed=3, device="cuda")
    loaded = torch.cuda.memory_allocated()
    batch = make_batch(samples, 512, response)
    params = sum(p.numel() for p in backend.model.parameters())
    print(f"qwen3-4b shape: {params / 1e9:.2f}B parameters (built and saved in {built:.0f} s), torch backend, fp32 "
          f"weights + AdamW + reference model, bf16 autocast; after loading {loaded / 2**30:.1f} GiB")
    for step in range(steps):
        seconds, peak = timed_step(backend, batch, train)
        print(f"  step {step}: {seconds:.1f} s, peak {peak / 2**30:.1f} GiB allocated "
              f"({torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved), {samples} samples of 512 + up to "
              f"{response} tokens, micro-batches of 1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=384)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--qwen3-4b", action="store_true", help="also measure a Qwen3-4B-shaped trainer's memory")
    parser.add_argument("--samples-4b", type=int, default=8)
    parser.add_argument("--response-4b", type=int, default=1536)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the GPU smoke needs one (`--device cpu` checks the script; the CPU benchmark is "
              "benchmarks/megatron_step.py)")
        return 2
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}")
    try:
        import transformer_engine  # noqa: F401

        print("Transformer Engine: installed (the Megatron backend uses its layer specs)")
    except ImportError:
        print("Transformer Engine: not installed (the Megatron backend uses megatron-core's local layer spec)")
    tmp = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    batch = make_batch(args.samples, args.prompt, args.response)
    parts = [(name, lambda name=name: smoke(name, MODELS[name], args.steps, tmp, batch, args.device))
             for name in args.models]
    if args.qwen3_4b and args.device == "cuda":
        parts.append(("qwen3-4b", lambda: qwen3_4b_memory(tmp, args.samples_4b, args.response_4b, 2)))
    failed = []
    for name, part in parts:  # each part runs whatever an earlier one did
        try:
            part()
        except Exception:
            traceback.print_exc()
            print(f"{name}: FAILED (traceback above)")
            failed.append(name)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("TP 2: skipped, one GPU (NCCL refuses two ranks on one device); tests/integration/test_megatron_backend.py runs "
              "TP 2 over gloo on CPU")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
