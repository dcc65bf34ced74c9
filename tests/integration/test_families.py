"""The family specs (slimeflow.families) and GLM4, the seeds' running example, through factory, converter and engine.

GLM4 differs from Llama in every place a converter can go wrong: an HF-fused gate_up_proj, a QKV bias, sandwich
norms (`post_self_attn_layernorm`, `post_mlp_layernorm`, named as slime's patched Megatron names them), and
interleaved RoPE on half of each head. Two tiny models are converted HF -> torch_dist -> HF once per module; the
checkpoint is loaded by megatron-core's GPTModel built from its args, whose logits must equal transformers'.
Qwen3-MoE (router, experts stacked as Megatron stores them) goes through the same checks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from megatron_helpers import declared_shapes, load_and_compare_logits
from safetensors.torch import load_file

from slimeflow.checkpoint.mapping import ModelShape, expected_hf_tensors
from slimeflow.checkpoint.torch_dist import load_torch_dist, read_common, tensor_metadata
from slimeflow.config.convert import ConvertConfig
from slimeflow.families import FAMILIES, family_for
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.stages.convert.stage import run

GLM4_CASES = {
    # unequal head counts, head_dim not hidden/heads (rotary on 12 of 24 dims), odd vocabulary (263)
    "glm4-fp32-mqa-headdim-1p": ("tiny:glm4?head_dim=24&num_key_value_heads=1&seed=3", 1),
    "glm4-bf16-gqa-2p": ("tiny:glm4?dtype=bfloat16&num_hidden_layers=3&num_attention_heads=8&hidden_size=96"
                         "&max_shard_size=100KB&seed=5", 2),
}
MOE_CASES = {
    # 5 experts (an odd count, more than top-2), expert FFN (24) unlike the dense one, two ranks
    "qwen3_moe-bf16-2p": ("tiny:qwen3_moe?dtype=bfloat16&num_hidden_layers=3&num_experts=5&moe_intermediate_size=24"
                          "&seed=4", 2),
}
DEEPSEEK_CASES = {
    # MLA with a query LoRA, a dense first layer, 4 experts in 2 groups, a shared expert, expert bias
    "deepseek_v3-fp32-1p": ("tiny:deepseek_v3?seed=6", 1),
    # Moonlight-style (no query LoRA), YaRN x4, bf16 weights (the expert bias stays fp32), two ranks
    "deepseek_v3-bf16-nolora-yarn-2p": ("tiny:deepseek_v3?q_lora_rank=0&yarn_factor=4&num_hidden_layers=3"
                                        "&first_k_dense_replace=1&dtype=bfloat16&seed=8", 2),
}
GLM4_MOE_CASES = {
    # GQA 8:2 with head_dim 16 (half rotated), QKV bias, a dense first layer, grouped sigmoid router, shared expert
    "glm4_moe-bf16-gqa-2p": ("tiny:glm4_moe?num_hidden_layers=3&num_attention_heads=8&num_key_value_heads=2"
                             "&head_dim=16&dtype=bfloat16&seed=5", 2),
}
CASES = {**GLM4_CASES, **MOE_CASES, **DEEPSEEK_CASES, **GLM4_MOE_CASES}


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {name: t for file in sorted(directory.glob("*.safetensors")) for name, t in load_file(file).items()}


# ----------------------------------------------------------------------------------------------------------------
# Every family: the factory's model is exactly what the converter's name map expects; the engine's choice
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_tiny_model_has_exactly_the_tensors_its_spec_maps(tmp_path, family):
    spec = FAMILIES[family]
    hf = build_tiny_model(tmp_path / "hf", TinyModelSpec(family=family, seed=1))
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == spec.model_type and family_for(config["architectures"]) is spec
    shape = ModelShape.from_hf_config(config, spec)
    tensors = hf_tensors(hf)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected_hf_tensors(shape)
    assert any(name.endswith("q_proj.bias") for name in tensors) == shape.add_qkv_bias
    assert any(name.endswith("q_norm.weight") for name in tensors) == (shape.qk_layernorm
                                                                       and not spec.multi_latent_attention)
    assert any(name.endswith("post_mlp_layernorm.weight") for name in tensors) == spec.sandwich_norms


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engine_runs_its_native_forward_exactly_for_the_families_whose_spec_says_so(tmp_path, family, caplog):
    from transformers import AutoModelForCausalLM

    from slimeflow.engine.native import NativeForward, select_forward

    hf = build_tiny_model(tmp_path / "hf", TinyModelSpec(family=family, num_hidden_layers=1))
    forward = select_forward(AutoModelForCausalLM.from_pretrained(hf))
    assert isinstance(forward, NativeForward) == FAMILIES[family].native_forward
    if not FAMILIES[family].native_forward:
        assert f"model_type {family!r} is not one of ['llama', 'qwen2', 'qwen3']" in caplog.text


# ----------------------------------------------------------------------------------------------------------------
# GLM4: the tiny model
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("glm4") / "hf", TinyModelSpec(family="glm4", seed=7))


def test_tiny_glm4_is_glm4_shaped_and_generates_from_its_chat_template(glm4_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(glm4_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(glm4_dir, local_files_only=True)
    assert type(model).__name__ == "Glm4ForCausalLM"
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.5 and model.config.attention_bias
    assert len(tokenizer) == model.config.vocab_size == 263  # 256 bytes + 7 GLM special tokens
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "2+3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "[gMASK]<sop><|system|>\nYou add.<|user|>\n2+3?<|assistant|>\n"
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    assert inputs["input_ids"][0, :2].tolist() == tokenizer.convert_tokens_to_ids(["[gMASK]", "<sop>"])
    out = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 5)
    stops = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    assert model.generation_config.eos_token_id == stops
    text = "naïve 世界 🎉"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


@pytest.fixture(scope="module")
def new_family_dirs(glm4_dir, tmp_path_factory) -> dict[str, Path]:
    """The families without a native engine forward, each as a default tiny model."""
    moe = build_tiny_model(tmp_path_factory.mktemp("moe") / "hf", TinyModelSpec(family="qwen3_moe", seed=7))
    mla = build_tiny_model(tmp_path_factory.mktemp("mla") / "hf", TinyModelSpec(family="deepseek_v3", seed=7))
    glm_moe = build_tiny_model(tmp_path_factory.mktemp("glm_moe") / "hf", TinyModelSpec(family="glm4_moe", seed=7))
    return {"glm4": glm4_dir, "qwen3_moe": moe, "deepseek_v3": mla, "glm4_moe": glm_moe}


@pytest.mark.parametrize("family", ["glm4", "qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_the_engine_serves_the_family_through_transformers_forward(new_family_dirs, family):
    from slimeflow.engine.batcher import Batcher, GenerateRequest
    from slimeflow.engine.sampling import SamplingParams
    from slimeflow.engine.weights import load_model

    loaded = load_model(str(new_family_dirs[family]), device="cpu")
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, sampling_seed=5)
    prompts = [[72, 101, 108, 108, 111], [50, 43, 50, 61]]
    batcher = Batcher(loaded, max_batch_size=4)
    batcher.start()
    try:
        futures = [batcher.submit(GenerateRequest(rid=str(i), input_ids=p, params=params))
                   for i, p in enumerate(prompts)]
        results = [f.result(timeout=60) for f in futures]
    finally:
        batcher.stop()
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.output_ids) == 8
        with torch.inference_mode():
            logp = loaded.model(torch.tensor([prompt + result.output_ids])).logits[0].log_softmax(-1)
        rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + 8)
        expected = logp[rows, torch.tensor(result.output_ids)]
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-4, rtol=0)


def _trained_backend(hf_dir: Path):
    """A torch backend on `hf_dir` after one optimizer step (lr 1e-2) on a rollout of 2 groups of 2; and the
    parameters it started from."""
    from slimeflow.config.train import TrainConfig
    from slimeflow.rollout.types import TrainBatch
    from slimeflow.train.backends.torch.backend import TorchBackend
    from slimeflow.train.train_step import train_on_rollout

    config = TrainConfig(batch={"rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 1},
                         optimizer={"lr": 1e-2})
    backend = TorchBackend(hf_dir, config.optimizer, config.algorithm, config.batch, seed=3, device="cpu")
    g = torch.Generator().manual_seed(0)
    lengths = [(7, 3), (9, 4), (5, 2), (8, 4)]
    batch = TrainBatch(tokens=[torch.randint(3, 250, (n,), generator=g) for n, _ in lengths],
                       response_lengths=[r for _, r in lengths], loss_masks=[torch.ones(r) for _, r in lengths],
                       rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
                       rollout_log_probs=[-torch.rand(r, generator=g) for _, r in lengths])
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    train_on_rollout(backend, batch, config)
    return backend, before


@pytest.mark.parametrize(("family", "trained"), [("glm4", ("post_self_attn_layernorm", "gate_up_proj")),
                                                 ("qwen3_moe", ("mlp.gate.weight", "mlp.experts")),
                                                 ("deepseek_v3", ("kv_b_proj", "q_a_layernorm", "shared_experts",
                                                                  "mlp.experts")),
                                                 ("glm4_moe", ("q_proj.bias", "shared_experts", "mlp.experts"))])
def test_the_torch_backend_trains_the_family(new_family_dirs, family, trained):
    backend, before = _trained_backend(new_family_dirs[family])
    changed = {n for n, p in backend.model.named_parameters() if not torch.equal(p, before[n])}
    assert all(any(part in n for n in changed) for part in trained), sorted(changed)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["glm4", "deepseek_v3"])
def test_the_torch_backend_checkpoints_the_family_exactly(new_family_dirs, tmp_path, family):
    """Saved as torch_dist through the family's name map and read back bit for bit: GLM4's fused gate_up_proj;
    DeepSeek-V3's experts, which transformers holds fused in memory (mlp.experts.gate_up_proj [E, 2F, H]) and
    checkpoints name one by one, and its expert-score correction bias, a buffer."""
    from slimeflow.families.checkpoint_names import CheckpointLayout
    from slimeflow.train.backends.torch.checkpoint import read_weights, save_checkpoint

    backend, _ = _trained_backend(new_family_dirs[family])
    ref = save_checkpoint(backend, tmp_path / "save", 1, {"rollout_id": 1})
    saved = CheckpointLayout(backend.model).to_model(read_weights(ref.uri, new_family_dirs[family]))
    state = backend.model.state_dict()
    assert sorted(saved) == sorted(state)
    assert all(torch.equal(saved[name], tensor) for name, tensor in state.items())
    if family == "deepseek_v3":
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in saved
        assert saved["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 64)


# ----------------------------------------------------------------------------------------------------------------
# GLM4: HF -> torch_dist -> HF, names as slime's, megatron-core's logits
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, dict]:
    out = {}
    for case, (uri, processes) in CASES.items():
        tmp = tmp_path_factory.mktemp(case)
        ctx = StageContext(Storage(), tmp / "work", str(tmp / "work"))
        hf = build_tiny_model(tmp / "hf", TinyModelSpec.from_uri(uri))
        run(ConvertConfig(hf_checkpoint=str(hf), save=str(tmp / "ckpt"), processes=processes), ctx)
        run(ConvertConfig(direction="torch-dist-to-hf", input_dir=str(tmp / "ckpt"), output_dir=str(tmp / "back"),
                          origin_hf_dir=str(hf)), ctx)
        out[case] = {"hf": hf, "release": tmp / "ckpt" / "release", "back": tmp / "back"}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_bit_exact(converted, case):
    item = converted[case]
    original, back = hf_tensors(item["hf"]), hf_tensors(item["back"])
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@pytest.mark.slow
def test_glm4_checkpoint_uses_slimes_names_and_args(converted):
    item = converted["glm4-bf16-gqa-2p"]
    args = read_common(item["release"])["args"]
    assert (args.post_self_attn_layernorm, args.post_mlp_layernorm, args.rotary_interleaved) == (True, True, True)
    assert args.rotary_percent == 0.5 and args.add_qkv_bias and not args.qk_layernorm
    keys = set(tensor_metadata(item["release"]))
    assert {"decoder.layers.post_self_attn_layernorm.weight", "decoder.layers.post_mlp_layernorm.weight",
            "decoder.layers.self_attention.linear_qkv.bias"} <= keys
    stacked, _ = load_torch_dist(item["release"], ["decoder.layers.mlp.linear_fc1.weight",
                                                   "decoder.layers.post_mlp_layernorm.weight"])
    hf = hf_tensors(item["hf"])
    for layer in range(3):  # fc1 is HF's gate_up_proj as it is: [gate; up] on dim 0
        assert torch.equal(stacked["decoder.layers.mlp.linear_fc1.weight"][layer],
                           hf[f"model.layers.{layer}.mlp.gate_up_proj.weight"])
        assert torch.equal(stacked["decoder.layers.post_mlp_layernorm.weight"][layer],
                           hf[f"model.layers.{layer}.post_mlp_layernorm.weight"])


@pytest.mark.slow
def test_qwen3_moe_checkpoint_stores_experts_stacked_as_megatron_does(converted):
    item = converted["qwen3_moe-bf16-2p"]
    args = read_common(item["release"])["args"]
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (5, 2, 24)
    assert args.moe_router_pre_softmax is False  # norm_topk_prob: softmax over the top-k's logits
    metadata = tensor_metadata(item["release"])
    assert metadata["decoder.layers.mlp.experts.experts.linear_fc1.weight"][0] == (3, 5, 48, 64)
    assert metadata["decoder.layers.mlp.experts.experts.linear_fc2.weight"][0] == (3, 5, 64, 24)
    assert metadata["decoder.layers.mlp.router.weight"][0] == (3, 5, 64)
    assert "decoder.layers.pre_mlp_layernorm.weight" in metadata  # TE's MoE layer: a norm of its own
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" not in metadata
    stacked, _ = load_torch_dist(item["release"], ["decoder.layers.mlp.experts.experts.linear_fc1.weight"])
    hf = hf_tensors(item["hf"])
    fc1 = stacked["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    for layer, expert in ((0, 0), (2, 4), (1, 3)):
        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        assert torch.equal(fc1[layer, expert], torch.cat([hf[prefix + "gate_proj.weight"],
                                                          hf[prefix + "up_proj.weight"]]))


@pytest.mark.slow
def test_qwen3_moe_with_a_dense_layer_converts_exactly_with_each_layer_keyed_on_its_own(tmp_path, megatron_world):
    """mlp_only_layers: layer 1 keeps a dense MLP. megatron-core keys the layers of such a model one by one
    (`decoder.layers.<i>.<name>`, moe_layer_freq a list), and so does the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slimeflow.families.megatron import gpt_model_from_args

    base = build_tiny_model(tmp_path / "base", TinyModelSpec(family="qwen3_moe", num_hidden_layers=2, seed=2))
    config = AutoConfig.from_pretrained(base)
    config.mlp_only_layers = [1]
    torch.manual_seed(2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    for file in base.iterdir():
        if "token" in file.name or file.name == "chat_template.jinja":
            (tmp_path / "hf" / file.name).write_bytes(file.read_bytes())
    ctx = StageContext(Storage(), tmp_path / "work", str(tmp_path / "work"))
    run(ConvertConfig(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "ckpt")), ctx)
    run(ConvertConfig(direction="torch-dist-to-hf", input_dir=str(tmp_path / "ckpt"), output_dir=str(tmp_path / "back"),
                      origin_hf_dir=str(tmp_path / "hf")), ctx)
    original, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original) and all(torch.equal(back[n], t) for n, t in original.items())
    release = tmp_path / "ckpt" / "release"
    args = read_common(release)["args"]
    assert args.moe_layer_freq == [1, 0]
    keys = set(tensor_metadata(release))
    assert {"decoder.layers.0.mlp.router.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
            "decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"} <= keys
    assert not any(key.startswith("decoder.layers.1.mlp.router") for key in keys)
    model = gpt_model_from_args(args).eval()
    assert {key: shape for key, (shape, _) in tensor_metadata(release).items()} == declared_shapes(model)
    assert load_and_compare_logits(model, release, tmp_path / "hf") <= 1e-5


