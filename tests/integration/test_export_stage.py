"""The export stage: a torch_dist checkpoint -> HF safetensors (sharded, checksummed) locally and on S3; the
pipeline's wiring of stage outputs into later stages; and the stage cache key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert import hf_tensors

from slimeflow.config.convert import ConvertConfig
from slimeflow.config.export import ExportConfig, parse_size
from slimeflow.config.model import ModelConfig
from slimeflow.errors import StageInputError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.storage import ArtifactRecord, Storage, join
from slimeflow.stages.base import StageContext
from slimeflow.stages.convert.stage import run as convert
from slimeflow.stages.export.stage import run as export
from slimeflow.stages.model.stage import run as run_model


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
    from slimeflow.config.evaluate import EvaluateConfig
    from slimeflow.config.train import TrainConfig
    from slimeflow.flows import wiring

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


# -- the target: never delete what we did not write; replace our own export only with --overwrite ---------------

FOREIGN = {"team/README.md": "our team", "team/datasets/train.jsonl": "{}\n", "team/other-model/config.json": "{}"}


def _export(release, storage, tmp_path, target, **config):
    hf, root = release
    return export(ExportConfig(input_dir=str(root), origin_hf_dir=str(hf), output_dir=target, **config),
                  StageContext(storage, tmp_path / "work", str(tmp_path / "out")))


def _files(storage, uri):
    return sorted(u[len(uri) + 1:] for u in storage.list(uri, recursive=True)) if storage.exists(uri) else []


def test_s3_export_refuses_a_prefix_or_bucket_holding_objects_it_did_not_write(release, tmp_path, s3_bucket, s3_config):
    storage = Storage(s3_config)
    for key, text in FOREIGN.items():
        storage.write_text(f"{s3_bucket}/{key}", text)
    for target in (f"{s3_bucket}/team", s3_bucket):
        with pytest.raises(StageInputError, match=r"no slimeflow export wrote: (team/)?README\.md"):
            _export(release, storage, tmp_path, target, overwrite=True)
    assert {key: storage.read_text(f"{s3_bucket}/{key}") for key in FOREIGN} == FOREIGN  # the bucket too
    assert _files(storage, s3_bucket) == sorted(FOREIGN)  # nothing staged either: refused before any upload


def test_a_local_export_refuses_a_directory_holding_other_files(release, tmp_path):
    target = tmp_path / "team"
    (target / "datasets").mkdir(parents=True)
    (target / "datasets" / "train.jsonl").write_text("{}\n")
    with pytest.raises(StageInputError, match="no slimeflow export wrote: datasets/train.jsonl"):
        _export(release, Storage(), tmp_path, str(target), overwrite=True)
    assert (target / "datasets" / "train.jsonl").read_text() == "{}\n"


def test_s3_export_replaces_its_own_export_only_with_overwrite(release, tmp_path, s3_bucket, s3_config):
    storage, target = Storage(s3_config), f"{s3_bucket}/models/exported"
    first = _export(release, storage, tmp_path, target, max_shard_size="100KB")
    with pytest.raises(StageInputError, match=r"holds an earlier export[\s\S]*--overwrite true"):
        _export(release, storage, tmp_path, target, overwrite=False)
    from slimeflow.checkpoint.publish import MARKER, committed

    second = _export(release, storage, tmp_path, target, max_shard_size="5GB")  # fewer shards than the first
    assert _files(storage, target) == sorted([MARKER, *(r.path for r in second.artifacts)])  # old shards gone
    assert len(first.artifacts) > len(second.artifacts) and committed(storage, target, second.hashes["content"])
    storage.verify_tree(target, second.artifacts)
    storage.write_text(f"{target}/notes.txt", "mine")
    with pytest.raises(StageInputError, match="no slimeflow export wrote: notes.txt"):
        _export(release, storage, tmp_path, target)
    assert storage.read_text(f"{target}/notes.txt") == "mine"


# -- a SIGKILL mid-upload: the old export survives until the new one is whole; a torn target says so ------------

_DYING_EXPORT = """
import json, os, signal, sys
from pathlib import Path
from slimeflow.io.storage import S3Config, Storage
from slimeflow.stages.base import StageContext
from slimeflow.config.export import ExportConfig
from slimeflow.stages.export.stage import run

args = json.loads(sys.argv[1])
calls = {"open_write": 0, "copy": 0}

