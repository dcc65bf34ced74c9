"""The train stage with --train-backend megatron on Ray: a one-rank run killed with SIGKILL mid-save that resumes
bit-exactly, with the data order of an uninterrupted run (the pipeline's SIGKILL test; test_train_e2e.py's
torch-backend copy of it merged here). Resuming across layouts is tested in-process, in test_megatron_backend.py;
every family at TP 1 and at its natural layout (TP 2 + SP, EP 2), with slime's before-train-step hook in each
TrainActor, in test_family_matrix.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import kill_and_resume, row_ids, train_config

from slimeflow.io.guard import ABANDONED

pytestmark = pytest.mark.slow


def test_sigkill_mid_save_resumes_the_megatron_backend_exactly(tmp_path):
    """The Megatron backend's checkpoint under a SIGKILL: killed while staging its second save, the run resumes
    from the first (weights, Adam state, RNG, data position) and ends where an uninterrupted run ends, bit for bit
    (same rollouts, same weights): the torch backend's SIGKILL test (test_train_e2e.py) with Megatron's
    dist_checkpointing saves."""
    import torch

    from slimeflow.checkpoint.torch_dist import load_torch_dist
    from slimeflow.config.convert import ConvertConfig
    from slimeflow.stages.convert.stage import run as convert_run

    config, ctx = train_config(tmp_path / "prep", **{
        "num-rollout": 4, "save-interval": 2, "eval-interval": None, "rollout-batch-size": 4,
        "n-samples-per-prompt": 2, "train-backend": "megatron"})
    ref = convert_run(ConvertConfig(hf_checkpoint=config.checkpoint.hf_checkpoint, save=str(tmp_path / "ref"),
                                    processes=1), ctx).outputs["torch_dist"]
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"ref_load": ref})})
    # The uninterrupted run saves once, after its last rollout (iter_0000003, what the resumed run's is compared with).
    # It serves its engine from a process of its own (--engine-in-process false), the killed and resumed one from a
    # thread of the RolloutManager (the default): neither the data order nor the numbers depend on it.
    straight = config.model_copy(update={
        "placement": config.placement.model_copy(update={"engine_in_process": False}),
        "checkpoint": config.checkpoint.model_copy(update={"save_interval": None})})

    def only_the_committed_checkpoint_is_left(root: Path) -> None:
        # What the kill interrupted may leave a conversion's staging (ours by name); the resumed run removes it.
        left = sorted(p.name for p in root.iterdir() if not ABANDONED.match(p.name))
        assert left == [".slimeflow-run", "iter_0000001", "latest_checkpointed_iteration.txt"]

    root = kill_and_resume(straight, config, tmp_path, staged=3, committed=1,
                           check_killed=only_the_committed_checkpoint_is_left)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    expected = row_ids(tmp_path / "straight")
    assert sorted(expected) == list(range(4))
    assert row_ids(tmp_path / "resumed") == expected
    rollouts = [json.loads(line) for line in (tmp_path / "resumed" / "train" / "rollouts.jsonl").read_text()
                .splitlines()]
    assert [r["step"] for r in rollouts] == [0, 1, 2, 3]  # rollouts 2 and 3 redone once, the killed lines replaced
    # Bit-exact: the resumed run's rollouts 2-3 were sampled and trained as the uninterrupted run's were, which
    # needs the Adam moments, the step count and the RNG streams of checkpoint 1, not just its weights.
    got, _ = load_torch_dist(root / "iter_0000003")
    want, _ = load_torch_dist(tmp_path / "straight" / "checkpoints" / "iter_0000003")
    assert got.keys() == want.keys()
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    assert not unequal, f"weights differ after the resume: {unequal[:5]}"
