"""The model stage as plain Python: tiny specs, local directories, s3:// sources, and broken checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimeflow.config.model import ModelConfig
from slimeflow.errors import StageInputError, UnsafePathError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.stages.model.stage import run


def context(tmp_path: Path, storage: Storage | None = None) -> StageContext:
    return StageContext(storage or Storage(), tmp_path / "work", str(tmp_path / "out"))


def test_a_tiny_spec_is_built_once_and_fingerprinted(tmp_path):
    first = run(ModelConfig(hf_checkpoint="tiny:qwen3?seed=2"), context(tmp_path))
    second = run(ModelConfig(hf_checkpoint="tiny:qwen3?seed=2"), context(tmp_path))
    assert first.outputs["hf_checkpoint"] == second.outputs["hf_checkpoint"]
    assert first.hashes["content"] == second.hashes["content"]
    assert first.facts["model_type"] == "qwen3" and first.facts["dtypes"] == ["F32"]
    names = {r.path for r in first.artifacts}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert first.counts["files"] == len(names) and first.counts["bytes"] == sum(r.size for r in first.artifacts)
    other = run(ModelConfig(hf_checkpoint="tiny:qwen3?seed=3"), context(tmp_path))
    assert other.hashes["content"] != first.hashes["content"]


def test_a_local_directory_is_used_in_place_and_its_parameter_count_read_from_headers(tmp_path):
    model = build_tiny_model(tmp_path / "m", TinyModelSpec(family="llama", max_shard_size="100KB"))
    manifest = run(ModelConfig(hf_checkpoint=str(model)), context(tmp_path))
    assert manifest.outputs["hf_checkpoint"] == str(model)
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32)
    assert manifest.counts["parameters"] == sum(p.numel() for p in loaded.state_dict().values())


def test_an_s3_checkpoint_is_downloaded_and_matches_the_original(tmp_path, s3_config, s3_bucket):
    storage = Storage(s3_config)
    model = build_tiny_model(tmp_path / "m", TinyModelSpec(family="qwen2"))
    storage.copy_tree(str(model), f"{s3_bucket}/models/qwen2")
    local = run(ModelConfig(hf_checkpoint=str(model)), context(tmp_path, storage))
    remote = run(ModelConfig(hf_checkpoint=f"{s3_bucket}/models/qwen2"), context(tmp_path, storage))
    assert remote.hashes["content"] == local.hashes["content"]
    assert Path(remote.outputs["hf_checkpoint"]).is_relative_to(tmp_path / "work" / "model")


def test_every_problem_of_a_broken_checkpoint_is_listed(tmp_path):
    model = build_tiny_model(tmp_path / "m", TinyModelSpec(max_shard_size="100KB"))
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    (model / shards[0]).unlink()
    last = model / shards[-1]
    last.write_bytes(last.read_bytes()[:-1])
    (model / "config.json").write_text("{not json")
    with pytest.raises(StageInputError) as caught:
        run(ModelConfig(hf_checkpoint=str(model)), context(tmp_path))
    problems = "\n".join(caught.value.problems)
    assert "config.json is not valid JSON" in problems
    assert f"{shards[0]} is missing" in problems
    assert f"{shards[-1]} is truncated" in problems
    assert "save_pretrained(safe_serialization=True)" in str(caught.value)


def test_a_path_that_is_not_a_directory(tmp_path):
    with pytest.raises(StageInputError, match="is not a directory"):
        run(ModelConfig(hf_checkpoint=str(tmp_path / "nothing")), context(tmp_path))


def test_pytorch_bin_weights_are_refused_with_the_fix(tmp_path):
    model = build_tiny_model(tmp_path / "m")
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    with pytest.raises(StageInputError, match="no safetensors weights"):
        run(ModelConfig(hf_checkpoint=str(model)), context(tmp_path))


def test_an_s3_key_climbing_out_of_the_checkpoint_fails_naming_it(tmp_path, s3_config, s3_bucket):
    storage = Storage(s3_config)
    storage.copy_tree(str(build_tiny_model(tmp_path / "m")), f"{s3_bucket}/models/llama")
    storage.write_text(f"{s3_bucket}/models/llama/../../../escape/x.txt", "x")
    with pytest.raises(UnsafePathError, match="escape/x.txt"):
        run(ModelConfig(hf_checkpoint=f"{s3_bucket}/models/llama"), context(tmp_path, storage))
    assert not list(tmp_path.rglob("x.txt"))


def test_an_index_entry_pointing_outside_the_checkpoint_is_refused(tmp_path):
    model = build_tiny_model(tmp_path / "m", TinyModelSpec(max_shard_size="100KB"))
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "outside").mkdir()
    (model / shard).rename(tmp_path / "outside" / "evil.safetensors")  # readable, but not the checkpoint's
    index["weight_map"] = {k: "../outside/evil.safetensors" if v == shard else v for k, v in index["weight_map"].items()}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(StageInputError, match=r"outside the checkpoint: '\.\./outside/evil\.safetensors'"):
        run(ModelConfig(hf_checkpoint=str(model)), context(tmp_path))
