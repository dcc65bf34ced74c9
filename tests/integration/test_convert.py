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
from megatron_helpers import declared_shapes, load_and_compare_logits
from safetensors.torch import load_file, save_file

from slimeflow.checkpoint.torch_dist import load_torch_dist, read_common, tensor_metadata
from slimeflow.config.convert import ConvertConfig
from slimeflow.errors import StageInputError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.stages.convert.stage import run

CASES = {
    "llama-bf16-gqa-1p": ("tiny:llama?dtype=bfloat16&num_hidden_layers=3&seed=1", 1),
    "qwen2-fp16-tied-1p": ("tiny:qwen2?dtype=float16&tie_word_embeddings=true&seed=2", 1),
    "qwen3-fp32-mqa-headdim-1p": ("tiny:qwen3?head_dim=24&num_key_value_heads=1&seed=3", 1),
    "llama-fp32-tied-mha-2p": ("tiny:llama?tie_word_embeddings=true&num_attention_heads=8&num_key_value_heads=8"
                               "&head_dim=8&seed=4", 2),
    "qwen2-bf16-gqa-2p": ("tiny:qwen2?dtype=bfloat16&num_hidden_layers=3&max_shard_size=100KB&seed=5", 2),
    "qwen3-fp16-tied-2p": ("tiny:qwen3?dtype=float16&tie_word_embeddings=true&hidden_size=96"
                           "&num_attention_heads=6&num_key_value_heads=2&seed=6", 2),
}


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


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_gpt_model_loads_the_checkpoint_and_its_logits_equal_hf(converted, megatron_world, case):
    from slimeflow.families.megatron import gpt_model_from_args

    item = converted[case]
    release = item["root"] / "release"
    model = gpt_model_from_args(read_common(release)["args"]).eval()
    # .metadata holds exactly what GPTModel declares: same keys, same global shapes.
    stored = {key: shape for key, (shape, _) in tensor_metadata(release).items()}
    assert stored == declared_shapes(model)
    assert load_and_compare_logits(model, release, item["hf"]) <= 1e-4


# --------------------------------------------------------------------------------------------------------------
# The mapping itself (no processes): QKV grouped by KV group, fc1 = [gate; up], padding, inverse
# --------------------------------------------------------------------------------------------------------------


def _shape(uri: str):
    from slimeflow.checkpoint.mapping import ModelShape
    from slimeflow.families import FAMILIES

    spec = TinyModelSpec.from_uri(uri)
    config = {"num_hidden_layers": spec.num_hidden_layers, "hidden_size": spec.hidden_size,
              "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_attention_heads,
              "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.resolved_head_dim, "vocab_size": 259,
              "tie_word_embeddings": spec.tie_word_embeddings}
    return ModelShape.from_hf_config(config, FAMILIES[spec.family])


