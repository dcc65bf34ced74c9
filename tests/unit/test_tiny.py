"""The tiny-model factory: HF directories that load offline, generate, and have each family's shape."""

from __future__ import annotations

import hashlib
import json
import time
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slimeflow.families import tiny
from slimeflow.families.tiny import (
    FAMILIES,
    SPEC_PARAMS,
    TinyModelSpec,
    build_tiny_model,
    build_tiny_tokenizer,
    is_tiny_uri,
)

FAMILY_NAMES = ["llama", "qwen2", "qwen3"]
# What each family must look like, written out independently of the FAMILIES table.
EXPECTED = {
    "llama": {"vocab": 261, "bias": False, "qk_norm": False, "bos": "<|begin_of_text|>", "eos": "<|eot_id|>"},
    "qwen2": {"vocab": 259, "bias": True, "qk_norm": False, "bos": None, "eos": "<|im_end|>"},
    "qwen3": {"vocab": 259, "bias": False, "qk_norm": True, "bos": None, "eos": "<|im_end|>"},
}
UNICODE_TEXT = "Hello, 世界! 数学题：3+4=7 🎉👩‍👩‍👧 naïve café\n\ttabs  and  spaces ∑∫ Ωmega"
MESSAGES = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2+3?"},
]


def _load(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def _sha256s(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """One default-spec model per family, built once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: build_tiny_model(root / family, TinyModelSpec(family=family)) for family in FAMILY_NAMES}


# ----------------------------------------------------------------------------------------------------------------
# Building, loading, generating
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_builds_a_directory_that_loads_offline(built, family):
    path = built[family]
    names = {f.name for f in path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not list(path.parent.glob(".*tmp*")), "the staging directory was left behind"

    model, tokenizer = _load(path)
    assert model.config.model_type == family
    assert len(tokenizer) == model.config.vocab_size == EXPECTED[family]["vocab"]
    assert model.config.vocab_size % 128 != 0
    assert model.get_input_embeddings().weight.shape == (EXPECTED[family]["vocab"], 64)
    assert tokenizer.padding_side == "left"
    assert tokenizer.model_max_length == 512


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_generation_on_a_chat_prompt_is_deterministic(built, family):
    model, tokenizer = _load(built[family])
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    prompt_len = inputs["input_ids"].shape[1]

    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    first = model.generate(**inputs, **kwargs)
    second = model.generate(**inputs, **kwargs)

    assert first.shape == (1, prompt_len + 6)
    assert torch.equal(first[:, :prompt_len], inputs["input_ids"])
    assert torch.equal(first, second)
    assert ((first >= 0) & (first < len(tokenizer))).all()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_batched_generation_pads_on_the_left(built, family):
    model, tokenizer = _load(built[family])
    prompts = ["1+2=", "10+20+30="]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)

    assert out.shape == (2, inputs["input_ids"].shape[1] + 4)
    assert inputs["attention_mask"][0, 0] == 0 and inputs["attention_mask"][0, -1] == 1
    assert inputs["input_ids"][0, 0] == tokenizer.pad_token_id


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_structure_in_state_dict_and_config(built, family):
    expected = EXPECTED[family]
    tensors = _safetensors(built[family])
    config = AutoConfig.from_pretrained(built[family], local_files_only=True)

    biases = [name for name in tensors if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    qk_norms = [name for name in tensors if "q_norm" in name or "k_norm" in name]
    assert len(biases) == (3 * 2 if expected["bias"] else 0)
    assert len(qk_norms) == (2 * 2 if expected["qk_norm"] else 0)
    flags = FAMILIES[family].flags(config.to_dict())
    assert (flags["add_qkv_bias"], flags["qk_layernorm"]) == (expected["bias"], expected["qk_norm"])
    # GQA: 4 query heads, 2 key/value heads of 16 dims each.
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert "lm_head.weight" in tensors  # untied by default

    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    tokenizer = AutoTokenizer.from_pretrained(built[family], local_files_only=True)
    assert tokenizer.bos_token == expected["bos"]
    assert tokenizer.eos_token == expected["eos"]
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id
    assert config.bos_token_id == tokenizer.bos_token_id


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generation_config_stops_on_every_end_token(built, family):
    generation = json.loads((built[family] / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(built[family], local_files_only=True)
    stop_tokens = tokenizer.convert_ids_to_tokens(generation["eos_token_id"])
    assert stop_tokens[0] == tokenizer.eos_token
    expected = {"<|eot_id|>", "<|end_of_text|>"} if family == "llama" else {"<|im_end|>", "<|endoftext|>"}
    assert set(stop_tokens) == expected
    assert generation["pad_token_id"] == tokenizer.pad_token_id


def test_every_saved_tensor_is_non_constant(built):
    """Norm weights and biases are perturbed, so a converter that swaps or drops one changes the logits."""
    for family in FAMILY_NAMES:
        for name, tensor in _safetensors(built[family]).items():
            assert tensor.unique().numel() > 1, f"{family}: {name} is constant"


def test_spec_options_reach_the_config(tmp_path):
    spec = TinyModelSpec(
        family="qwen3", hidden_size=48, num_attention_heads=6, num_key_value_heads=1, head_dim=32,
        num_hidden_layers=3, intermediate_size=80, rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=256,
    )  # fmt: skip
    path = build_tiny_model(tmp_path / "m", spec)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    tensors = _safetensors(path)

    assert config.rope_parameters["rope_theta"] == 1e6
    assert not hasattr(config, "rope_theta")
    assert (config.head_dim, config.num_key_value_heads, config.num_hidden_layers) == (32, 1, 3)
    assert config.rms_norm_eps == 1e-5 and config.max_position_embeddings == 256
    assert tensors["model.layers.2.self_attn.q_proj.weight"].shape == (6 * 32, 48)
    assert tensors["model.layers.2.self_attn.k_proj.weight"].shape == (32, 48)
    assert tensors["model.layers.2.self_attn.q_norm.weight"].shape == (32,)
    assert tensors["model.layers.0.mlp.up_proj.weight"].shape == (80, 48)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tied_embeddings_store_no_lm_head(tmp_path, family):
    path = build_tiny_model(tmp_path / "m", TinyModelSpec(family=family, tie_word_embeddings=True))
    assert "lm_head.weight" not in _safetensors(path)
    model, _ = _load(path)
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_saved_tensors_have_the_spec_dtype(tmp_path, dtype, torch_dtype):
    path = build_tiny_model(tmp_path / "m", TinyModelSpec(family="qwen2", dtype=dtype))
    tensors = _safetensors(path)
    assert {t.dtype for t in tensors.values()} == {torch_dtype}
    assert json.loads((path / "config.json").read_text())["dtype"] == dtype

    # Same seed: the half-precision weights are the float32 weights rounded.
    reference = _safetensors(build_tiny_model(tmp_path / "fp32", TinyModelSpec(family="qwen2")))
    name = "model.layers.1.self_attn.v_proj.bias"
    assert torch.equal(tensors[name], reference[name].to(torch_dtype))


def test_sharded_output_writes_an_index_and_loads_the_same_weights(tmp_path, built):
    path = build_tiny_model(tmp_path / "m", TinyModelSpec(family="llama", max_shard_size="100KB"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model-*-of-*.safetensors"))

    assert len(shards) > 1
    assert not (path / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    unsharded = _safetensors(built["llama"])
    sharded = _safetensors(path)
    assert set(index["weight_map"]) == set(sharded) == set(unsharded)
    assert all(torch.equal(sharded[name], unsharded[name]) for name in unsharded)
    model, _ = _load(path)
    assert torch.equal(model.lm_head.weight, unsharded["lm_head.weight"])


def test_same_spec_gives_byte_identical_files_and_another_seed_does_not(tmp_path, built):
    again = build_tiny_model(tmp_path / "again", TinyModelSpec(family="qwen3"))
    other_seed = build_tiny_model(tmp_path / "seed1", TinyModelSpec(family="qwen3", seed=1))

    assert _sha256s(again) == _sha256s(built["qwen3"])
    assert (again / "config.json").read_bytes() == (built["qwen3"] / "config.json").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (built["qwen3"] / "tokenizer.json").read_bytes()
    assert _sha256s(other_seed) != _sha256s(built["qwen3"])


def test_building_leaves_the_global_torch_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", TinyModelSpec(seed=7))
    assert torch.equal(torch.rand(3), expected)


def test_default_build_is_fast(tmp_path, built):
    start = time.perf_counter()
    build_tiny_model(tmp_path / "m")
    # The brief asks for < 2 s; the bound leaves room for a loaded test machine.
    assert time.perf_counter() - start < 5.0


# ----------------------------------------------------------------------------------------------------------------
# Target directory handling
# ----------------------------------------------------------------------------------------------------------------


def test_refuses_a_non_empty_target_unless_overwrite(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("precious")

    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_tiny_model(target)
    assert (target / "keep.txt").read_text() == "precious"

    build_tiny_model(target, overwrite=True)
    assert not (target / "keep.txt").exists()
    assert (target / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_accepts_an_existing_empty_directory(tmp_path):
    (tmp_path / "m").mkdir()
    assert (build_tiny_model(tmp_path / "m") / "config.json").exists()


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def write_half_then_crash(directory: Path, spec: TinyModelSpec) -> None:
        (directory / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "_write_model_dir", write_half_then_crash)
    with pytest.raises(RuntimeError, match="disk full"):
        build_tiny_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------------------------
# Spec and URI
# ----------------------------------------------------------------------------------------------------------------


def test_uri_parses_into_a_spec():
    spec = TinyModelSpec.from_uri("tiny:qwen3?seed=3&hidden_size=96&tie_word_embeddings=true")
    assert spec == TinyModelSpec(family="qwen3", seed=3, hidden_size=96, tie_word_embeddings=True)
    assert TinyModelSpec.from_uri("tiny:llama") == TinyModelSpec()
    assert is_tiny_uri("tiny:llama") and not is_tiny_uri("/models/Qwen3-0.6B")


@pytest.mark.parametrize(
    "spec",
    [
        TinyModelSpec(),
        TinyModelSpec(family="qwen3", seed=3, hidden_size=96, tie_word_embeddings=True),
        TinyModelSpec(
            family="qwen2", dtype="bfloat16", rope_theta=1e6, rms_norm_eps=1e-5, max_shard_size="100KB"
        ),
        TinyModelSpec(family="qwen3", head_dim=32, num_key_value_heads=1, intermediate_size=96, seed=2**40),
    ],
)
def test_uri_round_trip(spec):
    assert TinyModelSpec.from_uri(spec.to_uri()) == spec


def test_to_uri_writes_only_non_defaults():
    assert TinyModelSpec().to_uri() == "tiny:llama"
    spec = TinyModelSpec(family="qwen3", seed=3, hidden_size=96, tie_word_embeddings=True)
    assert spec.to_uri() == "tiny:qwen3?seed=3&hidden_size=96&tie_word_embeddings=true"


def test_every_spec_field_but_family_is_a_uri_key():
    assert set(SPEC_PARAMS) == {f for f in TinyModelSpec.__dataclass_fields__ if f != "family"}


@pytest.mark.parametrize(
    ("uri", "fragments"),
    [
        ("tiny:llama?hiddensize=8", ["unknown key 'hiddensize'", "hidden_size"]),
        ("tiny:llama?hidden_size=big", ["'big'", "'hidden_size'", "a positive integer"]),
        ("tiny:llama?tie_word_embeddings=yes", ["'yes'", "'tie_word_embeddings'", "true or false"]),
        ("tiny:llama?seed", ["'seed' has no value"]),
        ("tiny:llama?seed=1&seed=2", ["'seed' is given more than once"]),
        ("tiny:mistral", ["unknown family 'mistral'", "llama, qwen2, qwen3"]),
        ("tiny:", ["unknown family ''", "llama, qwen2, qwen3"]),
        ("tiny:llama?dtype=float8", ["dtype", "'float8'", "float32, bfloat16, float16"]),
        ("tiny:llama?num_key_value_heads=3", ["num_attention_heads (4)", "num_key_value_heads (3)"]),
        ("tiny:llama?hidden_size=0", ["hidden_size must be a positive integer, got 0"]),
        ("tiny:llama?rope_theta=-1", ["rope_theta", "positive", "-1.0"]),
        ("tiny:llama?max_shard_size=lots", ["max_shard_size", "'lots'", "100KB"]),
        ("tiny:qwen2?head_dim=32", ["qwen2 has no head_dim", "llama, qwen3"]),
        ("tiny:llama?head_dim=15", ["head_dim must be even"]),
        ("hf:llama", ["must start with 'tiny:'"]),
    ],
)
def test_bad_specs_name_the_problem(uri, fragments):
    with pytest.raises(ValueError) as info:
        TinyModelSpec.from_uri(uri)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="hidden_size .* divisible by num_attention_heads"):
        TinyModelSpec(hidden_size=66, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive integer, got '2'"):
        TinyModelSpec(num_hidden_layers="2")
    with pytest.raises(ValueError, match="seed"):
        TinyModelSpec(seed=-1)
    # An explicit head_dim lifts the divisibility requirement where the family has one.
    assert (
        TinyModelSpec(family="qwen3", hidden_size=66, num_attention_heads=4, head_dim=16).resolved_head_dim
        == 16
    )


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and chat template
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tokenizer_round_trips_unicode_as_utf8_bytes(built, family):
    for tokenizer in (build_tiny_tokenizer(family), AutoTokenizer.from_pretrained(built[family])):
        ids = tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
        assert ids == list(UNICODE_TEXT.encode("utf-8"))
        assert tokenizer.decode(ids) == UNICODE_TEXT

        with_specials = tokenizer.encode(
            f"{tokenizer.eos_token}你好 🎉{tokenizer.pad_token}", add_special_tokens=False
        )
        assert with_specials[0] == tokenizer.eos_token_id and with_specials[-1] == tokenizer.pad_token_id
        assert tokenizer.encode(tokenizer.decode(with_specials), add_special_tokens=False) == with_specials
        assert tokenizer.decode(with_specials, skip_special_tokens=True) == "你好 🎉"


def test_qwen_tokenizers_nfc_normalize_and_llama_keeps_text_as_is(built):
    decomposed = "cafe\u0301"
    for family in FAMILY_NAMES:
        for tokenizer in (build_tiny_tokenizer(family), AutoTokenizer.from_pretrained(built[family])):
            text = tokenizer.decode(tokenizer.encode(decomposed, add_special_tokens=False))
            expected = decomposed if family == "llama" else unicodedata.normalize("NFC", decomposed)
            assert text == expected, (family, type(tokenizer).__name__)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_special_tokens_and_bos(built, family):
    tokenizer = AutoTokenizer.from_pretrained(built[family])
    specials = tokenizer.convert_ids_to_tokens(list(range(256, len(tokenizer))))
    assert specials == list(FAMILIES[family].tokenizer.special_tokens)
    assert sorted(tokenizer.all_special_ids) == list(range(256, len(tokenizer)))
    ids = tokenizer.encode("hi")
    if EXPECTED[family]["bos"] is None:
        assert ids == [ord("h"), ord("i")]
    else:
        assert ids == [tokenizer.bos_token_id, ord("h"), ord("i")]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_chatml_template(built, family):
    tokenizer = AutoTokenizer.from_pretrained(built[family])
    with_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert with_prompt == (
        "<|im_start|>system\nYou add numbers.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert with_prompt == without + "<|im_start|>assistant\n"

    tool = {"type": "function", "function": {"name": "add", "description": "Add two integers."}}
    with_tools = tokenizer.apply_chat_template(
        MESSAGES, tools=[tool], add_generation_prompt=True, tokenize=False
    )
    system_turn = with_tools.split("<|im_end|>")[0]
    assert system_turn.startswith("<|im_start|>system\nYou add numbers.\n\n# Tools")
    assert '"name": "add"' in system_turn and "<tools>" in system_turn
    assert with_tools.count("<|im_start|>system") == 1
    assert with_tools.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_llama3_template(built):
    tokenizer = AutoTokenizer.from_pretrained(built["llama"])
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou add numbers.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert not tokenizer.apply_chat_template(MESSAGES, tokenize=False).endswith("<|end_header_id|>\n\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id

    tool = {"type": "function", "function": {"name": "add"}}
    with_tools = tokenizer.apply_chat_template(
        MESSAGES, tools=[tool], add_generation_prompt=True, tokenize=False
    )
    system_turn = with_tools.split("<|eot_id|>")[0]
    assert system_turn.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou add numbers."
    )
    assert '"name": "add"' in system_turn
    assert with_tools.count("<|start_header_id|>system") == 1
