"""Tiny, deterministic HF causal-LM checkpoints of every family in `slimeflow.families`, built offline from a seed.

Tests of later stages (the HF <-> Megatron converter, preprocessing, RL) and the CPU demo need real HF
directories with the odd shapes of real models: GQA, tied or untied embeddings, vocabularies that are not a
multiple of 128, bf16/fp16/fp32 weights. `build_tiny_model` writes one in about a second; a spec is also
written as a URI, ``tiny:qwen3?seed=3&hidden_size=96``, so a pipeline config can name one as its checkpoint.

The tokenizer is byte-level BPE without merges: ids 0..255 are the UTF-8 bytes, so any text round-trips
(Qwen's NFC-normalized first, as the real ones), followed by each family's special tokens (its spec's tokenizer).

torch, tokenizers and transformers are imported inside the builders, so parsing a spec stays cheap.
"""

from __future__ import annotations

import math
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from slimeflow.families import FAMILIES, FamilySpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

Family = str
"""A key of `slimeflow.families.FAMILIES` (checked when a spec is made)."""
DType = Literal["float32", "bfloat16", "float16"]

URI_PREFIX = "tiny:"
NUM_BYTE_TOKENS = 256
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# Constant-initialised tensors (norm weights, biases) get noise of this scale; see `_perturb_constant_params`.
_PERTURB_STD = 0.02

# --------------------------------------------------------------------------------------------------------------
# The spec and its URI form
# --------------------------------------------------------------------------------------------------------------


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false"):
        raise ValueError(text)
    return lowered == "true"


@dataclass(frozen=True)
class SpecParam:
    """How one URI query value is parsed; `allowed` is said in the error when it does not parse."""

    parse: Callable[[str], Any]
    allowed: str


_INT = SpecParam(int, "an integer")
_POSITIVE_INT = SpecParam(int, "a positive integer")
_FLOAT = SpecParam(float, "a positive number")
_BOOL = SpecParam(_parse_bool, "true or false")

SPEC_PARAMS: dict[str, SpecParam] = {
    "seed": _INT,
    "hidden_size": _POSITIVE_INT,
    "num_hidden_layers": _POSITIVE_INT,
    "num_attention_heads": _POSITIVE_INT,
    "num_key_value_heads": _POSITIVE_INT,
    "intermediate_size": _POSITIVE_INT,
    "head_dim": _POSITIVE_INT,
    "tie_word_embeddings": _BOOL,
    "dtype": SpecParam(str, "one of " + ", ".join(DTYPES)),
    "max_position_embeddings": _POSITIVE_INT,
    "rope_theta": _FLOAT,
    "rms_norm_eps": _FLOAT,
    "max_shard_size": SpecParam(str, "a size such as 100KB, 5MB or 1GiB"),
    "num_experts": _POSITIVE_INT,
    "num_experts_per_tok": _POSITIVE_INT,
    "moe_intermediate_size": _POSITIVE_INT,
    "first_k_dense_replace": SpecParam(int, "a non-negative integer"),
    "q_lora_rank": SpecParam(int, "a non-negative integer (0: no query LoRA)"),
    "yarn_factor": _FLOAT,
    "attention_bias": _BOOL,
    "mlp_bias": _BOOL,
    "use_qk_norm": _BOOL,
}
"""The query keys of a `tiny:<family>?key=value&...` URI: every spec field but `family`."""