def test_qkv_is_grouped_by_kv_group_and_fc1_is_gate_then_up():
    from slimeflow.checkpoint.mapping import hf_to_megatron

    shape = _shape("tiny:qwen2?num_hidden_layers=1&hidden_size=8&num_attention_heads=4&num_key_value_heads=2")
    head_dim = 2
    hf = {}
    for name, heads, tag in (("q", 4, 100), ("k", 2, 200), ("v", 2, 300)):
        # every row says which projection and head it came from: tag + head
        rows = torch.arange(heads).repeat_interleave(head_dim).float() + tag
        hf[f"model.layers.0.self_attn.{name}_proj.weight"] = rows[:, None].expand(-1, 8).clone()
        hf[f"model.layers.0.self_attn.{name}_proj.bias"] = rows.clone()
    hf["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(shape.ffn_hidden_size, 8)
    hf["model.layers.0.mlp.up_proj.weight"] = torch.ones(shape.ffn_hidden_size, 8)
    rules = ["self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight"]
    mega = hf_to_megatron(hf, shape, layers=[0], globals_=(), rules=rules)
    # the converter's form: the same tensors as the HF row blocks that torch_dist writes unassembled
    blocks = hf_to_megatron(hf, shape, layers=[0], globals_=(), rules=rules, row_blocks=True)
    assert [len(blocks[f"decoder.layers.0.{rule}"].parts) for rule in rules] == [6, 6, 2]  # per group q, k, v; gate, up
    for name, fused in mega.items():
        assert blocks[name].shape == fused.shape and torch.equal(torch.cat(blocks[name].parts), fused), name
    heads_in_order = mega["decoder.layers.0.self_attention.linear_qkv.bias"][::head_dim].tolist()
    assert heads_in_order == [100, 101, 200, 300, 102, 103, 201, 301]  # group 0: q0 q1 k0 v0; group 1: q2 q3 k1 v1
    assert torch.equal(mega["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0],
                       mega["decoder.layers.0.self_attention.linear_qkv.bias"])
    fc1 = mega["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.shape == (2 * shape.ffn_hidden_size, 8) and not fc1[: shape.ffn_hidden_size].any()
    assert fc1[shape.ffn_hidden_size:].eq(1).all()


@pytest.mark.parametrize("uri", ["tiny:llama?num_key_value_heads=1", "tiny:qwen2", "tiny:qwen3?head_dim=24",
                                 "tiny:llama?tie_word_embeddings=true"])
def test_megatron_to_hf_inverts_hf_to_megatron_and_pads_with_zero_rows(uri):
    from slimeflow.checkpoint.mapping import expected_hf_tensors, hf_to_megatron, megatron_to_hf

    shape = _shape(uri)
    generator = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(size, generator=generator) for name, size in expected_hf_tensors(shape).items()}
    mega = hf_to_megatron(hf, shape)
    assert mega["embedding.word_embeddings.weight"].shape[0] == shape.padded_vocab_size == 384
    assert not mega["embedding.word_embeddings.weight"][259:].any()
    assert ("output_layer.weight" in mega) == (not shape.tie_word_embeddings)
    back = megatron_to_hf(mega, shape)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)


def test_vocab_padding_follows_megatron():
    from slimeflow.checkpoint.mapping import padded_vocab_size

    assert padded_vocab_size(259, 128) == 384
    assert padded_vocab_size(256, 128) == 256
    assert padded_vocab_size(151936, 128, 8) == 152576
    assert padded_vocab_size(100, 7, 3) == 105


def test_shares_balance_bytes_and_cover_every_layer_once(tmp_path):
    from slimeflow.checkpoint.convert import assign_shares, read_hf_source

    hf = build_tiny_model(tmp_path / "hf", TinyModelSpec.from_uri("tiny:llama?num_hidden_layers=5"))
    source = read_hf_source(hf)
    shares = assign_shares(source, 2)
    assert sorted(layer for share in shares for layer in share.layers) == list(range(5))
    assert sorted(g for share in shares for g in share.globals_) == [
        "decoder.final_layernorm.weight", "embedding.word_embeddings.weight", "output_layer.weight"]
    assert all(share.layers or share.globals_ for share in shares)


@pytest.mark.parametrize("uri", ["tiny:qwen3?dtype=bfloat16&max_shard_size=100KB", "tiny:qwen2?dtype=float16"])
def test_lazy_safetensors_are_exact_views_that_own_only_their_bytes(tmp_path, uri):
    from slimeflow.checkpoint.convert import read_hf_source
    from slimeflow.checkpoint.worker import LazySafetensors

    hf = build_tiny_model(tmp_path / "hf", TinyModelSpec.from_uri(uri))
    expected = hf_tensors(hf)
    lazy = LazySafetensors(hf, read_hf_source(hf).weight_map)
    for name, tensor in expected.items():
        view = lazy[name]
        assert view.dtype == tensor.dtype and torch.equal(view, tensor), name
        # the writer copies a tensor whose storage is larger than the tensor (torch.save writes it whole): these
        # must not be
        assert view.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
        if tensor.dim() and tensor.shape[0] > 2:  # a row block (QKV's per-group rows) maps only its rows
            rows = lazy.rows(name, 1, tensor.shape[0] - 1)
            assert torch.equal(rows, tensor[1:-1]), name
            assert rows.untyped_storage().nbytes() == rows.numel() * rows.element_size(), name
            # where its bytes lie in the file, for the writer to copy them from there; none for a copy or a part
            path, offset = lazy.source(rows)
            with open(path, "rb") as file:
                file.seek(offset)
                assert file.read(rows.numel() * rows.element_size()) == rows.contiguous().view(torch.uint8).numpy(
                    ).tobytes(), name
            assert lazy.source(rows.clone()) is None and lazy.source(rows[1:]) is None, name
    with pytest.raises(IndexError, match="rows \\[2, 1\\)"):
        lazy.rows("model.embed_tokens.weight", 2, 1)


# --------------------------------------------------------------------------------------------------------------
# Bad inputs: a clear error before anything is written
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_hf(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("good") / "hf", TinyModelSpec.from_uri("tiny:qwen2?seed=9"))


def broken_copy(good: Path, tmp: Path) -> Path:
    copy = tmp / "broken"
    shutil.copytree(good, copy)
    return copy


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def drop_tensor(path: Path, name: str) -> None:
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def add_tensor(path: Path, name: str) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors[name] = torch.zeros(4)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def truncate(path: Path) -> None:
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])


