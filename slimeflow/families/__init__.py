"""Model families as data: one spec per family, read by the tiny factory, the converter and the engine.

A spec says which HF architecture it is, the switches that shape its decoder layer (the same facts the factory
writes into a config, the converter writes into Megatron's args and the engine checks before its native forward),
its name map with fusions, and its tokenizer. Adding a family is adding a spec here plus its tests (a tiny model,
a bit-exact round trip, megatron-core's logits against HF's).

A rule of the name map names one Megatron tensor (its name inside `decoder.layers.<i>.`, as checkpoints written
with Transformer Engine layer specs spell it) and the HF tensors (inside `model.layers.<i>.`) it is made of,
joined by a fusion (the converter's mapping applies them):

    copy     one HF tensor, unchanged
    qkv      q, k, v projections interleaved by KV group: per group its query heads, one K head, one V head
    gate_up  gate and up projections concatenated on dim 0 (Megatron's fc1 for SwiGLU)

A rule `per_expert` names each expert's HF tensors with `{e}` in them; the fusion is applied to each expert's and
the results are stacked on a new dim 0 (experts), as Megatron stores them (`mlp.experts.experts.linear_fc1.weight`
is [experts, 2 x moe_ffn, hidden] per layer, whether written by SequentialMLP or grouped GEMM).

A rule `only` applies to some layers or shapes: `dense` to the dense-MLP layers of a mixture of experts (DeepSeek's
first_k_dense_replace, Qwen3-MoE's mlp_only_layers), `moe` to its expert layers, `q_lora` / `no_q_lora` to
multi-latent attention with or without a query LoRA rank (DeepSeek-V3 has one; Moonlight and V2-Lite do not).
A rule `when` a Megatron flag applies only where that flag is on (FLAGS: biases, q/k norms), which the HF config's
switches decide (`Switch`: `attention_bias`, `mlp_bias`, `use_qk_norm`) or the family fixes (`fixed_flags`: Qwen2's
QKV bias, which its config class has no field for). A switch value a family cannot convert is refused, by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from slimeflow.families.chat import GLM4_TOKENIZER, LLAMA3_TOKENIZER, QWEN_TOKENIZER, TokenizerInfo

Fusion = Literal["copy", "qkv", "gate_up"]
Only = Literal["dense", "moe", "q_lora", "no_q_lora"]
Flag = Literal["add_qkv_bias", "qk_layernorm", "add_bias_linear"]
FLAGS: tuple[Flag, ...] = ("add_qkv_bias", "qk_layernorm", "add_bias_linear")
"""Megatron's flags that decide which tensors a layer has: q/k/v biases; per-head q/k norms (multi-latent attention:
its latent norms); biases on the attention output projection and on the MLP (megatron-core has one flag for both,
and it gives q/k/v biases too)."""


@dataclass(frozen=True)
class Rule:
    """Megatron per-layer tensor `megatron` is `fusion` of the HF per-layer tensors `hf` (in that order)."""

    megatron: str
    hf: tuple[str, ...]
    fusion: Fusion = "copy"
    per_expert: bool = False
    only: Only | None = None
    """None: every layer of every shape of the family."""
    when: Flag | None = None
    """The Megatron flag that must be on for this tensor to exist (None: always)."""


@dataclass(frozen=True)
class Switch:
    """A boolean HF config field that decides which tensors the layers have: true turns Megatron's `flags` on."""

    field: str
    default: bool
    """Its value when config.json leaves it out: the default of the family's transformers config class."""
    flags: tuple[Flag, ...]
    refused: Mapping[bool, str] = field(default_factory=dict)
    """Values that no Megatron model of this family computes as HF does, with the reason."""


