"""What the config alone shows wrong is refused before Prefect, Ray or an engine starts: `slimeflow` never reaches
the pipeline runner (where the ephemeral Prefect server starts) for a bad plug-in path, a saved rollout that holds
code, or a data path that is not there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slimeflow.cli import main

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "increment-train.jsonl"


@pytest.fixture
def runs(monkeypatch) -> list:
    """The configs the pipeline runner was asked to run (none, when the start-up check refuses)."""
    import slimeflow.flows.runner

    started = []
    monkeypatch.setattr(slimeflow.flows.runner, "run_pipeline", lambda config: started.append(config) or {})
    return started


def _train(tmp_path: Path, *flags: str) -> list[str]:
    return ["train", "--hf-checkpoint", str(tmp_path), "--prompt-data", str(DATA), "--input-key", "prompt",
            "--label-key", "label", "--rollout-batch-size", "2", "--num-rollout", "1", "--workdir",
            str(tmp_path / "w"), *flags]


def test_a_bad_plugin_path_is_refused_before_anything_starts(tmp_path, runs, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(_train(tmp_path, "--custom-rm-path", "no_such_module_xyz:reward")) == 1
    err = capsys.readouterr().err
    assert "the run cannot start" in err and "--custom-rm-path 'no_such_module_xyz:reward'" in err, err
    assert runs == []


def test_a_missing_data_path_is_refused_before_anything_starts(tmp_path, runs, capsys):
    (tmp_path / "config.json").write_text("{}")
    flags = _train(tmp_path)
    flags[flags.index("--prompt-data") + 1] = str(tmp_path / "nowhere.jsonl")
    assert main(flags) == 1
    assert f"--prompt-data {tmp_path / 'nowhere.jsonl'} does not exist" in capsys.readouterr().err
    assert runs == []


class _Payload:
    def __reduce__(self):
        return os.system, ("echo ran > /dev/null",)


def test_a_debug_rollout_file_that_holds_code_is_refused_before_anything_starts(tmp_path, runs, capsys):
    import torch

    (tmp_path / "config.json").write_text("{}")
    torch.save({"rollout_id": 0, "n_samples_per_prompt": 1, "samples": [{"status": "completed"}]},
               tmp_path / "rollout_0.pt")
    torch.save({"rollout_id": 1, "samples": [_Payload()]}, tmp_path / "rollout_1.pt")
    flags = _train(tmp_path, "--debug-train-only", "--load-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt"))
    flags[flags.index("--num-rollout") + 1] = "2"
    assert main(flags) == 1
    err = capsys.readouterr().err
    assert f"rollout 1's file {tmp_path / 'rollout_1.pt'} holds more than plain data" in err, err
    assert "posix.system" in err and "rollout 0's" not in err
    assert runs == []


def _saved_checkpoint(root: Path, saved_size: int, size_now: int) -> Path:
    """A checkpoint root whose tracker names iter_0000003, complete, with a data file of `size_now` bytes that our
    checksums say was `saved_size` when saved."""
    directory = root / "iter_0000003"
    (directory / "slimeflow").mkdir(parents=True)
    for marker in (".metadata", "common.pt", "metadata.json"):
        (directory / marker).write_bytes(b"x")
    (directory / "__0_0.distcp").write_bytes(b"\0" * size_now)
    files = [{"path": p, "sha256": "0" * 64, "size": 1} for p in (".metadata", "common.pt", "metadata.json")]
    files.append({"path": "__0_0.distcp", "sha256": "0" * 64, "size": saved_size})
    (directory / "slimeflow" / "checksums.json").write_text(json.dumps({"algorithm": "sha256", "files": files}))
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    return directory


def test_a_truncated_checkpoint_to_resume_from_is_refused_before_anything_starts(tmp_path, runs, capsys):
    (tmp_path / "config.json").write_text("{}")
    directory = _saved_checkpoint(tmp_path / "ckpt", saved_size=4096, size_now=1000)
    assert main(_train(tmp_path, "--load", str(tmp_path / "ckpt"))) == 1
    err = capsys.readouterr().err
    assert f"--load {tmp_path / 'ckpt'}: {directory / '__0_0.distcp'}: 1000 bytes, 4096 when saved" in err, err
    assert runs == []


def test_a_ref_load_that_holds_no_checkpoint_is_refused_before_anything_starts(tmp_path, runs, capsys):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert main(_train(tmp_path, "--ref-load", str(tmp_path / "empty"))) == 1
    err = capsys.readouterr().err
    assert f"--ref-load {tmp_path / 'empty'}: " in err, err
    assert runs == []
