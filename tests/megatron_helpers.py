"""megatron-core in tests: what a GPTModel declares for its checkpoint, and its logits against transformers'."""

from __future__ import annotations

from pathlib import Path

import torch


def declared_shapes(model) -> dict[str, tuple[int, ...]]:
    """Every tensor key the model's sharded state dict declares, with its global shape (what .metadata holds)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from slimeflow.train.backends.megatron.backend import sharded_leaves

    declared = model.sharded_state_dict()
    apply_factories(declared)
    return {t.key: tuple(t.global_shape) for t in sharded_leaves(declared) if isinstance(t, ShardedTensor)}


def load_and_compare_logits(model, checkpoint_dir: Path, hf_dir: Path) -> float:
    """Load the torch_dist checkpoint into `model`; the largest |logit difference| against the HF model in fp32,
    on two random sequences of 11 tokens."""
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    from slimeflow.train.backends.megatron.shims import megatron_on_cpu

    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(checkpoint_dir))
    model.load_state_dict(loaded, strict=False)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = hf_model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(11, 11, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad(), megatron_on_cpu():
        megatron_logits = model(ids, torch.arange(11)[None].expand(2, -1), mask)[..., :vocab]
        hf_logits = hf_model(ids).logits
    return (megatron_logits - hf_logits).abs().max().item()