_SIZE_RE = re.compile(r"\d+(GiB|MiB|KiB|GB|MB|KB)", re.IGNORECASE)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape, dtype and seed of a tiny model; validated on construction (ValueError naming the field)."""

    family: Family = "llama"
    seed: int = 0
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    head_dim: int | None = None
    """None: hidden_size // num_attention_heads."""
    tie_word_embeddings: bool = False
    dtype: DType = "float32"
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_shard_size: str | None = None
    """Passed to `save_pretrained` (e.g. "100KB") to force several safetensors shards and an index."""
    num_experts: int | None = None
    """Mixture-of-experts families only (as the next two); None: the family's tiny default."""
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    first_k_dense_replace: int | None = None
    """DeepSeek-style mixtures of experts: how many first layers keep a dense MLP."""
    q_lora_rank: int | None = None
    """Multi-latent attention only (as the next): the query's LoRA rank; 0: none, a full q_proj (Moonlight)."""
    yarn_factor: float | None = None
    """YaRN RoPE scaling by this factor (None: plain RoPE); the original context is max_position_embeddings / it."""
    attention_bias: bool | None = None
    """The family's switches (FamilySpec.switches), as its config class names them (this one and the next two);
    None: the family's tiny default. Only families whose config has the field take one."""
    mlp_bias: bool | None = None
    use_qk_norm: bool | None = None

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def info(self) -> FamilySpec:
        return FAMILIES[self.family]

    @property
    def family_fields(self) -> dict[str, Any]:
        """The family-specific config fields (experts): the spec's values where given, else the family's defaults."""
        return {name: default if getattr(self, name, None) is None else getattr(self, name)
                for name, default in self.info.tiny_defaults.items()}

    @property
    def switches(self) -> dict[str, bool]:
        """The switch fields this spec sets (the rest keep the family's tiny defaults)."""
        return {name: getattr(self, name) for name in _SWITCH_FIELDS if getattr(self, name) is not None}

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @classmethod
    def from_uri(cls, uri: str) -> TinyModelSpec:
        """Parse ``tiny:<family>[?key=value&...]`` (keys: `SPEC_PARAMS`); ValueError names the bad part."""
        if not uri.startswith(URI_PREFIX):
            raise ValueError(
                f"tiny model spec {uri!r} must start with {URI_PREFIX!r}, e.g. 'tiny:qwen3?seed=1'"
            )
        family, _, query = uri[len(URI_PREFIX) :].partition("?")
        values: dict[str, Any] = {"family": family}
        for pair in query.split("&") if query else []:
            key, value = _parse_pair(uri, pair)
            if key in values:
                raise ValueError(f"tiny model spec {uri!r}: {key!r} is given more than once")
            values[key] = value
        try:
            return cls(**values)
        except ValueError as err:
            raise ValueError(f"tiny model spec {uri!r}: {err}") from err

    def to_uri(self) -> str:
        """The URI that `from_uri` turns back into this spec; only fields that differ from the defaults."""
        defaults = TinyModelSpec()
        query = [
            f"{f.name}={_format_value(getattr(self, f.name))}"
            for f in fields(self)
            if f.name != "family" and getattr(self, f.name) != getattr(defaults, f.name)
        ]
        return URI_PREFIX + self.family + ("?" + "&".join(query) if query else "")


def is_tiny_uri(checkpoint: str) -> bool:
    """True when a checkpoint spec names a generated tiny model rather than a directory or URI."""
    return checkpoint.startswith(URI_PREFIX)


def _parse_pair(uri: str, pair: str) -> tuple[str, Any]:
    key, sep, text = pair.partition("=")
    param = SPEC_PARAMS.get(key)
    if param is None:
        raise ValueError(
            f"tiny model spec {uri!r}: unknown key {key!r}; allowed keys: {', '.join(SPEC_PARAMS)}"
        )
    if not sep:
        raise ValueError(f"tiny model spec {uri!r}: {key!r} has no value; write {key}=<{param.allowed}>")
    try:
        return key, param.parse(text)
    except ValueError:
        raise ValueError(
            f"tiny model spec {uri!r}: bad value {text!r} for {key!r}; expected {param.allowed}"
        ) from None


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


def _validate(spec: TinyModelSpec) -> None:
    """Raise ValueError, naming the field, its value and what is allowed, for the first problem found."""
    if spec.family not in FAMILIES:
        raise ValueError(f"unknown family {spec.family!r}; allowed: {', '.join(FAMILIES)}")
    if not _is_int(spec.seed) or not 0 <= spec.seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {spec.seed!r}")
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "max_position_embeddings"):  # fmt: skip
        _require_positive_int(name, getattr(spec, name))
    if spec.head_dim is not None:
        _require_positive_int("head_dim", spec.head_dim)
    _validate_attention(spec)
    _validate_experts(spec)
    _validate_switches(spec)
    for name in ("rope_theta", "rms_norm_eps"):
        _require_positive_number(name, getattr(spec, name))
    if not isinstance(spec.tie_word_embeddings, bool):
        raise ValueError(f"tie_word_embeddings must be true or false, got {spec.tie_word_embeddings!r}")
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    if spec.max_shard_size is not None and not _SIZE_RE.fullmatch(str(spec.max_shard_size)):
        raise ValueError(
            f"max_shard_size must be a size such as 100KB, 5MB or 1GiB, got {spec.max_shard_size!r}"
        )


