"""The `slimeflow` command running stages under Prefect: a stage without its inputs, the example pipeline, a broken
checkpoint (help, translation and the errors at parse are in tests/unit/test_cli.py)."""

from __future__ import annotations

import pytest
from paths import ROOT

from slimeflow.cli import main


@pytest.mark.slow
def test_a_stage_without_its_inputs_fails_with_one_line_naming_them(prefect_harness, tmp_path, mlflow_uri, capsys):
    assert main(["train", "--rollout-batch-size", "2", "--num-rollout", "1", "--workdir", str(tmp_path),
                 "--mlflow-tracking-uri", mlflow_uri, "--train-backend", "megatron"]) == 1
    err = capsys.readouterr().err
    assert "slimeflow: the run failed: StageInputError: the train stage cannot start" in err
    assert "--hf-checkpoint is not set" in err and "--prompt-data is not set" in err
    assert "--train-backend megatron starts from a torch_dist checkpoint" in err


@pytest.mark.slow
def test_run_the_example_pipeline(prefect_harness, tmp_path, mlflow_uri, capsys):
    rc = main(["run", str(ROOT / "examples" / "tiny.yaml"), "--workdir", str(tmp_path), "--mlflow-tracking-uri",
               mlflow_uri])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "model: hf_checkpoint=" in out and (tmp_path / "manifests" / "model.json").is_file()


@pytest.mark.slow
def test_a_broken_checkpoint_fails_with_its_problems_named(prefect_harness, tmp_path, mlflow_uri, capsys):
    from slimeflow.families.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    (model / "tokenizer.json").unlink()
    rc = main(["model", "--hf-checkpoint", str(model), "--workdir", str(tmp_path / "w"), "--mlflow-tracking-uri",
               mlflow_uri])
    err = capsys.readouterr().err
    assert rc == 1
    assert "model.safetensors is truncated" in err and "no tokenizer" in err


@pytest.mark.slow
def test_a_stage_alone_writes_only_under_its_output(prefect_harness, tmp_path, monkeypatch, capsys):
    """`slimeflow preprocess --output DIR`: the manifests and the MLflow store go under DIR, nothing into the
    current directory."""
    cwd, elsewhere = tmp_path / "cwd", tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    rc = main(["preprocess", "--input", str(ROOT / "examples" / "data" / "increment-train.jsonl"),
               "--input-key", "prompt", "--label-key", "label", "--output", str(elsewhere)])
    assert rc == 0, capsys.readouterr().err
    assert list(cwd.iterdir()) == []
    assert (elsewhere / "manifests" / "preprocess.json").is_file() and (elsewhere / "mlflow.db").is_file()
