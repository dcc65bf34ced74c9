"""slime's Megatron flags: model-shape flags (MODEL_ARGS) checked against the HF config, and the parallelism and
recompute flags a backend does not build refused, so that none of them is accepted and then ignored.

slime's guide asks users to check `--rotary-base` and friends by hand against the model; here every model-shape
flag the user gave is compared with the field of `config.json` it describes, and a mismatch names the flag, both
values and the field. Only flags set away from their defaults are compared (a config that went through JSON, as
Prefect parameters do, has every field set), so a run without MODEL_ARGS checks nothing. Parallelism (TP, PP, CP, EP, SP) and recompute are Megatron's; the torch backend trains
data-parallel over --actor-num-nodes x --actor-num-gpus-per-node ranks, so a non-default value is refused; the
Megatron backend builds TP, PP and DP and refuses the rest by name (MEGATRON_NOT_BUILT, megatron_backend_problems).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from slimeflow.families import head_dim, query_groups, rope_setting
from slimeflow.stages.rl.config import MegatronConfig, TrainConfig

MEGATRON_ONLY = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    "recompute_granularity", "recompute_method", "recompute_num_layers",
)


# flag field -> (config.json field as named in messages, how to read it from the HF config)
SHAPE: dict[str, tuple[str, Callable[[Mapping[str, Any]], Any]]] = {
    "num_layers": ("num_hidden_layers", lambda hf: hf.get("num_hidden_layers")),
    "hidden_size": ("hidden_size", lambda hf: hf.get("hidden_size")),
    "ffn_hidden_size": ("intermediate_size", lambda hf: hf.get("intermediate_size")),
    "num_attention_heads": ("num_attention_heads", lambda hf: hf.get("num_attention_heads")),
    "num_query_groups": ("num_key_value_heads", query_groups),
    "kv_channels": ("head_dim", head_dim),
    "norm_epsilon": ("rms_norm_eps", lambda hf: hf.get("rms_norm_eps")),
    "rotary_base": ("rope_theta", lambda hf: rope_setting(hf, "rope_theta")),
    "vocab_size": ("vocab_size", lambda hf: hf.get("vocab_size")),
    "max_position_embeddings": ("max_position_embeddings", lambda hf: hf.get("max_position_embeddings")),
    "untie_embeddings_and_output_weights": ("tie_word_embeddings",
                                            lambda hf: not hf.get("tie_word_embeddings", False)),
    "swiglu": ("hidden_act", lambda hf: hf.get("hidden_act") == "silu"),
    "group_query_attention": ("num_key_value_heads", lambda hf: query_groups(hf) != hf["num_attention_heads"]),
    "rotary_percent": ("partial_rotary_factor", lambda hf: rope_setting(hf, "partial_rotary_factor", 1.0)),
    "attention_dropout": ("attention_dropout", lambda hf: hf.get("attention_dropout", 0.0)),
    "hidden_dropout": ("hidden_dropout", lambda hf: hf.get("hidden_dropout", 0.0)),
    "normalization": ("rms_norm_eps", lambda hf: "RMSNorm" if "rms_norm_eps" in hf else "LayerNorm"),
}
"""--qk-layernorm and --add-qkv-bias are properties of the family the HF config names, which the converter checks
tensor by tensor; --make-vocab-size-divisible-by sets the padding. The rest is checked in `_consistency`."""


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _equal(given: Any, actual: Any) -> bool:
    if isinstance(given, float) or isinstance(actual, float):
        return actual is not None and abs(float(given) - float(actual)) <= 1e-9 * max(1.0, abs(float(actual)))
    return given == actual


_NOT_BUILT = "the Megatron backend does not build it yet (this version: TP, PP and DP)"
MEGATRON_NOT_BUILT = {
    "context_parallel_size": "context parallelism: " + _NOT_BUILT + "; on a CPU it cannot run at all (megatron-core's "
                             "local attention asserts context parallel size 1)",
    "expert_model_parallel_size": "expert parallelism (MoE): " + _NOT_BUILT,
    "expert_tensor_parallel_size": "expert tensor parallelism (MoE): " + _NOT_BUILT,
    "sequence_parallel": "sequence parallelism: " + _NOT_BUILT + " (the local layer spec's norms need the "
                         "sequence-parallel tag first)",
    "recompute_granularity": "activation recomputation: " + _NOT_BUILT,
    "recompute_method": "activation recomputation: " + _NOT_BUILT,
    "recompute_num_layers": "activation recomputation: " + _NOT_BUILT,
}
"""The Megatron parallelism/recompute flags the Megatron backend refuses, with the reason."""


def check_model_args(megatron: MegatronConfig, hf_config: Mapping[str, Any], backend: str) -> list[str]:
    """Problems with the Megatron flags for a run on `backend` with this HF config.json; empty when all is well."""
    problems = []
    defaults = MegatronConfig()
    if backend == "convert":  # torch_dist is resharded by whoever loads it; only TP shapes the vocabulary padding
        for field in MEGATRON_ONLY:
            value = getattr(megatron, field)
            if field != "tensor_model_parallel_size" and value != getattr(defaults, field):
                problems.append(f"{_flag(field)} {value}: the converter writes one torch_dist checkpoint that any "
                                "parallel layout loads (Megatron reshards it), so it takes no parallel or recompute "
                                "setting but --tensor-model-parallel-size (the vocabulary padding): remove it")
    if backend == "megatron":
        problems += [f"{_flag(field)} {getattr(megatron, field)}: {reason}; remove it"
                     for field, reason in MEGATRON_NOT_BUILT.items()
                     if getattr(megatron, field) != getattr(defaults, field)]
    if backend == "torch":
        for field in MEGATRON_ONLY:
            value = getattr(megatron, field)
            if value != getattr(defaults, field):
                problems.append(f"{_flag(field)} {value}: Megatron parallelism/recompute, read only by "
                                "--train-backend megatron; the torch backend trains "
                                "data-parallel over --actor-num-nodes x --actor-num-gpus-per-node ranks: remove it")
    for field, (hf_field, read) in SHAPE.items():
        value = getattr(megatron, field)
        if value is None or value == getattr(defaults, field):
            continue
        try:
            actual = read(hf_config)
        except KeyError:  # the config lacks a field the value derives from
            actual = None
        if not _equal(value, actual):
            problems.append(f"{_flag(field)} {value} does not match the HF config ({hf_field}: "
                            f"{hf_config.get(hf_field, 'absent')} means {actual}); correct the flag or drop it")
    return problems + _consistency(megatron, hf_config)


def _consistency(megatron: MegatronConfig, hf_config: Mapping[str, Any]) -> list[str]:
    """The MODEL_ARGS that describe a property rather than copy a config.json field."""
    problems = []
    # Megatron-LM: --use-rotary-position-embeddings (the older spelling) makes the type rope whatever else is given.
    if megatron.position_embedding_type != "rope" and not megatron.use_rotary_position_embeddings:
        problems.append(f"--position-embedding-type {megatron.position_embedding_type}: every supported family uses "
                        "rotary embeddings (rope); correct the flag or drop it")
    limit = hf_config.get("max_position_embeddings")
    if megatron.seq_length is not None and limit is not None and megatron.seq_length > limit:
        problems.append(f"--seq-length {megatron.seq_length} is longer than the HF config's max_position_embeddings "
                        f"({limit}); lower it or drop it")
    mlp_bias = bool(hf_config.get("mlp_bias", False))
    if megatron.disable_bias_linear and mlp_bias:
        problems.append("--disable-bias-linear: the HF config has mlp_bias true (its MLP has biases); drop the flag")
    return problems


def megatron_backend_problems(config: TrainConfig) -> list[str]:
    """What keeps a --train-backend megatron run from starting (beyond check_model_args): its start checkpoint,
    the rank count against TP x PP, and what the backend does not build yet."""
    from slimeflow.io.checkpoints import find_latest
    from slimeflow.io.storage import Storage, is_local

    problems = []
    ckpt, placement, m = config.checkpoint, config.placement, config.megatron
    resumable = ckpt.load is not None and is_local(ckpt.load) and find_latest(Storage(), ckpt.load) is not None
    if ckpt.ref_load is None and not resumable:
        problems.append("--train-backend megatron starts from a torch_dist checkpoint, as slime's: pass --ref-load "
                        "(convert the HF checkpoint with `slimeflow convert --hf-checkpoint ... --save ...`)")
    if (config.algorithm.use_kl_loss or config.algorithm.kl_coef > 0) and ckpt.ref_load is None:
        problems.append("--use-kl-loss / --kl-coef with --train-backend megatron need --ref-load (the reference "
                        "model's torch_dist checkpoint)")
    ranks = placement.actor_num_nodes * placement.actor_num_gpus_per_node
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
    if ranks % model_parallel:
        problems.append(f"{ranks} training ranks (--actor-num-nodes x --actor-num-gpus-per-node) are not a multiple "
                        f"of --tensor-model-parallel-size x --pipeline-model-parallel-size = {model_parallel}")
    if config.optimizer.bf16:
        problems.append("--bf16 with --train-backend megatron: " + _NOT_BUILT + " (it trains in fp32)")
    return problems
