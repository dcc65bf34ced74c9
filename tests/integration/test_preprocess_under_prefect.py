"""The preprocess stage through the CLI and in the pipeline, under Prefect (the reader, the dedup index and the token
statistics are in tests/unit/test_preprocess_reader.py)."""

from __future__ import annotations

import json

import pytest
from preprocess_helpers import assert_count_identity, messages, write_jsonl

from slimeflow.io.manifest import Manifest
from slimeflow.io.prompts import PromptDataset
from slimeflow.io.storage import Storage


@pytest.mark.slow
def test_the_cli_runs_the_stage_with_named_eval_sets(prefect_harness, tmp_path, mlflow_uri, capsys):
    from slimeflow.cli import main

    train = write_jsonl(tmp_path / "train.jsonl", [{"q": f"q{i}", "a": str(i), "src": "x"} for i in range(5)])
    aime = write_jsonl(tmp_path / "aime.jsonl", [{"q": "hard", "a": "1"}, {"q": "no answer"}])
    rc = main(["preprocess", "--input", str(train), "--eval-input", "aime", str(aime), "--output", str(tmp_path / "p"),
               "--input-key", "q", "--label-key", "a", "--workdir", str(tmp_path / "w"),
               "--mlflow-tracking-uri", mlflow_uri])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"eval.aime={tmp_path / 'p' / 'eval' / 'aime'}" in out
    manifest = Manifest.model_validate_json((tmp_path / "w" / "manifests" / "preprocess.json").read_text())
    assert_count_identity(manifest, Storage())
    assert manifest.counts["aime.quarantined.missing_label"] == 1 and manifest.counts["train.rows_out"] == 5
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["hashes"] == manifest.hashes


@pytest.mark.slow
def test_the_pipeline_renders_with_the_model_stage_tokenizer(prefect_harness, tmp_path, mlflow_uri):
    from slimeflow.config.pipeline import load_pipeline_config
    from slimeflow.flows.runner import run_pipeline

    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": messages(f"{i} + 1?"), "label": str(i + 1)} for i in range(4)])
    config = load_pipeline_config({
        "name": "pp", "hf_checkpoint": "tiny:qwen2?seed=2", "workdir": str(tmp_path / "w"),
        "infra": {"mlflow_tracking_uri": mlflow_uri},
        "preprocess": {"input": [str(source)], "input_key": "prompt", "label_key": "label", "apply_chat_template": True}})
    manifests = run_pipeline(config)

    checkpoint = manifests["model"]["outputs"]["hf_checkpoint"]
    assert manifests["preprocess"]["config"]["hf_checkpoint"] == checkpoint
    prompts = [d["prompt"] for d in PromptDataset(manifests["preprocess"]["outputs"]["train"])]
    assert all(p.startswith("<|im_start|>system\nReason step by step.") for p in prompts) and len(prompts) == 4
