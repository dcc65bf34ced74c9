"""slime's debug modes (issue 17, item 6): --save-debug-rollout-data / --load-debug-rollout-data (one file per
rollout, `{rollout_id}` in the path), --debug-train-only (saved rollouts, no engine) and --debug-rollout-only (no
trainer). The key check: a saved rollout replays to the same loss as the run that generated it."""

from __future__ import annotations

import pytest
import torch

from slimeflow.config.pipeline import load_stage_config
from slimeflow.errors import ConfigError
from slimeflow.rollout.types import Sample, Status, TrainBatch
from slimeflow.stages.train import loop

TRAIN = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2"]


def refused(*argv: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_stage_config("train", None, [*TRAIN, *argv])
    return str(err.value)


def test_the_debug_flags_parse_under_slimes_names():
    config = load_stage_config("train", None, [*TRAIN, "--save-debug-rollout-data", "/d/rollout_{rollout_id}.pt",
                                               "--debug-rollout-only"])
    assert config.debug.debug_rollout_only and config.debug.save_debug_rollout_data == "/d/rollout_{rollout_id}.pt"
    # As slime: loading saved rollouts implies --debug-train-only (no engine is started).
    loaded = load_stage_config("train", None, [*TRAIN, "--load-debug-rollout-data", "/d/rollout_{rollout_id}.pt"])
    assert loaded.debug.debug_train_only


def test_debug_flag_combinations_that_cannot_run_are_refused():
    alone = refused("--debug-train-only")
    assert "--load-debug-rollout-data PATH (written by a run with --save-debug-rollout-data PATH)" in alone
    assert "--rollout-function-path F" in alone and "sft_rollout" in alone
    # A rollout function that needs no engine is the other source (slime's SFT scripts).
    sft = load_stage_config("train", None, [*TRAIN, "--debug-train-only", "--rollout-function-path",
                                            "slime.rollout.sft_rollout.generate_rollout"])
    assert sft.debug.debug_train_only and sft.debug.load_debug_rollout_data is None
    assert "--debug-rollout-only and --debug-train-only are both set" in refused(
        "--debug-rollout-only", "--debug-train-only", "--load-debug-rollout-data", "/d/{rollout_id}.pt")
    assert "--debug-rollout-only and --load-debug-rollout-data (which implies it)" in refused(
        "--debug-rollout-only", "--load-debug-rollout-data", "/d/{rollout_id}.pt")
    assert "has no {rollout_id}: every rollout would overwrite one file" in refused(
        "--save-debug-rollout-data", "/d/rollout.pt")
    assert "its only placeholder may be {rollout_id} (KeyError: 'rank')" in refused(
        "--save-debug-rollout-data", "/d/{rank}_{rollout_id}.pt")
    assert "give a local path" in refused("--load-debug-rollout-data", "s3://bucket/{rollout_id}.pt")
    # slime's other debug-data flags are refused with what to use instead, not left unknown.
    assert "--save-debug-train-data: not supported yet (saving the trainer's per-rank data" in refused(
        "--save-debug-train-data", "/d/{rollout_id}.pt")
    assert "use --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt" in refused("--dump-details", "/d")


def samples(n_groups: int = 2, n: int = 2) -> list[Sample]:
    out = []
    for g in range(n_groups):
        for i in range(n):
            out.append(Sample(group_index=g, index=g * n + i, prompt=f"p{g}", label="7", metadata={"row_id": f"r{g}"},
                              tokens=[1, 2, 3, 4 + i], response="x", response_length=2, reward=float(i),
                              loss_mask=[1, 0], rollout_log_probs=[-0.5, -1.25], status=Status.COMPLETED))
    return out


def test_a_saved_rollout_reads_back_as_the_same_train_batch(tmp_path):
    from slimeflow.stages.train.debug_data import load_rollout, row_ids, save_rollout

    template = str(tmp_path / "debug" / "rollout_{rollout_id}.pt")
    path = save_rollout(template, 3, samples(), n_samples_per_prompt=2)
    assert path == tmp_path / "debug" / "rollout_3.pt"
    raw = torch.load(path, weights_only=True)  # plain data: safe to load without running code
    assert raw["rollout_id"] == 3 and len(raw["samples"]) == 4
    back = load_rollout(template, 3, n_samples_per_prompt=2)
    assert back == samples()
    a, b = TrainBatch.from_samples(samples()), TrainBatch.from_samples(back)
    assert all(torch.equal(x, y) for x, y in zip(a.tokens + a.loss_masks + a.rollout_log_probs,
                                                  b.tokens + b.loss_masks + b.rollout_log_probs, strict=True))
    assert torch.equal(a.rewards, b.rewards) and a.group_indices == b.group_indices
    assert row_ids(back) == [["r0", "r0"], ["r1", "r1"]]


# slime's Sample (slime/utils/types.py at THUDM/slime 624b824a8): its dataclass fields and Status values. Its
# Sample.from_dict takes these as fields and sets any other key as an attribute; load_debug_rollout_data reads
# torch.load(path)["samples"]. (Checked by hand at that commit: slime's from_dict reads a file saved here.)
SLIME_SAMPLE_FIELDS = {
    "apply_chat_template_kwargs", "custom_rm_path", "generate_function_path", "group_index", "index", "label",
    "loss_mask", "metadata", "multimodal_inputs", "multimodal_train_input_id", "multimodal_train_inputs",
    "non_generation_time", "prefix_cache_info", "prompt", "remove_sample", "response", "response_length", "reward",
    "rollout_id", "rollout_log_probs", "rollout_routed_experts", "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets", "session_id", "spec_info", "status", "teacher_log_probs", "tokens",
    "train_metadata", "weight_versions"}
SLIME_STATUS_VALUES = {"pending", "completed", "truncated", "aborted", "failed"}


def test_a_saved_rollout_has_slimes_layout_and_field_names(tmp_path):
    from slimeflow.stages.train.debug_data import save_rollout

    raw = torch.load(save_rollout(str(tmp_path / "{rollout_id}.pt"), 0, samples(), 2), weights_only=True)
    assert {"rollout_id", "samples"} <= set(raw)
    training = {"tokens", "response_length", "loss_mask", "reward", "rollout_log_probs", "group_index", "status"}
    assert training <= set(raw["samples"][0]) and training <= SLIME_SAMPLE_FIELDS
    assert set(raw["samples"][0]) - SLIME_SAMPLE_FIELDS == {"failure_reason"}  # an attribute for slime
    assert {s.value for s in Status} == SLIME_STATUS_VALUES


class Payload:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_a_rollout_file_that_would_run_code_is_refused(tmp_path):
    from slimeflow.stages.train.debug_data import load_rollout

    torch.save({"rollout_id": 0, "samples": [Payload()]}, tmp_path / "rollout_0.pt")
    with pytest.raises(ValueError, match="holds more than plain data .* so it is not loaded"):
        load_rollout(str(tmp_path / "rollout_{rollout_id}.pt"), 0, n_samples_per_prompt=2)


def test_a_replay_with_another_group_size_or_a_missing_file_is_refused(tmp_path):
    from slimeflow.stages.train.debug_data import load_rollout, save_rollout

    template = str(tmp_path / "rollout_{rollout_id}.pt")
    save_rollout(template, 0, samples(), n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="generated with --n-samples-per-prompt 2, this run has 4"):
        load_rollout(template, 0, n_samples_per_prompt=4)
    with pytest.raises(FileNotFoundError, match=r"rollout 1's file .*rollout_1.pt does not exist"):
        load_rollout(template, 1, n_samples_per_prompt=2)


def test_a_replay_whose_files_are_missing_is_refused_before_ray(tmp_path):
    from slimeflow.stages.train.debug_data import save_rollout
    from slimeflow.stages.train.preflight import replay_problems

    template = str(tmp_path / "rollout_{rollout_id}.pt")
    save_rollout(template, 0, samples(), n_samples_per_prompt=2)
    config = load_stage_config("train", None, [*TRAIN, "--load-debug-rollout-data", template])
    (problem,) = replay_problems(config)
    assert f"--load-debug-rollout-data {template}: 1 of the files of rollouts 0..1 are missing" in problem
    assert str(tmp_path / "rollout_1.pt") in problem and "--save-debug-rollout-data" in problem
    save_rollout(template, 1, samples(), n_samples_per_prompt=2)
    assert replay_problems(config) == []


def test_without_a_trainer_the_loop_reports_rollouts_and_saves_nothing():
    from test_loop import FakePlacement, Recorder, Reports

    from slimeflow.stages.train.placement import NoTrainer

    recorder, reports = Recorder(), Reports()
    placement = FakePlacement(recorder)
    placement.actor_group = NoTrainer(start_rollout_id=None)
    result = loop.train(placement, 4, reports)
    assert [c[0] for c in recorder.calls if c[0] in ("generate", "eval")] == [
        "eval", "generate", "generate", "eval", "generate", "generate", "eval"]
    assert [r[0] for r in reports.rollouts] == [0, 1, 2, 3] and "rollout/reward_mean" in reports.rollouts[0][1]
    assert result.checkpoint is None and "pg_loss" not in result.last_metrics


def test_an_evaluation_with_nothing_evaluated_leaves_no_line(tmp_path):
    # --debug-train-only has no engine to evaluate with (slime skips its eval too): no empty {"step": k} record.
    from slimeflow.stages.train.rollout_manager import ReplayRolloutManager
    from slimeflow.stages.train.stage import RolloutLog

    log = RolloutLog(tmp_path / "rollouts.jsonl")
    config = load_stage_config("train", None, [*TRAIN, "--load-debug-rollout-data", "/d/{rollout_id}.pt"])
    loop.evaluate(ReplayRolloutManager(config, None), 0, log)
    log.evaluation(2, {"eval/x/avg_at_1": 0.5})
    assert log.read() == [{"step": 2, "eval/x/avg_at_1": 0.5}]
