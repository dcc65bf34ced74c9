"""Checkpoints both ways with slime and Megatron-LM: what their readers take from common.pt's `args` is there, and
a checkpoint whose args are spelled as current Megatron-LM writes them converts back bit-exactly."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slimeflow.checkpoint.mapping import ModelShape
from slimeflow.checkpoint.torch_dist import read_common
from slimeflow.config.convert import ConvertConfig
from slimeflow.families import FAMILIES
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.stages.convert.stage import run


def context(tmp: Path) -> StageContext:
    return StageContext(Storage(), tmp / "work", str(tmp / "work"))


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {name: t for file in sorted(directory.glob("*.safetensors")) for name, t in load_file(file).items()}

# What slime's tools/convert_torch_dist_to_hf.py and megatron_to_hf/{llama,qwen2}.py read from `args`
# (THUDM/slime 624b824a8): the shape of attention, the layer count, the true vocabulary and q_lora_rank.
SLIME_READS = ("hidden_size", "kv_channels", "num_attention_heads", "num_query_groups", "num_layers", "vocab_size",
               "q_lora_rank")


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("interop")
    hf = build_tiny_model(tmp / "hf", TinyModelSpec.from_uri("tiny:qwen3?dtype=bfloat16&seed=8"))
    run(ConvertConfig(hf_checkpoint=str(hf), save=str(tmp / "ckpt")), context(tmp))
    return hf, tmp / "ckpt" / "release"


def test_our_args_carry_what_slimes_converter_reads(release):
    args = read_common(release[1])["args"]
    missing = [name for name in SLIME_READS if not hasattr(args, name)]
    assert missing == []
    assert args.q_lora_rank is None and args.layernorm_epsilon == args.norm_epsilon


def as_megatron_lm_writes_it(args: argparse.Namespace) -> argparse.Namespace:
    """Megatron-LM (2026) spells --norm-epsilon layernorm_epsilon and knows nothing of slimeflow's extras."""
    fields = {k: v for k, v in vars(args).items() if k not in ("norm_epsilon", "model_family")}
    return argparse.Namespace(**fields, use_dist_ckpt=True, data_parallel_size=8, seq_length=4096)


def test_a_checkpoint_with_megatron_lms_newer_args_converts_back_bit_exactly(release, tmp_path):
    hf, directory = release
    copy = tmp_path / "release"
    copy.mkdir()
    for path in directory.iterdir():  # the data files and common.pt; Megatron-LM writes no side folder of ours
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    common = torch.load(copy / "common.pt", weights_only=False)  # our own file, just written
    common["args"] = as_megatron_lm_writes_it(common["args"])
    torch.save(common, copy / "common.pt")
    run(ConvertConfig(direction="torch-dist-to-hf", input_dir=str(copy), output_dir=str(tmp_path / "back"),
                      origin_hf_dir=str(hf)), context(tmp_path))
    original, back = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())


def test_missing_args_are_named_with_the_file():
    args = argparse.Namespace(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                              padded_vocab_size=256, max_position_embeddings=512)
    with pytest.raises(ValueError) as err:
        ModelShape.from_megatron_args(args, FAMILIES["qwen3"], 200, source="/ckpt/iter_0000003/common.pt")
    assert str(err.value).startswith("/ckpt/iter_0000003/common.pt: the checkpoint's Megatron args lack "
                                     "norm_epsilon or layernorm_epsilon, rotary_base;")


def test_common_pt_is_a_valid_zip_with_crcs(release):
    """The data files skip torch.save's CRC32 for speed; common.pt, which users' tools open as a zip, keeps them."""
    import zipfile

    with zipfile.ZipFile(release[1] / "common.pt") as archive:
        assert archive.testzip() is None
    assert read_common(release[1])["iteration"] == 1


def test_a_converted_release_carries_checksums_that_its_readers_verify(release, tmp_path):
    """convert writes the release's sha256 once (also the manifest's records); a flipped byte is then refused."""
    from slimeflow.checkpoint.hf_write import write_hf
    from slimeflow.errors import CheckpointError

    hf, directory = release
    assert (directory / "slimeflow" / "checksums.json").is_file()
    copy = tmp_path / "release"
    shutil.copytree(directory, copy)
    data = max(copy.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=data.name):
        write_hf(copy, tmp_path / "hf-out", hf)


def test_an_export_removes_the_staging_a_killed_export_left_beside_its_output(release, tmp_path):
    from slimeflow.checkpoint.hf_write import write_hf

    hf, directory = release
    left, foreign = tmp_path / ".back.tmp-0123abcd", tmp_path / ".back.tmp-keepme"
    for path in (left, foreign):
        (path / "model-00001-of-00002.safetensors").parent.mkdir(parents=True)
    write_hf(directory, tmp_path / "back", hf)
    assert not left.exists() and foreign.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".back.tmp-keepme", "back"]


def model_args_for(hf: Path) -> list[str]:
    """slime's MODEL_ARGS for this model, as scripts/models/qwen3-*.sh spell them."""
    import json

    config = json.loads((hf / "config.json").read_text())
    return ["--swiglu", "--num-layers", str(config["num_hidden_layers"]), "--hidden-size", str(config["hidden_size"]),
            "--ffn-hidden-size", str(config["intermediate_size"]), "--num-attention-heads",
            str(config["num_attention_heads"]), "--group-query-attention", "--num-query-groups",
            str(config["num_key_value_heads"]), "--use-rotary-position-embeddings", "--disable-bias-linear",
            "--normalization", "RMSNorm", "--norm-epsilon", str(config["rms_norm_eps"]), "--rotary-base",
            str(config["rope_theta"] if "rope_theta" in config else config["rope_parameters"]["rope_theta"]),
            "--vocab-size", str(config["vocab_size"]), "--kv-channels", str(config["head_dim"]), "--qk-layernorm",
            *([] if config.get("tie_word_embeddings") else ["--untie-embeddings-and-output-weights"])]


def test_the_converter_takes_slimes_model_args_and_checks_them_against_the_model(release, tmp_path):
    from slimeflow.config.pipeline import load_stage_config
    from slimeflow.errors import StageInputError

    hf, _ = release
    args = model_args_for(hf)
    config = load_stage_config("convert", None, ["--hf-checkpoint", str(hf), "--save", str(tmp_path / "ok"), *args])
    manifest = run(config, context(tmp_path))
    assert (tmp_path / "ok" / "release").is_dir() and manifest.counts["tensors"] > 0

    wrong = [*args[:2], "99", *args[3:], "--seq-length", "100000", "--pipeline-model-parallel-size", "2"]
    assert wrong[2] == "99" and args[1] == "--num-layers"
    config = load_stage_config("convert", None, ["--hf-checkpoint", str(hf), "--save", str(tmp_path / "bad"), *wrong])
    with pytest.raises(StageInputError) as err:
        run(config, context(tmp_path))
    text = str(err.value)
    assert "--num-layers 99 does not match the HF config (num_hidden_layers:" in text
    assert "--seq-length 100000 is longer than the HF config's max_position_embeddings" in text
    assert "--pipeline-model-parallel-size 2: the converter writes one torch_dist checkpoint" in text
    assert not (tmp_path / "bad").exists()  # refused before any work
