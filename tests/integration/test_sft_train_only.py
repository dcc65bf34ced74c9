"""slime's SFT path (issue 33, item 4): the flags of slime's run-qwen3-4B-base-sft.sh (sft_rollout as the rollout
function, --debug-train-only, sft_loss, per-token loss, no advantages) train a tiny Qwen-template model on a tiny
conversation set with no engine, the loss on the assistant turns alone."""

from __future__ import annotations

import json
import math

import pytest
from train_helpers import row_ids, run_stage
from transformers import AutoTokenizer

from slimeflow.config.model import ModelConfig
from slimeflow.config.pipeline import load_stage_config
from slimeflow.io.storage import Storage
from slimeflow.rollout.loss_masks import trained_spans
from slimeflow.stages.base import StageContext
from slimeflow.stages.model.stage import run as model_run
from slimeflow.stages.train.debug_data import load_rollout

MODEL = "tiny:qwen3?seed=0&hidden_size=64&intermediate_size=128"


def conversation(k: int) -> list[dict[str, str]]:
    turns = [{"role": "user", "content": f"add one to {k}"}, {"role": "assistant", "content": f"{k + 1}"}]
    if k % 2:  # a second exchange: every assistant turn is trained, no user turn is
        turns += [{"role": "user", "content": f"and to {k + 1}?"}, {"role": "assistant", "content": f"{k + 2}!"}]
    return turns


def sft_argv(tmp_path, epochs: int = 1, batch: int = 4) -> list[str]:
    """run-qwen3-4B-base-sft.sh's training flags, on 8 conversations: `epochs` epochs of rollouts of `batch`."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation(k)}) + "\n" for k in range(8)))
    ctx = StageContext(Storage(), tmp_path, str(tmp_path))
    hf = model_run(ModelConfig(hf_checkpoint=MODEL), ctx).outputs["hf_checkpoint"]
    return ["--hf-checkpoint", hf, "--prompt-data", str(data), "--input-key", "messages",
            "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--rollout-shuffle",
            "--num-epoch", str(epochs), "--rollout-batch-size", str(batch), "--global-batch-size", str(batch), "--loss-type", "sft_loss",
            "--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--debug-train-only",
            "--lr", "1e-3", "--save-debug-rollout-data", str(tmp_path / "debug" / "rollout_{rollout_id}.pt")]


def test_slimes_sft_flags_train_on_the_assistant_turns_without_an_engine(tmp_path, monkeypatch, local_ray):
    config = load_stage_config("train", None, sft_argv(tmp_path))
    records, created, manifest = run_stage(config, tmp_path / "run", monkeypatch)

    assert created == ["ReplayRolloutManager", "TrainActor"]  # no RolloutManager: no engine started
    assert [r["step"] for r in records] == [0, 1]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records), records
    assert not any(k.startswith(("pg_", "ppo_kl")) for r in records for k in r)  # no policy loss, no advantages
    assert manifest.outputs["checkpoint"].endswith("iter_0000001")

    tokenizer = AutoTokenizer.from_pretrained(config.checkpoint.hf_checkpoint)
    assistant_texts = {m["content"] for k in range(8) for m in conversation(k) if m["role"] == "assistant"}
    trained_texts: list[str] = []
    for rollout_id in (0, 1):
        for sample in load_rollout(str(tmp_path / "debug" / "rollout_{rollout_id}.pt"), rollout_id, 1):
            assert sample.reward == 0 and len(sample.loss_mask) == sample.response_length
            prompt_part = len(sample.tokens) - sample.response_length
            spans = trained_spans(tokenizer, sample.tokens, [0] * prompt_part + sample.loss_mask)
            assistant = [m["content"] for m in sample.prompt if m["role"] == "assistant"]
            # Each trained span is one assistant turn: its text and the turn's end token, nothing of the user's.
            assert [s.removesuffix("\n").removesuffix("<|im_end|>") for s in spans] == assistant, spans
            trained_texts += assistant
    assert sorted(trained_texts) == sorted(assistant_texts)  # one epoch: every conversation once



@pytest.mark.slow
def test_a_resumed_sft_run_continues_the_data_sources_epochs(tmp_path, monkeypatch, local_ray):
    """The data source's position is saved with each checkpoint: resumed for a second epoch, the run hands out
    epoch 1's order (reshuffled), not epoch 0's again."""
    run_stage(load_stage_config("train", None, sft_argv(tmp_path, epochs=1, batch=8)), tmp_path / "run", monkeypatch)
    records, created, manifest = run_stage(load_stage_config("train", None, sft_argv(tmp_path, epochs=2, batch=8)),
                                           tmp_path / "run", monkeypatch)
    assert created == ["ReplayRolloutManager", "TrainActor"]
    assert records[-1]["step"] == 1 and manifest.outputs["checkpoint"].endswith("iter_0000001")
    state = json.loads((tmp_path / "run" / "checkpoints" / "iter_0000001" / "slimeflow" / "extra_state.json")
                       .read_text())["data_source"]["source"]
    assert (state["epoch"], state["offset"]) == (1, 8)
    rows = row_ids(tmp_path / "run")
    assert sorted(rows[0]) == sorted(rows[1]) and rows[0] != rows[1]