class Dying(Storage):  # SIGKILLs its own process at the n-th object write or server-side copy
    def _count(self, method, uri):
        if uri.startswith("s3://"):
            calls[method] += 1
            if calls[method] == args["kill_at"].get(method):
                os.kill(os.getpid(), signal.SIGKILL)

    def open_write(self, uri):
        self._count("open_write", uri)
        return super().open_write(uri)

    def copy(self, src, dst):
        self._count("copy", src)
        return super().copy(src, dst)

storage = Dying(S3Config(**args["s3"]))
run(ExportConfig(**args["config"]), StageContext(storage, Path(args["work"]), args["work"]))
"""


def _killed_export(release, tmp_path, s3_config, target, kill_at):
    import subprocess
    import sys

    hf, root = release
    s3 = {"endpoint_url": s3_config.endpoint_url, "access_key_id": s3_config.access_key_id,
          "secret_access_key": s3_config.secret_access_key.get_secret_value(), "region": s3_config.region}
    config = {"input_dir": str(root), "origin_hf_dir": str(hf), "output_dir": target, "max_shard_size": "100KB"}
    args = {"s3": s3, "config": config, "work": str(tmp_path / "killed"), "kill_at": kill_at}
    done = subprocess.run([sys.executable, "-c", _DYING_EXPORT, json.dumps(args)], capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()[-2000:]


def test_a_kill_while_uploading_leaves_the_old_export_whole_and_committed(release, tmp_path, s3_bucket, s3_config):
    storage, target = Storage(s3_config), f"{s3_bucket}/models/exported"
    old = _export(release, storage, tmp_path, target, max_shard_size="5GB")
    _killed_export(release, tmp_path, s3_config, target, {"open_write": 3})
    storage.verify_tree(target, old.artifacts)  # every old file in place, unchanged
    from slimeflow.checkpoint.publish import committed

    assert committed(storage, target, old.hashes["content"])


def test_a_kill_while_copying_into_place_reports_the_target_incomplete_and_a_rerun_completes_it(
        release, tmp_path, s3_bucket, s3_config):
    from slimeflow.checkpoint.publish import MARKER, STAGING, committed, read_marker

    storage, target = Storage(s3_config), f"{s3_bucket}/models/exported"
    old = _export(release, storage, tmp_path, target, max_shard_size="5GB")
    _killed_export(release, tmp_path, s3_config, target, {"copy": 2})
    marker = read_marker(storage, target)
    assert marker is not None and marker.state == "replacing" and not committed(storage, target, old.hashes["content"])
    assert not storage.exists(f"{target}/config.json")  # an HF reader cannot load the torn target
    storage.verify_tree(join(target, marker.staging), marker.files)  # the new export is whole in staging
    model = StageContext(storage, tmp_path / "model-work", str(tmp_path / "model-out"))
    with pytest.raises(StageInputError, match="unfinished export: its .slimeflow-export.json says 'replacing'"):
        run_model(ModelConfig(hf_checkpoint=target), model)  # a reader of the target is told, not misled
    new = _export(release, storage, tmp_path, target, max_shard_size="100KB")
    assert committed(storage, target, new.hashes["content"]) and new.hashes["content"] == marker.content
    assert _files(storage, target) == sorted([MARKER, *(r.path for r in new.artifacts)])
    assert not any(name.startswith(STAGING) for name in _files(storage, target))
    assert run_model(ModelConfig(hf_checkpoint=target), model).hashes["content"] == new.hashes["content"]


def test_the_stage_cache_reuses_an_export_only_while_its_marker_holds_that_export(tmp_path):
    from slimeflow.flows.stages import cache_key, cached_manifest
    from slimeflow.io.manifest import Manifest

    storage, output = Storage(), str(tmp_path / "out")
    marker = tmp_path / "hf" / ".slimeflow-export.json"
    marker.parent.mkdir()
    key = cache_key("export", ExportConfig(), [])
    Manifest(stage="export", outputs={"hf_model": str(marker.parent), "commit": str(marker)},
             hashes={"content": "abc"}, cache_key=key).write(storage, output)
    for state, content, reused in [("complete", "abc", True), ("replacing", "abc", False), ("complete", "abd", False)]:
        marker.write_text(json.dumps({"state": state, "files": [], "content": content}))
        assert (cached_manifest(storage, output, "export", key) is not None) == reused, (state, content)