@dataclass(frozen=True)
class FamilySpec:
    """One model family. `name` is its key everywhere: `tiny:<name>`, the converter's family, manifests."""

    name: str
    model_type: str
    """transformers' `model_type`: which config and model classes are used."""
    architectures: tuple[str, ...]
    """HF `architectures` entries the converter recognises as this family."""
    layer_rules: tuple[Rule, ...]
    tokenizer: TokenizerInfo
    switches: tuple[Switch, ...] = ()
    """The config fields that decide which tensors exist (attention_bias, mlp_bias, use_qk_norm)."""
    fixed_flags: frozenset[Flag] = frozenset()
    """Megatron flags always on, whatever the config says (its class has no field for them: Qwen2's QKV bias, Qwen3's
    q/k norms, multi-latent attention's latent norms)."""
    sandwich_norms: bool = False
    """RMSNorm on the attention and MLP outputs before each residual add (GLM4; Megatron, as slime patches it:
    post_self_attn_layernorm, post_mlp_layernorm)."""
    rotary_interleaved: bool = False
    """RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... instead of the two halves (GLM4)."""
    configurable_head_dim: bool = True
    """The config has a `head_dim` field, so head_dim may differ from hidden_size / num_attention_heads."""
    config_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Config fields the tiny factory sets (for a switch: its tiny models' value unless a tiny spec gives one)."""
    rope_overrides: Mapping[str, Any] = field(default_factory=dict)
    """The same inside the config's `rope_parameters` (GLM4 rotates half of each head: partial_rotary_factor)."""
    native_forward: bool = False
    """The engine's native forward (slimeflow/engine/native.py) computes this family; else transformers' does."""
    tiny_defaults: Mapping[str, Any] = field(default_factory=dict)
    """Values of the tiny factory's family-specific fields (e.g. the experts of a mixture of experts): the tiny spec's
    fields where it has them, else HF config fields."""
    config_names: Mapping[str, str] = field(default_factory=dict)
    """The HF config's names of tiny spec fields where they differ (DeepSeek: num_experts is n_routed_experts)."""
    multi_latent_attention: bool = False
    """DeepSeek's MLA: low-rank query and key/value projections, a RoPE part of each head (Megatron:
    MLASelfAttention, multi_latent_attention)."""
    refused_config: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    """HF config fields whose value (the first item) this spec does not convert yet, with the reason."""
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """The MoE router's score (Megatron: moe_router_score_function); sigmoid routers add an expert-score correction
    bias before choosing (HF: e_score_correction_bias; Megatron: expert_bias, moe_router_enable_expert_bias)."""

    @property
    def has_experts(self) -> bool:
        return any(rule.per_expert for rule in self.layer_rules)

    def flags(self, config: Mapping[str, Any]) -> dict[Flag, bool]:
        """Megatron's FLAGS for an HF config.json of this family (a field it leaves out at its class's default)."""
        on = {flag: flag in self.fixed_flags for flag in FLAGS}
        for switch in self.switches:
            if switch_value(config, switch):
                on.update(dict.fromkeys(switch.flags, True))
        return on

    def switch_problems(self, config: Mapping[str, Any]) -> list[str]:
        """The switch values of an HF config.json that this family cannot convert, each naming field and value."""
        problems = [f"{s.field} is {switch_value(config, s)}: {s.refused[switch_value(config, s)]}"
                    for s in self.switches if switch_value(config, s) in s.refused]
        for flag in FLAGS:  # switches sharing one Megatron flag: megatron-core builds all their tensors or none
            sharing = [s for s in self.switches if flag in s.flags and switch_value(config, s) not in s.refused]
            if len({switch_value(config, s) for s in sharing}) > 1:
                values = " with ".join(f"{s.field} {switch_value(config, s)}" for s in sharing)
                problems.append(f"{values}: Megatron's {flag} builds the tensors of all of them or of none; "
                                f"{self.name} converts only configs where they agree")
        return problems

    @property
    def qk_norm(self) -> bool:
        """Per-head q/k norms with the config class's defaults (the engine's native families: Qwen3 always, Llama
        and Qwen2 never; no config field changes it for them)."""
        return self.flags({})["qk_layernorm"] and not self.multi_latent_attention

    @property
    def router_expert_bias(self) -> bool:
        return self.router_score_function == "sigmoid"


GLOBAL_RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",)),
)
"""Tensors outside the layers, the same in every family; `output_layer` is absent when embeddings are tied."""

VOCAB_PADDED = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})
"""Megatron tensors whose dim 0 is the (padded) vocabulary."""

