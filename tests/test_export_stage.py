"""The export stage: a torch_dist checkpoint -> HF safetensors (sharded, checksummed) locally and on S3; the
pipeline's wiring of stage outputs into later stages; and the stage cache key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert import hf_tensors

from slimeflow.io.storage import ArtifactRecord, Storage
from slimeflow.stages.base import StageContext, StageInputError
from slimeflow.stages.convert.config import ConvertConfig
from slimeflow.stages.convert.stage import run as convert
from slimeflow.stages.export.config import ExportConfig, parse_size
from slimeflow.stages.export.stage import run as export
from slimeflow.stages.model.tiny import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    hf = build_tiny_model(tmp / "hf", TinyModelSpec.from_uri("tiny:qwen2?seed=7&num_hidden_layers=3"))
    convert(ConvertConfig(hf_checkpoint=str(hf), save=str(tmp / "ckpt")),
            StageContext(Storage(), tmp / "work", str(tmp / "work")))
    return hf, tmp / "ckpt"


def test_export_writes_loadable_sharded_safetensors_with_checksums(release, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, root = release
    ctx = StageContext(Storage(), tmp_path / "work", str(tmp_path / "out"))
    manifest = export(ExportConfig(input_dir=str(root), origin_hf_dir=str(hf), max_shard_size="20KB"), ctx)
    target = Path(manifest.outputs["hf_model"])
    assert target == tmp_path / "out" / "export" / "hf" and manifest.outputs["checkpoint"].endswith("release")
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 20 KB
    original, exported = hf_tensors(hf), hf_tensors(target)
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.model_type == "qwen2" and AutoTokenizer.from_pretrained(target).encode("a+b")
    for record in manifest.artifacts:
        Storage().read_bytes(str(target / record.path), expect=record)
    assert manifest.counts["files"] == len(manifest.artifacts) > 3


def test_export_to_s3_is_verified_against_the_checksums(release, tmp_path, s3_bucket, s3_config):
    hf, root = release
    storage = Storage(s3_config)
    target = f"{s3_bucket}/models/exported"
    manifest = export(ExportConfig(input_dir=str(root / "release"), origin_hf_dir=str(hf), output_dir=target),
                      StageContext(storage, tmp_path / "work", str(tmp_path / "out")))
    assert manifest.outputs["hf_model"] == target
    for record in manifest.artifacts:
        storage.read_bytes(f"{target}/{record.path}", expect=ArtifactRecord.model_validate(record.model_dump()))
    assert any(r.path == "config.json" for r in manifest.artifacts)


def test_export_refuses_missing_inputs_and_non_checkpoints(release, tmp_path):
    hf, _ = release
    ctx = StageContext(Storage(), tmp_path / "work", str(tmp_path / "out"))
    with pytest.raises(StageInputError, match="--input-dir is not set"):
        export(ExportConfig(origin_hf_dir=str(hf)), ctx)
    with pytest.raises(StageInputError, match="not a checkpoint"):
        export(ExportConfig(input_dir=str(tmp_path), origin_hf_dir=str(hf)), ctx)
    with pytest.raises(ValueError, match="not a size"):
        ExportConfig(max_shard_size="five gigs")
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30


def test_pipeline_wiring_feeds_each_stage_the_outputs_before_it():
    from slimeflow.flows import wiring
    from slimeflow.stages.evaluate.config import EvaluateConfig
    from slimeflow.stages.rl.config import TrainConfig

    m = {"model": {"stage": "model", "outputs": {"hf_checkpoint": "/m"}},
         "convert": {"stage": "convert", "outputs": {"torch_dist": "/ref", "checkpoint": "/ref/release"}},
         "preprocess": {"stage": "preprocess", "outputs": {"train": "/p/train", "eval.aime": "/p/eval/aime"}},
         "train": {"stage": "train", "outputs": {"checkpoint": "/ck/iter_0000009"}}}
    train = wiring.train(TrainConfig.model_validate({"batch": {"rollout_batch_size": 1, "num_rollout": 1}}), m)
    assert train.checkpoint.hf_checkpoint == "/m" and train.checkpoint.ref_load == "/ref"
    assert train.data.prompt_data == "/p/train" and train.eval.eval_prompt_data == {"aime": "/p/eval/aime"}
    own = TrainConfig.model_validate({"batch": {"rollout_batch_size": 1, "num_rollout": 1},
                                      "data": {"prompt_data": "/mine"}})
    assert wiring.train(own, m).data.prompt_data == "/mine"  # a value the config sets itself wins
    evaluate = wiring.evaluate(EvaluateConfig(), m)
    assert evaluate.load == "/ck/iter_0000009" and evaluate.eval_prompt_data == {"aime": "/p/eval/aime"}
    exported = wiring.export(ExportConfig(), {k: v for k, v in m.items() if k != "train"})
    assert exported.input_dir == "/ref/release" and exported.origin_hf_dir == "/m"
    assert [x["stage"] for x in wiring.inputs(m, "model", "train", "evaluate")] == ["model", "train"]


def test_the_cache_key_follows_config_and_input_content_not_the_run():
    from slimeflow.flows.stages import cache_key

    config = ExportConfig(input_dir="/a")
    upstream = [{"stage": "train", "hashes": {"content": "abc"}}]
    key = cache_key("export", config, upstream)
    assert key == cache_key("export", ExportConfig(input_dir="/a"), [dict(upstream[0])])
    assert key != cache_key("export", ExportConfig(input_dir="/b"), upstream)
    assert key != cache_key("export", config, [{"stage": "train", "hashes": {"content": "abd"}}])
    assert key != cache_key("evaluate", config, upstream)