BAD_INPUTS = {
    "unknown architecture": (lambda p: edit_config(p, architectures=["MistralForCausalLM"], model_type="mistral"),
                             "unsupported architecture ['MistralForCausalLM']"),
    "missing tensor": (lambda p: drop_tensor(p, "model.layers.1.self_attn.k_proj.bias"),
                       "1 missing tensor(s): model.layers.1.self_attn.k_proj.bias"),
    "unexpected tensor": (lambda p: add_tensor(p, "model.layers.0.self_attn.rotary_emb.inv_freq"),
                          "1 unexpected tensor(s): model.layers.0.self_attn.rotary_emb.inv_freq"),
    "truncated safetensors": (truncate, "model.safetensors is truncated"),
    "heads not divisible": (lambda p: edit_config(p, num_key_value_heads=3),
                            "num_attention_heads (4) is not divisible by num_key_value_heads (3)"),
}


@pytest.mark.parametrize("problem", BAD_INPUTS)
def test_bad_hf_input_is_refused_before_any_write(good_hf, tmp_path, problem):
    breaks, message = BAD_INPUTS[problem]
    hf = broken_copy(good_hf, tmp_path)
    breaks(hf)
    save = tmp_path / "ckpt"
    with pytest.raises(StageInputError) as err:
        run(ConvertConfig(hf_checkpoint=str(hf), save=str(save)), context(tmp_path))
    assert message in str(err.value) and str(hf) in str(err.value)
    assert not save.exists()


@pytest.mark.slow
def test_a_target_holding_a_checkpoint_is_refused_unless_overwrite(converted, tmp_path):
    item = converted["qwen3-fp32-mqa-headdim-1p"]
    before = {p: p.stat().st_mtime_ns for p in item["root"].rglob("*")}
    with pytest.raises(StageInputError, match=r"already holds a checkpoint[\s\S]*--overwrite"):
        run(ConvertConfig(hf_checkpoint=str(item["hf"]), save=str(item["root"])), context(tmp_path))
    assert {p: p.stat().st_mtime_ns for p in item["root"].rglob("*")} == before
    with pytest.raises(StageInputError, match="exists and is not empty"):
        run(ConvertConfig(direction="torch-dist-to-hf", input_dir=str(item["root"]), output_dir=str(item["back"]),
                          origin_hf_dir=str(item["hf"])), context(tmp_path))
    replaced = run(ConvertConfig(direction="torch-dist-to-hf", input_dir=str(item["root"] / "release"),
                                 output_dir=str(item["back"]), origin_hf_dir=str(item["hf"]), overwrite=True),
                   context(tmp_path))
    assert replaced.hashes["content"] == item["reverse"].hashes["content"]


@pytest.mark.slow
def test_reverse_reads_an_iteration_directory_and_a_root_whose_latest_is_one(converted, tmp_path):
    """A training backend's layout: <root>/iter_0000003/ with the tracker at 3, read by directory and by root."""
    item = converted["qwen2-bf16-gqa-2p"]
    root = tmp_path / "trained"
    shutil.copytree(item["root"] / "release", root / "iter_0000003")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    original = hf_tensors(item["hf"])
    for name, input_dir in (("by-dir", root / "iter_0000003"), ("by-root", root)):
        manifest = run(ConvertConfig(direction="torch-dist-to-hf", input_dir=str(input_dir),
                                     output_dir=str(tmp_path / name), origin_hf_dir=str(item["hf"])), context(tmp_path))
        assert manifest.facts["iteration"] == "3"
        back = hf_tensors(tmp_path / name)
        assert sorted(back) == sorted(original)
        assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in original.items())


def test_reverse_refuses_a_directory_that_is_no_checkpoint(good_hf, tmp_path):
    with pytest.raises(StageInputError, match="is not a checkpoint"):
        run(ConvertConfig(direction="torch-dist-to-hf", input_dir=str(tmp_path), output_dir=str(tmp_path / "o"),
                          origin_hf_dir=str(good_hf)), context(tmp_path))


def test_write_behind_starts_writeback_of_the_matching_files_while_they_are_written(tmp_path):
    import os
    import time

    from slimeflow.checkpoint.torch_dist import write_behind

    started: list[str] = []

    def record(fd: int) -> None:
        started.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 10
        while name not in started:
            assert time.monotonic() < deadline, f"no writeback was started for {name}: {started}"
            time.sleep(0.01)

    with write_behind(tmp_path, "__0_*.distcp", interval=0.01, start_writeback=record):
        (tmp_path / "__0_0.distcp").write_bytes(b"x" * 4096)
        (tmp_path / "__1_0.distcp").write_bytes(b"x")  # another rank's file
        (tmp_path / "common.pt").write_bytes(b"x")
        wait_for("__0_0.distcp")
        (tmp_path / "__0_1.distcp").write_bytes(b"y")  # a file that appears later is picked up too
        wait_for("__0_1.distcp")
        (tmp_path / "__0_0.distcp").unlink()  # one that vanishes is skipped
        time.sleep(0.05)
    assert set(started) == {"__0_0.distcp", "__0_1.distcp"}
    assert not [fd for fd in os.listdir("/proc/self/fd") if "distcp" in os.path.realpath(f"/proc/self/fd/{fd}")]


