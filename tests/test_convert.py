"""The convert stage: HF -> torch_dist -> HF is exact; Megatron itself loads the checkpoint; bad inputs are refused.

Six tiny models (one per family and dtype path, odd shapes: GQA, MQA, MHA, tied and untied embeddings, a
head_dim that is not hidden/heads) are converted once per module, three with one process and three with two.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext, StageInputError
from slimeflow.stages.convert.config import ConvertConfig
from slimeflow.stages.convert.stage import run
from slimeflow.stages.convert.torch_dist import load_torch_dist, read_common, tensor_metadata
from slimeflow.stages.model.tiny import TinyModelSpec, build_tiny_model

ALL_CASES = {
    "llama-bf16-gqa-1p": ("tiny:llama?dtype=bfloat16&num_hidden_layers=3&seed=1", 1),
    "qwen2-fp16-tied-1p": ("tiny:qwen2?dtype=float16&tie_word_embeddings=true&seed=2", 1),
    "qwen3-fp32-mqa-headdim-1p": ("tiny:qwen3?head_dim=24&num_key_value_heads=1&seed=3", 1),
    "llama-fp32-tied-mha-2p": ("tiny:llama?tie_word_embeddings=true&num_attention_heads=8&num_key_value_heads=8"
                               "&head_dim=8&seed=4", 2),
    "qwen2-bf16-gqa-2p": ("tiny:qwen2?dtype=bfloat16&num_hidden_layers=3&max_shard_size=100KB&seed=5", 2),
    "qwen3-fp16-tied-2p": ("tiny:qwen3?dtype=float16&tie_word_embeddings=true&hidden_size=96"
                           "&num_attention_heads=6&num_key_value_heads=2&seed=6", 2),
}
import os
CASES = {k: v for k, v in ALL_CASES.items() if os.environ.get("ONLY", k) in k}


def context(tmp: Path) -> StageContext:
    return StageContext(Storage(), tmp / "work", str(tmp / "work"))


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, dict]:
    """Every case converted HF -> torch_dist -> HF through the stage: paths and both manifests."""
    out = {}
    for case, (uri, processes) in CASES.items():
        tmp = tmp_path_factory.mktemp(case)
        hf = build_tiny_model(tmp / "hf", TinyModelSpec.from_uri(uri))
        forward = run(ConvertConfig(hf_checkpoint=str(hf), save=str(tmp / "ckpt"), processes=processes), context(tmp))
        back = run(ConvertConfig(direction="torch-dist-to-hf", input_dir=str(tmp / "ckpt"),
                                 output_dir=str(tmp / "back"), origin_hf_dir=str(hf)), context(tmp))
        out[case] = {"hf": hf, "root": tmp / "ckpt", "back": tmp / "back", "forward": forward, "reverse": back,
                     "tmp": tmp}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_bit_exact_with_dtypes_preserved(converted, case):
    from transformers import AutoModelForCausalLM

    item = converted[case]
    original, back = hf_tensors(item["hf"]), hf_tensors(item["back"])
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype, name
        assert torch.equal(back[name], tensor), name
    index = json.loads((item["back"] / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert (item["back"] / "tokenizer.json").is_file() and (item["back"] / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(item["back"])
    assert model.config.vocab_size == original["model.embed_tokens.weight"].shape[0]
    assert item["forward"].counts["processes"] == CASES[case][1]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_megatron_layout_release_tracker_stacked_tensors_and_args(converted, case):
    item = converted[case]
    release = item["root"] / "release"
    assert (item["root"] / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert json.loads((release / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}
    assert not [p.name for p in item["root"].iterdir() if p.name.startswith(".")], "staging left behind"
    args = read_common(release)["args"]
    config = json.loads((item["hf"] / "config.json").read_text())
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (
        config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"])
    assert (args.num_attention_heads, args.num_query_groups) == (
        config["num_attention_heads"], config["num_key_value_heads"])
    assert args.padded_vocab_size % 128 == 0 and args.padded_vocab_size >= config["vocab_size"]
    assert args.untie_embeddings_and_output_weights == (not config["tie_word_embeddings"])
    assert args.rotary_base == config["rope_parameters"]["rope_theta"]
    metadata = tensor_metadata(release)
    for key, (shape, _) in metadata.items():
        if key.startswith("decoder.layers."):
            assert shape[0] == args.num_layers, key
    tensors, _ = load_torch_dist(release, ["embedding.word_embeddings.weight"])  # padded rows are zero
    padded = tensors["embedding.word_embeddings.weight"]
    assert padded.shape[0] == args.padded_vocab_size
    assert not padded[config["vocab_size"]:].any()


# --------------------------------------------------------------------------------------------------------------
# Megatron itself: GPTModel built from common.pt's args loads the checkpoint and matches HF's logits
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """A one-rank gloo process group with megatron-core's model-parallel state (TP=PP=1), for this module."""
    from megatron.core import parallel_state

    store = tmp_path_factory.mktemp("world") / "rendezvous"
    torch.distributed.init_process_group("gloo", init_method=store.as_uri(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def gpt_model_from_args(args):
    """A megatron-core GPTModel (local layer spec, CPU, fp32) of the shape in a checkpoint's args."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return GPTModel(config, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=int(args.rotary_base),
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_gpt_model_loads_the_checkpoint_and_its_logits_equal_hf(converted, megatron_world, case):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from transformers import AutoModelForCausalLM

    from slimeflow._compat import megatron_on_cpu

    item = converted[case]
    release = item["root"] / "release"
    args = read_common(release)["args"]
    model = gpt_model_from_args(args).eval()
    # .metadata holds exactly what GPTModel declares: same keys, same global shapes.
    declared = model.sharded_state_dict()
    apply_factories(declared)
    wanted = {t.key: tuple(t.global_shape) for t in _leaves(declared) if isinstance(t, ShardedTensor)}
    stored = {key: shape for key, (shape, _) in tensor_metadata(release).items()}
    assert stored == wanted

    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(release))
    model.load_state_dict(loaded, strict=False)
    hf_model = AutoModelForCausalLM.from_pretrained(item["hf"], dtype=torch.float32).eval()
    vocab = hf_model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(11, 11, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad(), megatron_on_cpu():
        megatron_logits = model(ids, torch.arange(11)[None].expand(2, -1), mask)[..., :vocab]
        hf_logits = hf_model(ids).logits
    assert (megatron_logits - hf_logits).abs().max().item() <= 1e-4


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree
