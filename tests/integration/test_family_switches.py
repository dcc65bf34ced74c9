"""Family switches read from the HF config: each switch of each family, both values, through the converter.

A switch (FamilySpec.switches: attention_bias, mlp_bias, use_qk_norm; and tie_word_embeddings for every family)
decides which tensors a model has. Each value a family converts goes HF -> torch_dist -> HF bit for bit, with the
switch's tensors and Megatron flags present exactly when it is on; each value it cannot convert is refused before
any write, naming the switch and the value. The conversions run the converter's rank function in this process
(no worker process to start: ~0.2 s a model), each distinct tiny model once per module.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slimeflow.checkpoint.convert import assign_shares, read_hf_source
from slimeflow.checkpoint.hf_write import write_hf
from slimeflow.checkpoint.mapping import ModelShape
from slimeflow.checkpoint.torch_dist import read_common, tensor_metadata
from slimeflow.checkpoint.worker import Job, convert_share
from slimeflow.errors import StageInputError
from slimeflow.families import FAMILIES, FLAGS, FamilySpec, Switch
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

TIE = Switch("tie_word_embeddings", False, ())
"""Every family's: the output layer is the embedding (no lm_head.weight, no output_layer.weight)."""


def switches(spec: FamilySpec) -> tuple[Switch, ...]:
    return (*spec.switches, TIE)


def tiny_default(spec: FamilySpec, switch: Switch) -> bool:
    return bool(spec.config_overrides.get(switch.field, switch.default))


def tiny_spec(family: str, field: str, value: bool) -> TinyModelSpec:
    """A small tiny model of `family` with switch `field` at `value`, and the switches that share a Megatron flag
    with it at the same value (Llama's attention_bias and mlp_bias); the others at their tiny defaults. Fields at
    their default are left unset, so that equal models are equal specs (built and converted once)."""
    spec = FAMILIES[family]
    switch = next(s for s in switches(spec) if s.field == field)
    partners = [s for s in spec.switches if set(s.flags) & set(switch.flags) and value not in s.refused]
    chosen = {s.field: value for s in (switch, *partners) if value != tiny_default(spec, s)}
    layers = 2 if spec.has_experts else 1  # an MoE family's first layer is dense: one of each kind
    return TinyModelSpec(family=family, seed=11, num_hidden_layers=layers, **chosen)


CASES = [(family, switch.field, value) for family, spec in FAMILIES.items() for switch in switches(spec)
         for value in (False, True)]
CONVERTED = [case for case in CASES
             if case[2] not in next(s for s in switches(FAMILIES[case[0]]) if s.field == case[1]).refused]
REFUSED = [case for case in CASES if case not in CONVERTED]


def case_id(case: tuple[str, str, bool]) -> str:
    return f"{case[0]}-{case[1]}-{str(case[2]).lower()}"


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {name: t for file in sorted(directory.glob("*.safetensors")) for name, t in load_file(file).items()}


def convert_in_process(hf: Path, release: Path) -> None:
    """HF -> torch_dist as the convert stage's one rank writes it (worker.convert_share), in this process."""
    source = read_hf_source(hf)
    convert_share(Job(hf_dir=str(hf), weight_map=source.weight_map, shape=source.shape.__dict__, dtype=source.dtype,
                      make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, checkpoint_dir=str(release),
                      iteration=1, init_method="", shares=assign_shares(source, 1)), 0)


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """`get(spec)`: {"hf", "release", "back"}: the tiny model, its torch_dist and the HF written back from it."""
    done: dict[TinyModelSpec, dict[str, Path]] = {}

    def get(spec: TinyModelSpec) -> dict[str, Path]:
        if spec not in done:
            tmp = tmp_path_factory.mktemp("switch")
            hf = build_tiny_model(tmp / "hf", spec)
            convert_in_process(hf, tmp / "release")
            write_hf(tmp / "release", tmp / "back", hf)
            done[spec] = {"hf": hf, "release": tmp / "release", "back": tmp / "back"}
        return done[spec]

    return get


# --------------------------------------------------------------------------------------------------------------
# Each switch, both values: converted exactly, or refused by name
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CONVERTED, ids=case_id)
def test_each_switch_value_round_trips_bit_exactly_with_its_tensors_present_exactly_when_on(round_trip, case):
    family, field, value = case
    spec = FAMILIES[family]
    item = round_trip(tiny_spec(*case))
    config = json.loads((item["hf"] / "config.json").read_text())
    assert config[field] == value  # the factory built the switch's value
    original, back = hf_tensors(item["hf"]), hf_tensors(item["back"])
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    args = read_common(item["release"])["args"]
    assert {flag: getattr(args, flag) for flag in FLAGS} == spec.flags(config)
    keys = set(tensor_metadata(item["release"]))
    switch = next(s for s in switches(spec) if s.field == field)
    for rule in spec.layer_rules:
        if rule.when in switch.flags:
            assert any(key.endswith("." + rule.megatron) for key in keys) == value, rule.megatron
            assert any(name.endswith("." + rule.hf[0]) for name in original) == value, rule.hf[0]
    if switch is TIE:
        assert ("output_layer.weight" in keys) == ("lm_head.weight" in original) == (not value)


@pytest.mark.parametrize("case", REFUSED, ids=case_id)
def test_a_switch_value_a_family_cannot_convert_is_refused_by_name_before_any_write(tmp_path, case):
    family, field, value = case
    hf = build_tiny_model(tmp_path / "hf", tiny_spec(*case))
    with pytest.raises(StageInputError, match=f"{field} is {value}: ") as err:
        read_hf_source(hf)
    assert "missing tensor" not in str(err.value)


def test_llamas_attention_and_mlp_biases_must_agree_as_megatrons_one_flag_builds_both(tmp_path):
    hf = build_tiny_model(tmp_path / "hf", TinyModelSpec(num_hidden_layers=1, attention_bias=True))
    with pytest.raises(StageInputError, match="attention_bias True with mlp_bias False: Megatron's add_bias_linear"):
        read_hf_source(hf)


def test_glm4_moe_with_attention_bias_left_out_converts_without_biases_as_transformers_builds_it(round_trip,
                                                                                                  tmp_path):
    """The issue's case: transformers' Glm4MoeConfig defaults attention_bias to false."""
    item = round_trip(tiny_spec("glm4_moe", "attention_bias", False))
    hf = Path(shutil.copytree(item["hf"], tmp_path / "hf"))
    config = json.loads((hf / "config.json").read_text())
    del config["attention_bias"], config["use_qk_norm"]
    (hf / "config.json").write_text(json.dumps(config))
    shape = read_hf_source(hf).shape
    assert (shape.add_qkv_bias, shape.qk_layernorm) == (False, False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_switchs_default_is_its_transformers_config_classs(family):
    from transformers import AutoConfig

    spec = FAMILIES[family]
    config = AutoConfig.for_model(spec.model_type)
    for switch in spec.switches:
        assert getattr(config, switch.field) == switch.default, switch.field
    assert not {s.field for s in spec.switches} & set(spec.refused_config)


def test_the_export_refuses_an_origin_config_whose_switches_do_not_describe_the_checkpoint(round_trip, tmp_path):
    item = round_trip(tiny_spec("glm4_moe", "use_qk_norm", True))
    origin = Path(shutil.copytree(item["hf"], tmp_path / "origin"))
    config = json.loads((origin / "config.json").read_text())
    (origin / "config.json").write_text(json.dumps({**config, "use_qk_norm": False}))
    with pytest.raises(StageInputError, match=r"the checkpoint's qk_layernorm is True, but the origin config.json "
                                              r"\(use_qk_norm False\) means False"):
        write_hf(item["release"], tmp_path / "back", origin)
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize(("family", "change", "named"), [
    ("qwen3", {"add_bias_linear": True}, "add_qkv_bias True, add_bias_linear True"),  # Megatron-LM's default
    ("qwen2", {"add_qkv_bias": False}, "add_qkv_bias False"),
])
def test_checkpoint_args_with_flags_the_family_has_no_tensors_for_are_refused(round_trip, family, change, named):
    item = round_trip(tiny_spec(family, "tie_word_embeddings", False))
    args = argparse.Namespace(**{**vars(read_common(item["release"])["args"]), **change})
    with pytest.raises(ValueError, match=f"common.pt: the checkpoint's Megatron args say {named}, which no {family} "):
        ModelShape.from_megatron_args(args, FAMILIES[family], 263)


def test_tiny_specs_take_only_the_switches_their_familys_config_has():
    assert TinyModelSpec.from_uri("tiny:glm4_moe?use_qk_norm=true&attention_bias=false").switches == {
        "use_qk_norm": True, "attention_bias": False}
    with pytest.raises(ValueError, match="qwen2 has no attention_bias setting; families with one: llama, qwen3"):
        TinyModelSpec(family="qwen2", attention_bias=True)
    with pytest.raises(ValueError, match="bad value 'yes' for 'mlp_bias'; expected true or false"):
        TinyModelSpec.from_uri("tiny:llama?mlp_bias=yes")


# --------------------------------------------------------------------------------------------------------------
# What reads the flags: megatron-core's model from the checkpoint's args, the engine's native forward
# --------------------------------------------------------------------------------------------------------------

SWITCHED_MODELS = {
    "llama-biases": ("llama", "attention_bias", True),
    "glm4-no-bias": ("glm4", "attention_bias", False),
    "glm4_moe-no-bias": ("glm4_moe", "attention_bias", False),
    "glm4_moe-qk-norm": ("glm4_moe", "use_qk_norm", True),
}
"""The switch values that change the Megatron model away from each family's tiny default."""


@pytest.mark.slow
@pytest.mark.parametrize("case", SWITCHED_MODELS)
def test_megatron_cores_model_of_the_args_loads_the_switched_checkpoint_and_matches_hf(round_trip, megatron_world,
                                                                                       case):
    from megatron_helpers import declared_shapes, load_and_compare_logits

    from slimeflow.families.megatron import gpt_model_from_args

    item = round_trip(tiny_spec(*SWITCHED_MODELS[case]))
    model = gpt_model_from_args(read_common(item["release"])["args"]).eval()
    assert {key: shape for key, (shape, _) in tensor_metadata(item["release"]).items()} == declared_shapes(model)
    assert load_and_compare_logits(model, item["release"], item["hf"]) <= 1e-4


def test_the_engines_native_forward_computes_llamas_biases(round_trip):
    from transformers import AutoModelForCausalLM

    from slimeflow.engine import kv_batch
    from slimeflow.engine.native import NativeForward, select_forward

    model = AutoModelForCausalLM.from_pretrained(round_trip(tiny_spec("llama", "attention_bias", True))["back"],
                                                 dtype=torch.float32).eval()
    assert model.model.layers[0].mlp.down_proj.bias is not None
    forward = select_forward(model)
    assert isinstance(forward, NativeForward)
    prompts = [[72, 101, 108, 108, 111], [50, 43]]
    with torch.inference_mode():
        _, logits = kv_batch.prefill(forward, prompts, torch.device("cpu"))
        expected = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert (logits - expected).abs().max() <= 1e-4