def test_write_behind_with_the_real_syscall_leaves_the_files_intact(tmp_path):
    from slimeflow.checkpoint.torch_dist import _start_writeback_syscall, write_behind

    call = _start_writeback_syscall()
    assert call is not None  # Linux
    (tmp_path / "__0_0.distcp").write_bytes(b"z" * 65536)
    with (tmp_path / "__0_0.distcp").open("rb") as file:
        assert call(file.fileno()) == 0
    with write_behind(tmp_path, "*.distcp", interval=0.001):
        (tmp_path / "__0_1.distcp").write_bytes(b"w" * 65536)
    assert (tmp_path / "__0_0.distcp").read_bytes() == b"z" * 65536
    assert (tmp_path / "__0_1.distcp").read_bytes() == b"w" * 65536


@pytest.mark.slow
def test_a_failed_rank_leaves_no_checkpoint(good_hf, tmp_path):
    from dataclasses import replace

    from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, read_hf_source

    source = read_hf_source(good_hf)
    hf = broken_copy(good_hf, tmp_path)
    broken = replace(source, path=hf)
    (hf / "model.safetensors").unlink()  # validated, then gone: the rank that reads it fails mid-conversion
    with pytest.raises(RuntimeError, match="conversion rank . exited"):
        convert_hf_to_torch_dist(broken, tmp_path / "ckpt", processes=2)
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_cli_takes_the_direction_as_a_positional_or_a_flag(capsys):
    import yaml

    from slimeflow.cli import main

    for argv in (["convert", "torch-dist-to-hf"], ["convert", "--direction", "torch-dist-to-hf"]):
        assert main([*argv, "--input-dir", "a", "--output-dir", "b", "--origin-hf-dir", "c", "--vocab-size",
                     "259", "--print-config"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)["convert"]
        assert printed["direction"] == "torch-dist-to-hf" and printed["megatron"]["vocab_size"] == 259


@pytest.mark.slow
def test_a_release_is_published_to_s3_and_committed_last(converted, tmp_path, s3_bucket, s3_config):
    from slimeflow.io import checkpoints
    from slimeflow.stages.convert.stage import check_target_root, publish_release

    storage = Storage(s3_config)
    staged = tmp_path / "staged"
    shutil.copytree(converted["llama-bf16-gqa-1p"]["root"] / "release", staged)
    root = f"{s3_bucket}/ckpt"
    check_target_root(storage, root, overwrite=False)
    ref = publish_release(storage, staged, root)
    assert ref.uri == f"{root}/release" and checkpoints.read_tracker(storage, root) == "release"
    assert checkpoints.resolve(storage, root) == ref
    with pytest.raises(StageInputError, match="already holds a checkpoint"):
        check_target_root(storage, root, overwrite=False)


# --------------------------------------------------------------------------------------------------------------
# The Ray launcher: each rank a Ray task on a local Ray
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ray_launcher_round_trip_is_bit_exact_and_a_rank_error_surfaces(good_hf, tmp_path, local_ray):
    from dataclasses import replace

    from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, read_hf_source
    from slimeflow.cluster import LOCAL_RAY_SYSTEM_CONFIG

    forward = run(ConvertConfig(hf_checkpoint=str(good_hf), save=str(tmp_path / "ckpt"), processes=2,
                                launcher="ray"), context(tmp_path))
    run(ConvertConfig(direction="torch-dist-to-hf", input_dir=str(tmp_path / "ckpt"), output_dir=str(tmp_path / "back"),
                      origin_hf_dir=str(good_hf)), context(tmp_path))
    original, back = hf_tensors(good_hf), hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original) and forward.counts["processes"] == 2
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    from ray._private.state import state  # the local cluster init_ray started (local_ray), as Ray reports it

    assert {k: state.get_system_config()[k] for k in LOCAL_RAY_SYSTEM_CONFIG} == LOCAL_RAY_SYSTEM_CONFIG

    hf = broken_copy(good_hf, tmp_path)
    broken = replace(read_hf_source(good_hf), path=hf)
    (hf / "model.safetensors").unlink()  # validated, then gone: the rank that reads it fails in its Ray task
    with pytest.raises(RuntimeError, match=r"conversion rank . exited with 1:\n(.|\n)*model.safetensors"):
        convert_hf_to_torch_dist(broken, tmp_path / "failed", processes=2, launcher="ray")
    assert list((tmp_path / "failed").iterdir()) == []