@pytest.mark.parametrize(("uri", "message"), [
    ("tiny:qwen3?num_experts=4", "qwen3 has no num_experts setting; families with one: qwen3_moe, deepseek_v3, "
                                 "glm4_moe"),
    ("tiny:qwen3_moe?q_lora_rank=8", "qwen3_moe has no q_lora_rank setting; families with one: deepseek_v3"),
    ("tiny:glm4?num_experts=4", "glm4 has no num_experts setting; families with one: qwen3_moe, deepseek_v3, glm4_moe"),
    ("tiny:qwen3_moe?num_experts=2&num_experts_per_tok=3", "num_experts_per_tok (3) must not exceed num_experts (2)"),
    ("tiny:glm4?head_dim=18", "glm4 rotates head_dim x 0.5 dimensions, which must be even for rotary embeddings: head_dim must be a multiple of 4, got 18"),
])
def test_family_specific_settings_are_checked(uri, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TinyModelSpec.from_uri(uri)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_gpt_model_of_our_layer_spec_declares_and_loads_the_checkpoint_and_matches_hf(converted, megatron_world,
                                                                                      case):
    """GLM4 with our sandwich-norm layer, Qwen3-MoE with megatron-core's experts: the checkpoint holds exactly the
    tensors GPTModel declares, and its fp32 logits are within 1e-5 of HF's (bf16 cases compute in fp32 from the
    same rounded weights)."""
    from slimeflow.families.megatron import gpt_model_from_args

    item = converted[case]
    model = gpt_model_from_args(read_common(item["release"])["args"]).eval()
    assert {key: shape for key, (shape, _) in tensor_metadata(item["release"]).items()} == declared_shapes(model)
    assert load_and_compare_logits(model, item["release"], item["hf"]) <= 1e-5


@pytest.mark.parametrize("factor", [0.5, 0.25])
def test_rotary_percent_is_checked_against_partial_rotary_factor_wherever_the_config_keeps_it(glm4_dir, factor):
    """transformers 5 writes it into rope_parameters (the tiny model's config); GLM-Z1's config.json at the top."""
    from slimeflow.config.model_args import check_model_args
    from slimeflow.config.pipeline import load_stage_config

    megatron = load_stage_config("train", None, ["--rollout-batch-size", "8", "--num-rollout", "1",
                                                 "--rotary-percent", str(factor)]).megatron
    nested = json.loads((glm4_dir / "config.json").read_text())
    top_level = {**nested, "partial_rotary_factor": 0.5, "rope_parameters": {"rope_theta": 10000.0}}
    for config in (nested, top_level):
        problems = check_model_args(megatron, config, "torch")
        assert problems == [] if factor == 0.5 else "--rotary-percent 0.25 does not match" in problems[0]


@pytest.mark.slow
def test_deepseek_v3_checkpoint_uses_the_names_and_args_slime_reads(converted):
    """Names as slime's megatron_to_hf/deepseekv3.py reads them (Transformer Engine's MLA spec); the dense first
    layer and the expert layers keyed one by one, as megatron-core keys them with moe_layer_freq a list."""
    item = converted["deepseek_v3-fp32-1p"]
    args = read_common(item["release"])["args"]
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.qk_layernorm) == (True, 24, 16, True)
    assert (args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim, args.kv_channels) == (12, 8, 20, 20)
    assert (args.moe_layer_freq, args.moe_router_score_function, args.moe_router_enable_expert_bias) == (
        [0, 1], "sigmoid", True)
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert args.moe_shared_expert_intermediate_size == 32 and args.rope_type == "rope"
    metadata = tensor_metadata(item["release"])
    layer0 = {"input_layernorm.weight", "self_attention.linear_q_down_proj.weight",
              "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.weight",
              "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.layer_norm_weight",
              "self_attention.linear_kv_up_proj.weight", "self_attention.linear_proj.weight",
              "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    assert {key.removeprefix("decoder.layers.0.") for key in metadata if key.startswith("decoder.layers.0.")} == layer0
    assert metadata["decoder.layers.1.mlp.router.expert_bias"] == ((4,), torch.float32)
    assert metadata["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"][0] == (4, 64, 64)
    assert metadata["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"][0] == (64, 64)
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in metadata
    yarn = read_common(converted["deepseek_v3-bf16-nolora-yarn-2p"]["release"])["args"]
    assert (yarn.rope_type, yarn.rotary_scaling_factor, yarn.original_max_position_embeddings) == ("yarn", 4.0, 128)
    assert yarn.q_lora_rank is None and "decoder.layers.1.self_attention.linear_q_proj.weight" in tensor_metadata(
        converted["deepseek_v3-bf16-nolora-yarn-2p"]["release"])


@pytest.mark.parametrize(("family", "change", "message"), [
    ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob is false: megatron-core's sigmoid router always"),
    ("deepseek_v3", {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2},
     "num_experts_per_tok (2) // topk_group (2) is not 2"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave is False: megatron-core's MLA always reads"),
    ("deepseek_v3", {"n_shared_experts": 0}, "n_shared_experts is 0: transformers still builds the shared experts"),
    ("glm4_moe", {"n_shared_experts": 0}, "n_shared_experts is 0: transformers still builds the shared experts"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type 'llama3': multi-latent"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "truncate": False}},
     "rope truncate False: megatron-core's YaRN has no such setting"),
])
def test_configs_megatron_would_compute_differently_are_refused_by_name(family, change, message):
    from slimeflow.families.tiny import _model_config, build_tiny_tokenizer

    spec = TinyModelSpec(family=family)
    config = {**_model_config(spec, build_tiny_tokenizer(family)).to_dict(), **change}
    problems = ModelShape.from_hf_config(config, FAMILIES[family]).problems()
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_multi_token_prediction_layers_are_refused_by_name_before_any_write(tmp_path):
    """DeepSeek-V3's and GLM-4.5's HF checkpoints keep their MTP layer after the decoder layers (model.layers.61.*)."""
    from safetensors.torch import save_file

    from slimeflow.errors import StageInputError

    hf = build_tiny_model(tmp_path / "hf", TinyModelSpec(family="deepseek_v3", num_hidden_layers=2))
    tensors = hf_tensors(hf)
    save_file({**tensors, "model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, str(hf / "model.safetensors"),
              metadata={"format": "pt"})
    ctx = StageContext(Storage(), tmp_path / "work", str(tmp_path / "work"))
    with pytest.raises(StageInputError, match=r"layers \[2\] after the 2 decoder layers are multi-token prediction"):
        run(ConvertConfig(hf_checkpoint=str(hf), save=str(tmp_path / "ckpt")), ctx)
    assert not (tmp_path / "ckpt").exists()


def test_kimi_k2s_model_type_is_read_as_deepseek_v3(new_family_dirs, tmp_path):
    """Kimi-K2's config.json says model_type kimi_k2, which transformers lacks; its architecture is DeepSeek-V3's."""
    import shutil

    from transformers import AutoModelForCausalLM

    from slimeflow.checkpoint.hf_source import inspect_hf_dir
    from slimeflow.engine.weights import load_model
    from slimeflow.families.hf import load_causal_lm

    kimi = Path(shutil.copytree(new_family_dirs["deepseek_v3"], tmp_path / "kimi"))
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    with pytest.raises(ValueError, match="kimi_k2"):
        AutoModelForCausalLM.from_pretrained(kimi)
    inspect_hf_dir(kimi)
    ids = torch.tensor([[5, 80, 200, 17]])
    with torch.no_grad():
        expected = load_causal_lm(new_family_dirs["deepseek_v3"]).eval()(ids).logits
        assert torch.equal(load_model(kimi, device="cpu").model(ids).logits, expected)
