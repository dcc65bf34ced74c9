"""slime's debug modes on Ray with the tiny model (the flags, the files and the loop without Ray are in
tests/unit/test_debug_modes.py): a saved rollout replays to the same loss without an engine, and a rollout-only
run generates and reports without a trainer."""

from __future__ import annotations

import json

import pytest
from train_helpers import run_stage, train_config, with_debug

from slimeflow.rollout.types import Sample


def parity_reward(args, sample: Sample) -> float:
    """A reward the tiny random model earns on about half its responses (it almost never writes the demo's
    answer), so that advantages, pg_loss and gradients are not all zero."""
    return float(sample.tokens[-1] % 2)


SHORT = {"num-rollout": 2, "rollout-batch-size": 4, "n-samples-per-prompt": 4, "eval-interval": None,
         "save-interval": None, "rm-type": None, "custom-rm-path": f"{__name__}:parity_reward"}


@pytest.mark.slow
def test_a_saved_rollout_replays_to_the_same_loss_without_an_engine(tmp_path, monkeypatch, local_ray):
    config, _ = train_config(tmp_path / "prep", **SHORT)
    template = str(tmp_path / "debug" / "rollout_{rollout_id}.pt")
    original, created, _ = run_stage(with_debug(config, save_debug_rollout_data=template), tmp_path / "original",
                                     monkeypatch)
    assert sorted(p.name for p in (tmp_path / "debug").iterdir()) == ["rollout_0.pt", "rollout_1.pt"]
    assert created == ["RolloutManager", "TrainActor"]
    assert all(r["rollout/reward_std"] > 0 and r["grad_norm"] > 0 for r in original)

    replayed, created, manifest = run_stage(with_debug(config, load_debug_rollout_data=template),
                                            tmp_path / "replayed", monkeypatch)
    assert created == ["ReplayRolloutManager", "TrainActor"]  # no engine: the saved samples are the rollout
    assert [r["step"] for r in replayed] == [0, 1] and manifest.outputs["checkpoint"].endswith("iter_0000001")
    for before, after in zip(original, replayed, strict=True):
        trained = {k for k in after if k != "step" and not k.startswith("time/") and k != "train_tokens_per_s"}
        assert {"pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm"} <= trained
        assert all(abs(after[k] - before[k]) <= 1e-6 for k in trained), {k: (before[k], after[k]) for k in trained}
    ids = [json.loads(line) for line in (tmp_path / "replayed" / "train" / "row_ids.jsonl").read_text().splitlines()]
    originals = (tmp_path / "original" / "train" / "row_ids.jsonl").read_text().splitlines()
    assert ids == [json.loads(line) for line in originals]


@pytest.mark.slow
def test_rollout_only_generates_and_reports_without_a_trainer(tmp_path, monkeypatch, local_ray):
    config, _ = train_config(tmp_path / "prep", **SHORT)
    records, created, manifest = run_stage(with_debug(config, debug_rollout_only=True), tmp_path / "run", monkeypatch)
    assert created == ["RolloutManager"]  # no TrainActor
    assert [r["step"] for r in records] == [0, 1]
    assert all("rollout/reward_mean" in r and "pg_loss" not in r for r in records)
    assert "checkpoint" not in manifest.outputs and manifest.artifacts == []
    assert not list((tmp_path / "run" / "checkpoints").glob("iter_*"))