def _validate_experts(spec: TinyModelSpec) -> None:
    for name in _FAMILY_FIELDS:
        if getattr(spec, name) is not None and name not in spec.info.tiny_defaults:
            raise ValueError(f"{spec.family} has no {name} setting; families with one: "
                             + ", ".join(family for family, info in FAMILIES.items() if name in info.tiny_defaults))
    given = [name for name in _EXPERT_FIELDS if getattr(spec, name) is not None]
    for name in given:
        _require_positive_int(name, getattr(spec, name))
    for name in ("first_k_dense_replace", "q_lora_rank"):
        if getattr(spec, name) is not None and (not _is_int(getattr(spec, name)) or getattr(spec, name) < 0):
            raise ValueError(f"{name} must be a non-negative integer, got {getattr(spec, name)!r}")
    if spec.yarn_factor is not None:
        _require_positive_number("yarn_factor", spec.yarn_factor)
    if spec.info.has_experts:
        fields_ = spec.family_fields
        if fields_["num_experts_per_tok"] > fields_["num_experts"]:
            raise ValueError(f"num_experts_per_tok ({fields_['num_experts_per_tok']}) must not exceed num_experts "
                             f"({fields_['num_experts']})")


_SWITCH_FIELDS = ("attention_bias", "mlp_bias", "use_qk_norm")


def _validate_switches(spec: TinyModelSpec) -> None:
    for name in _SWITCH_FIELDS:
        value = getattr(spec, name)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        if name not in {switch.field for switch in spec.info.switches}:
            raise ValueError(f"{spec.family} has no {name} setting; families with one: " + ", ".join(
                family for family, info in FAMILIES.items() if name in {s.field for s in info.switches}))


_EXPERT_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_FAMILY_FIELDS = (*_EXPERT_FIELDS, "first_k_dense_replace", "q_lora_rank", "yarn_factor")
"""Spec fields that only families naming them in their spec's tiny_defaults have."""