_INPUT_NORM = Rule("self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",))
_QKV = Rule("self_attention.linear_qkv.weight",
            ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv")
_QKV_BIAS = Rule("self_attention.linear_qkv.bias",
                 ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv",
                 when="add_qkv_bias")
_QK_NORM = (
    Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), when="qk_layernorm"),
    Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), when="qk_layernorm"),
)
_PROJ = Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",))
_LINEAR_BIASES = (
    Rule("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), when="add_bias_linear"),
    Rule("mlp.linear_fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), "gate_up", when="add_bias_linear"),
    Rule("mlp.linear_fc2.bias", ("mlp.down_proj.bias",), when="add_bias_linear"),
)
"""Llama's o_proj and MLP biases: Megatron's add_bias_linear, one flag for all of them."""

_MLP_NORM = Rule("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",))
_FC2 = Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",))
_DENSE_RULES: tuple[Rule, ...] = (
    _INPUT_NORM, _QKV, _PROJ, _MLP_NORM,
    Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    _FC2,
)
_GLM4_RULES: tuple[Rule, ...] = (
    _INPUT_NORM, _QKV, _QKV_BIAS, _PROJ,
    Rule("post_self_attn_layernorm.weight", ("post_self_attn_layernorm.weight",)),
    _MLP_NORM,
    Rule("mlp.linear_fc1.weight", ("mlp.gate_up_proj.weight",)),  # HF already stores [gate; up]
    _FC2,
    Rule("post_mlp_layernorm.weight", ("post_mlp_layernorm.weight",)),
)

_MOE_RULES: tuple[Rule, ...] = (_INPUT_NORM, _QKV, _PROJ, *_QK_NORM)

_NO_O_PROJ_BIAS = ("it puts a bias on o_proj as well as on q/k/v, which Megatron builds only with add_bias_linear, "
                   "and that adds biases to every linear layer of the MLP, which this family does not have")

LLAMA = FamilySpec(
    "llama", "llama", ("LlamaForCausalLM",), (*_DENSE_RULES, _QKV_BIAS, *_LINEAR_BIASES), LLAMA3_TOKENIZER,
    # attention_bias: q/k/v and o_proj; mlp_bias: gate/up/down. Megatron's add_bias_linear covers o_proj and the MLP
    # at once, so the two must agree (switch_problems).
    switches=(Switch("attention_bias", False, ("add_qkv_bias", "add_bias_linear")),
              Switch("mlp_bias", False, ("add_bias_linear",))),
    config_overrides={"attention_bias": False, "mlp_bias": False}, native_forward=True,
)
QWEN2 = FamilySpec(
    "qwen2", "qwen2", ("Qwen2ForCausalLM",), (*_DENSE_RULES, _QKV_BIAS), QWEN_TOKENIZER,
    fixed_flags=frozenset({"add_qkv_bias"}),  # hard-wired in transformers' Qwen2 attention; its config has no field
    configurable_head_dim=False, native_forward=True,
)
QWEN3 = FamilySpec(
    "qwen3", "qwen3", ("Qwen3ForCausalLM",), (*_DENSE_RULES, *_QK_NORM), QWEN_TOKENIZER,
    switches=(Switch("attention_bias", False, ("add_qkv_bias", "add_bias_linear"), {True: _NO_O_PROJ_BIAS}),),
    fixed_flags=frozenset({"qk_layernorm"}), config_overrides={"attention_bias": False}, native_forward=True,
)
GLM4 = FamilySpec(
    "glm4", "glm4", ("Glm4ForCausalLM",), _GLM4_RULES, GLM4_TOKENIZER,
    switches=(Switch("attention_bias", True, ("add_qkv_bias",)),),  # q/k/v only: GLM4's o_proj has no bias
    sandwich_norms=True, rotary_interleaved=True, config_overrides={"attention_bias": True},
    rope_overrides={"partial_rotary_factor": 0.5},
)

_DENSE_MLP_OF_MOE: tuple[Rule, ...] = tuple(Rule(r.megatron, r.hf, r.fusion, only="dense") for r in _DENSE_RULES[3:])
"""A dense layer of a mixture of experts: the dense model's MLP, its norm fused into fc1 (Transformer Engine)."""
_EXPERTS: tuple[Rule, ...] = (
    # Before experts the norm is a layer of its own (Transformer Engine's MoE spec: TENorm), not fused into fc1.
    Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), only="moe"),
    Rule("mlp.router.weight", ("mlp.gate.weight",), only="moe"),
    Rule("mlp.experts.experts.linear_fc1.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
         "gate_up", per_expert=True, only="moe"),
    Rule("mlp.experts.experts.linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",), per_expert=True, only="moe"),
)
_SHARED_EXPERTS_AND_BIAS: tuple[Rule, ...] = (
    Rule("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), only="moe"),
    Rule("mlp.shared_experts.linear_fc1.weight",
         ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), "gate_up", only="moe"),
    Rule("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), only="moe"),
)
_ZERO_SHARED_EXPERTS = ("transformers still builds the shared experts then, zero rows wide, which Megatron has no "
                        "form of (it builds none)")
_MLA_RULES: tuple[Rule, ...] = (
    # Transformer Engine's MLA spec keeps the input norm as a layer of its own and fuses the two latent norms into
    # the up projections that follow them (slime's deepseekv3 converter reads these names).
    Rule("input_layernorm.weight", ("input_layernorm.weight",)),
    Rule("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), only="no_q_lora"),
    Rule("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), only="q_lora"),
    Rule("self_attention.linear_q_up_proj.layer_norm_weight", ("self_attn.q_a_layernorm.weight",), only="q_lora"),
    Rule("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), only="q_lora"),
    Rule("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",)),
    Rule("self_attention.linear_kv_up_proj.layer_norm_weight", ("self_attn.kv_a_layernorm.weight",)),
    Rule("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",)),
    _PROJ,
)

QWEN3_MOE = FamilySpec(
    "qwen3_moe", "qwen3_moe", ("Qwen3MoeForCausalLM",), (*_MOE_RULES, *_EXPERTS, *_DENSE_MLP_OF_MOE), QWEN_TOKENIZER,
    switches=(Switch("attention_bias", False, ("add_qkv_bias", "add_bias_linear"), {True: _NO_O_PROJ_BIAS}),),
    fixed_flags=frozenset({"qk_layernorm"}),
    config_overrides={"attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    tiny_defaults={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
)

DEEPSEEK_V3 = FamilySpec(
    "deepseek_v3", "deepseek_v3", ("DeepseekV3ForCausalLM",),
    (*_MLA_RULES, *_DENSE_MLP_OF_MOE, *_EXPERTS, *_SHARED_EXPERTS_AND_BIAS), LLAMA3_TOKENIZER,
    configurable_head_dim=False, multi_latent_attention=True, router_score_function="sigmoid",
    # attention_bias: biases on q_a_proj and kv_a_proj_with_mqa, MLA's down projections.
    switches=(Switch("attention_bias", False, (), {True: "megatron-core's multi-latent attention builds its down "
                                                        "projections without biases"}),),
    fixed_flags=frozenset({"qk_layernorm"}),  # MLA's latent norms are Megatron's qk_layernorm (slime passes it)
    # Interleaved RoPE weights (DeepSeek's layout), which megatron-core's MLA de-interleaves the same way.
    config_overrides={"attention_bias": False, "norm_topk_prob": True, "rope_interleave": True},
    refused_config={"rope_interleave": (False, "megatron-core's MLA always reads the RoPE part of each head as "
                                               "interleaved pairs, as DeepSeek's weights are laid out"),
                    "n_shared_experts": (0, _ZERO_SHARED_EXPERTS)},
    # Tiny models borrow Llama 3's byte tokenizer and chat template (DeepSeek's own are not built yet).
    tiny_defaults={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
                   "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 24,
                   "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 20,
                   "routed_scaling_factor": 2.5, "yarn_factor": None},
    config_names={"num_experts": "n_routed_experts"},
)

GLM4_MOE = FamilySpec(
    "glm4_moe", "glm4_moe", ("Glm4MoeForCausalLM",),
    (_INPUT_NORM, _QKV, _QKV_BIAS, _PROJ, *_QK_NORM, *_DENSE_MLP_OF_MOE, *_EXPERTS, *_SHARED_EXPERTS_AND_BIAS),
    GLM4_TOKENIZER,
    switches=(Switch("attention_bias", False, ("add_qkv_bias",)), Switch("use_qk_norm", False, ("qk_layernorm",))),
    router_score_function="sigmoid", rope_overrides={"partial_rotary_factor": 0.5},
    # Tiny models as GLM-4.5's config: QKV biases, no q/k norms (the class defaults to no bias).
    config_overrides={"attention_bias": True, "use_qk_norm": False, "norm_topk_prob": True},
    refused_config={"n_shared_experts": (0, _ZERO_SHARED_EXPERTS)},
    tiny_defaults={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
                   "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5},
    config_names={"num_experts": "n_routed_experts"},
)

FAMILIES: Mapping[str, FamilySpec] = {spec.name: spec
                                      for spec in (LLAMA, QWEN2, QWEN3, GLM4, QWEN3_MOE, DEEPSEEK_V3, GLM4_MOE)}
BY_ARCHITECTURE: Mapping[str, FamilySpec] = {arch: f for f in FAMILIES.values() for arch in f.architectures}
BY_MODEL_TYPE: Mapping[str, FamilySpec] = {f.model_type: f for f in FAMILIES.values()}


def family_for(architectures: list[str] | None) -> FamilySpec | None:
    """The family of an HF config's `architectures` list, or None when no spec covers it."""
    for arch in architectures or ():
        if arch in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[arch]
    return None


def supported_architectures() -> list[str]:
    return sorted(BY_ARCHITECTURE)


def switch_value(config: Mapping[str, Any], switch: Switch) -> bool:
    """A switch's value in an HF config.json: its field, else the config class's default (null reads as false, as
    transformers' nn.Linear(bias=None) does)."""
    return bool(config.get(switch.field, switch.default))


# ---------------------------------------------------------------------------------------------------------------
# Fields of an HF config.json that need more than a lookup (the converter's ModelShape and the train stage's
# MODEL_ARGS check read them the same way)
# ---------------------------------------------------------------------------------------------------------------


def rope_setting(config: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """A RoPE setting (rope_theta, partial_rotary_factor): transformers 5 keeps them in `rope_parameters`, older
    configs at the top level."""
    return (config.get("rope_parameters") or {}).get(name, config.get(name, default))


def query_groups(config: Mapping[str, Any]) -> int:
    """KV heads: num_key_value_heads, else one per query head. KeyError names a missing field."""
    return config.get("num_key_value_heads") or config["num_attention_heads"]


def head_dim(config: Mapping[str, Any]) -> int:
    """head_dim, else hidden_size / num_attention_heads. KeyError names a missing field."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def moe_fields(config: Mapping[str, Any], family: FamilySpec) -> dict[str, Any]:
    """An HF config's mixture of experts in Megatron's names (the converter's ModelShape fields; `dense_layers` the
    layers whose MLP is dense, `unsupported` what Megatron would compute differently): Qwen3-MoE's field names
    (transformers 5 may say num_local_experts), DeepSeek's and GLM4-MoE's (n_routed_experts,
    first_k_dense_replace, groups, shared experts)."""
    layers, step = config["num_hidden_layers"], config.get("decoder_sparse_step", 1) or 1
    only = set(config.get("mlp_only_layers") or ())
    first_moe = config.get("first_k_dense_replace") or 0
    shared = config.get("n_shared_experts") or 0
    norm_topk = bool(config.get("norm_topk_prob", False))
    sigmoid = family.router_score_function == "sigmoid"
    topk = config.get("num_experts_per_tok") or 0
    unsupported = []
    if sigmoid and not norm_topk and topk > 1:
        unsupported.append("norm_topk_prob is false: megatron-core's sigmoid router always normalises the top-k "
                           "weights, so the model would not compute what HF's does")
    grouped = sigmoid and (config.get("n_group") or 1) > 1
    return {
        "num_experts": config.get("num_experts") or config.get("n_routed_experts") or config.get("num_local_experts")
        or 0,
        "moe_ffn_hidden_size": config["moe_intermediate_size"],
        "moe_router_topk": topk,
        # sigmoid routers score before choosing (Megatron's flag is read by its softmax router only)
        "moe_router_pre_softmax": sigmoid or not norm_topk,
        "dense_layers": tuple(i for i in range(layers) if i in only or (i + 1) % step or i < first_moe),
        "moe_router_num_groups": config["n_group"] if grouped else None,
        "moe_router_group_topk": config["topk_group"] if grouped else None,
        "moe_router_topk_scaling_factor": config.get("routed_scaling_factor") if sigmoid else None,
        "moe_shared_expert_intermediate_size": config["moe_intermediate_size"] * shared if shared else None,
        "unsupported": tuple(unsupported),
    }


YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
"""YaRN settings an HF config may leave out, at the values HF and megatron-core both assume then."""


def mla_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSeek-V3 HF config's multi-latent attention and its RoPE in Megatron's names (`yarn`: YaRN's settings,
    None for plain RoPE; `unsupported` as in moe_fields)."""
    unsupported = []
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    yarn = None
    if kind == "yarn":
        yarn = {"rotary_scaling_factor": float(rope["factor"]),
                "original_max_position_embeddings": int(rope.get("original_max_position_embeddings")
                                                        or config["max_position_embeddings"]),
                **{name: float(rope.get(name) or default) for name, default in YARN_DEFAULTS.items()}}
        # megatron-core derives both from the settings above (and rounds the correction range, as truncate does)
        unsupported += [f"rope {name} {rope[name]!r}: megatron-core's YaRN has no such setting"
                        for name, plain in (("attention_factor", None), ("truncate", True)) if rope.get(name, plain)
                        != plain]
    elif kind != "default":
        unsupported.append(f"rope_type {kind!r}: multi-latent attention converts with default or yarn RoPE only")
    return {"q_lora_rank": config.get("q_lora_rank"), "kv_lora_rank": config["kv_lora_rank"],
            "qk_head_dim": config["qk_nope_head_dim"], "qk_pos_emb_head_dim": config["qk_rope_head_dim"],
            "v_head_dim": config["v_head_dim"], "yarn": yarn,
            "unsupported": tuple(unsupported)}
