"""slime's MoE and MLA MODEL_ARGS (DeepSeek-V3, GLM-4.5) under the torch backend: the shape flags are taken and
checked against the HF config; Megatron's MoE runtime flags are the Megatron backend's (kernel ones refused)."""

from __future__ import annotations

import pytest

from slimeflow.config.model_args import check_model_args, moe_layer_freq
from slimeflow.config.pipeline import load_stage_config

# DeepSeek-V3's config.json (the fields MODEL_ARGS describe), as published with the model.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "first_k_dense_replace": 3,
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "topk_group": 4, "v_head_dim": 128,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "vocab_size": 129280, "tie_word_embeddings": False, "hidden_act": "silu",
}
# slime's scripts/models/deepseek-v3.sh: its shape flags (the bash loop's moe-layer-freq written out) ...
DEEPSEEK_V3_ARGS = [
    "--disable-bias-linear", "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432",
    "--num-attention-heads", "128", "--kv-channels", "128", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--norm-epsilon", "1e-6", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "129280", "--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512",
    "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--qk-layernorm",
    "--rotary-scaling-factor", "40", "--rotary-base", "10000", "--mscale", "1.0", "--mscale-all-dim", "1.0",
    "--num-experts", "256", "--moe-layer-freq", "[" + ", ".join(["0"] * 3 + ["1"] * 58) + "]",
    "--moe-ffn-hidden-size", "2048", "--moe-router-topk", "8", "--moe-shared-expert-intermediate-size", "2048",
    "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-group-topk", "4", "--moe-router-num-groups", "8", "--moe-router-topk-scaling-factor", "2.5",
]
# ... and its Megatron runtime flags
DEEPSEEK_V3_RUNTIME = ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
                       "--moe-aux-loss-coeff", "0", "--moe-router-bias-update-rate", "0", "--moe-grouped-gemm",
                       "--moe-router-dtype", "fp32", "--moe-permute-fusion", "--moe-z-loss-coeff", "1e-3"]
# GLM-4.5-Air (scripts/models/glm4.5-106B-A12B.sh) with its config.json's fields
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "first_k_dense_replace": 1,
    "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_group": 1,
    "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96,
    "num_experts_per_tok": 8, "num_hidden_layers": 46, "num_key_value_heads": 8, "head_dim": 128,
    "partial_rotary_factor": 0.5, "rope_theta": 1000000, "routed_scaling_factor": 1.0, "topk_group": 1,
    "vocab_size": 151552, "attention_bias": True, "use_qk_norm": False, "rms_norm_eps": 1e-05, "hidden_act": "silu",
}
GLM45_AIR_ARGS = [
    "--disable-bias-linear", "--group-query-attention", "--num-attention-heads", "96", "--num-query-groups", "8",
    "--kv-channels", "128", "--num-layers", "46", "--hidden-size", "4096", "--ffn-hidden-size", "10944",
    "--add-qkv-bias", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-percent", "0.5",
    "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "151552", "--rotary-base", "1000000",
    "--moe-ffn-hidden-size", "1408", "--moe-shared-expert-intermediate-size", "1408", "--moe-router-pre-softmax",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-topk", "8",
    "--moe-layer-freq", "[0]*1+[1]*45", "--num-experts", "128",
]


def megatron(*flags: str):
    return load_stage_config("train", None, ["--rollout-batch-size", "8", "--num-rollout", "1", *flags]).megatron


@pytest.mark.parametrize(("flags", "config"), [(DEEPSEEK_V3_ARGS, DEEPSEEK_V3), (GLM45_AIR_ARGS, GLM45_AIR)])
def test_slimes_moe_and_mla_model_args_match_the_models_config(flags, config):
    assert check_model_args(megatron(*flags), config, "torch") == []


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("8", "6", "--moe-router-topk 6 does not match the HF config (num_experts_per_tok: 8 means 8)"),
    ("[" + ", ".join(["0"] * 3 + ["1"] * 58) + "]", "[0]*1+[1]*60",
     "--moe-layer-freq [0]*1+[1]*60 does not match the HF config (first_k_dense_replace / mlp_only_layers: absent "
     "means [0]*3+[1]*58)"),
    ("1536", "512", "--q-lora-rank 512 does not match the HF config (q_lora_rank: 1536 means 1536)"),
    ("40", "4", "--rotary-scaling-factor 4.0 does not match the HF config (rope_scaling.factor"),
    ("sigmoid", "softmax", "--moe-router-score-function softmax does not match the HF config (architectures"),
])
def test_a_moe_or_mla_flag_that_contradicts_the_config_is_refused(old, new, expected):
    flags = list(DEEPSEEK_V3_ARGS)
    flags[flags.index(old)] = new
    problems = check_model_args(megatron(*flags), DEEPSEEK_V3, "torch")
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_moe_flags_on_a_dense_model_are_refused():
    problems = check_model_args(megatron("--num-experts", "8", "--multi-latent-attention"),
                                {**GLM45_AIR, "architectures": ["Glm4ForCausalLM"]}, "torch")
    assert [p.split(" ", 1)[0] for p in problems] == ["--num-experts", "--multi-latent-attention"]


def test_megatrons_moe_runtime_flags_are_the_megatron_backends():
    """Taken by the parser; the torch backend refuses each one set (it runs HF's experts); the Megatron backend
    takes them, the two that need Transformer Engine's kernels where it is installed (megatron_kernels)."""
    from slimeflow.train.backends.megatron.kernels import Kernels, kernel_problems

    config = megatron(*DEEPSEEK_V3_ARGS, *DEEPSEEK_V3_RUNTIME)
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_router_bias_update_rate == 0.0
    assert config.moe_z_loss_coeff == 1e-3
    torch_refused = [p.split(" ", 1)[0] for p in check_model_args(config, DEEPSEEK_V3, "torch")]
    assert sorted(torch_refused) == ["--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-bias-update-rate",
                                     "--moe-router-dtype", "--moe-router-load-balancing-type",
                                     "--moe-token-dispatcher-type", "--moe-z-loss-coeff"]  # --moe-aux-loss-coeff 0 is the default
    assert check_model_args(config, DEEPSEEK_V3, "megatron") == []
    megatron_refused = kernel_problems(config, Kernels(cuda=False, transformer_engine=False))
    assert [p.split(":", 1)[0] for p in megatron_refused] == ["--moe-grouped-gemm", "--moe-permute-fusion"]
    assert all("Transformer Engine" in p for p in megatron_refused)
    assert kernel_problems(config, Kernels(cuda=True, transformer_engine=True)) == []


def test_moe_layer_freq_reads_megatrons_forms():
    assert moe_layer_freq("[0]*2+[1]*3", 5) == [0, 0, 1, 1, 1]
    assert moe_layer_freq("[0, 1, 1]", 3) == [0, 1, 1]
    assert moe_layer_freq("2", 4) == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="is not a list term"):
        moe_layer_freq("[0]*2+range(3)", 5)