def _validate_attention(spec: TinyModelSpec) -> None:
    heads, kv_heads = spec.num_attention_heads, spec.num_key_value_heads
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv_heads})"
        )
    if spec.head_dim is None and spec.hidden_size % heads:
        raise ValueError(
            f"hidden_size ({spec.hidden_size}) must be divisible by num_attention_heads ({heads}) "
            "unless head_dim is given"
        )
    if (
        spec.head_dim is not None
        and not spec.info.configurable_head_dim
        and spec.head_dim != spec.hidden_size // heads
    ):
        raise ValueError(
            f"{spec.family} has no head_dim setting: head_dim must be unset or hidden_size // num_attention_heads "
            f"({spec.hidden_size // heads}), got {spec.head_dim}; families with a free head_dim: "
            + ", ".join(name for name, info in FAMILIES.items() if info.configurable_head_dim)
        )
    factor = spec.info.rope_overrides.get("partial_rotary_factor", 1.0)
    if factor == 1.0 and spec.resolved_head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {spec.resolved_head_dim}")
    if (spec.resolved_head_dim * factor) % 2:
        raise ValueError(f"{spec.family} rotates head_dim x {factor:g} dimensions, which must be even for rotary "
                         f"embeddings: head_dim must be a multiple of {2 / factor:g}, got {spec.resolved_head_dim}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_positive_int(name: str, value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _require_positive_number(name: str, value: Any) -> None:
    if not (_is_int(value) or isinstance(value, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


# --------------------------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------------------------


def build_tiny_tokenizer(family: str, *, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer for `family`: ids 0..255 are UTF-8 bytes, then `FAMILIES[family].special_tokens`.

    `len(tokenizer)` is 256 + the number of special tokens (Qwen: 259, Llama 3: 261). Encoding text without
    special tokens gives exactly its UTF-8 bytes (after NFC normalization where the family normalizes), so
    `decode(encode(text)) == text` for any (NFC) text. Padding is on the left, for batched generation.
    """
    # Here and in the functions below: the driver imports this module (checkpoint.hf_source) and stays free of torch.
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(FAMILIES)}")
    info = FAMILIES[family].tokenizer
    byte_to_char = bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(NUM_BYTE_TOKENS)}, merges=[]))
    backend.normalizer = normalizers.NFC() if info.nfc_normalize else None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in info.special_tokens])
    optional = {} if model_max_length is None else {"model_max_length": model_max_length}
    named = {info.bos_token, info.eos_token, info.pad_token}
    # add_bos_token and padding_side must be constructor arguments: transformers 5 rebuilds the post-processor
    # from add_bos_token, and only constructor arguments are saved with the tokenizer.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=info.bos_token,
        eos_token=info.eos_token,
        pad_token=info.pad_token,
        extra_special_tokens=[token for token in info.special_tokens if token not in named],
        add_bos_token=info.add_bos_token,
        chat_template=info.chat_template,
        padding_side="left",
        **optional,
    )


def build_tiny_model(
    path: str | Path, spec: TinyModelSpec = TinyModelSpec(), *, overwrite: bool = False
) -> Path:
    """Write the HF directory of `spec` (config, safetensors, generation config, tokenizer) to `path`.

    The same spec gives byte-identical safetensors. The directory is written next to `path` and renamed into
    place, so `path` never holds a half-written model. An existing non-empty `path` is an error unless
    `overwrite`, which replaces it. Returns `path`.
    """
    target = Path(path)
    _check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _write_model_dir(staging, spec)
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _check_target(target: Path, overwrite: bool) -> None:
    if overwrite or not target.exists() or (target.is_dir() and not any(target.iterdir())):
        return
    raise FileExistsError(f"{target} already exists and is not empty; pass overwrite=True to replace it")


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`, first moving any existing `target` aside and deleting it afterwards."""
    old = None
    if target.exists() or target.is_symlink():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        target.rename(old)
    staging.rename(target)
    if old is None:
        return
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def _write_model_dir(directory: Path, spec: TinyModelSpec) -> None:
    tokenizer = build_tiny_tokenizer(spec.family, model_max_length=spec.max_position_embeddings)
    model = _init_model(spec, tokenizer)
    shard_kwargs = {} if spec.max_shard_size is None else {"max_shard_size": spec.max_shard_size}
    model.save_pretrained(directory, **shard_kwargs)
    tokenizer.save_pretrained(directory)


def _model_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast):
    """The transformers config of `spec`; the vocabulary is the tokenizer's, special tokens included."""
    from transformers import AutoConfig

    info = spec.info
    head_dim = {"head_dim": spec.resolved_head_dim} if info.configurable_head_dim else {}
    family = spec.family_fields
    rope = {"rope_type": "default", "rope_theta": float(spec.rope_theta), **info.rope_overrides}
    if family.pop("yarn_factor", None):
        rope.update(rope_type="yarn", factor=float(spec.yarn_factor), mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0,
                    beta_slow=1.0, original_max_position_embeddings=int(spec.max_position_embeddings / spec.yarn_factor))
    if family.get("q_lora_rank") == 0:
        family["q_lora_rank"] = None
    # MLA keys and values come per query head, so its config says as many KV heads as query heads.
    kv_heads = spec.num_attention_heads if info.multi_latent_attention else spec.num_key_value_heads
    return AutoConfig.for_model(
        info.model_type,
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        # transformers 5 keeps RoPE settings in one dict; there is no `rope_theta` field any more.
        rope_parameters=rope,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **head_dim,
        **{info.config_names.get(name, name): value for name, value in family.items()},
        **{**info.config_overrides, **spec.switches},
    )


def _init_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A randomly initialised model from `spec.seed`, in `spec.dtype`, with its generation config set.

    Weights are drawn in float32 and then cast, so a bf16 model is the rounded fp32 model of the same seed.
    The caller's global torch RNG state is left untouched.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _model_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_constant_params(model, spec.seed)
    model.to(getattr(torch, spec.dtype))
    # What transformers keeps in fp32 whatever the dtype (DeepSeek's e_score_correction_bias), real checkpoints
    # store in fp32 too.
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if any(part in name for part in getattr(model, "_keep_in_fp32_modules_strict", None) or ()):
            tensor.data = tensor.data.float()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=list(tokenizer.convert_tokens_to_ids(list(spec.info.tokenizer.stop_tokens))),
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def _perturb_constant_params(model: PreTrainedModel, seed: int) -> None:
    """Add small seeded noise to every saved tensor initialised to a constant (norm weights 1, biases 0).

    With constant tensors, a converter that swaps two norms or drops a bias would still give the same
    logits; with every tensor distinct, such a mistake shows.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    saved = model.state_dict()  # parameters and persistent buffers (DeepSeek's expert-score correction bias)
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if name not in saved or not param.is_floating_point():
                continue
            if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * _PERTURB_STD)
