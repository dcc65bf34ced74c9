"""examples/search-r1 trained on Ray: three rollouts of the example's multi-turn generate with its loss masks (the
example's plug-ins themselves are in tests/unit/test_example_search_r1.py)."""

from __future__ import annotations

import json

import pytest
import yaml
from paths import ROOT
from train_helpers import run_stage, with_debug

EXAMPLE = ROOT / "examples" / "search-r1"


@pytest.mark.slow
def test_the_example_trains_three_rollouts_with_multi_turn_loss_masks(tmp_path, monkeypatch, local_ray):
    import torch
    from transformers import AutoTokenizer

    from slimeflow.config.pipeline import load_pipeline_config
    from slimeflow.flows import wiring
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext
    from slimeflow.stages.model.stage import run as model_run
    from slimeflow.stages.preprocess.stage import run as preprocess_run

    monkeypatch.syspath_prepend(str(EXAMPLE))  # the driver imports the example's plug-ins too (its workers: local_ray)
    monkeypatch.chdir(EXAMPLE.parent.parent)  # the config's data paths are relative to the repository, as run.sh
    data = yaml.safe_load((EXAMPLE / "search-r1.yaml").read_text())
    data["train"].update({"num-rollout": 3, "rollout-batch-size": 2, "n-samples-per-prompt": 2, "eval-interval": None,
                          "rollout-max-response-len": 200})
    config = load_pipeline_config(data)
    ctx = StageContext(Storage(), tmp_path, str(tmp_path))
    m = {"model": model_run(config.model, ctx).model_dump(mode="json")}
    m["preprocess"] = preprocess_run(wiring.preprocess(config.preprocess, m), ctx).model_dump(mode="json")
    template = str(tmp_path / "debug" / "rollout_{rollout_id}.pt")
    train = with_debug(wiring.train(config.train, m), save_debug_rollout_data=template)
    records, _, _ = run_stage(train, tmp_path / "run", monkeypatch)
    assert [r["step"] for r in records] == [0, 1, 2]

    import generate_with_search as example

    tokenizer = AutoTokenizer.from_pretrained(m["model"]["outputs"]["hf_checkpoint"])
    note = tokenizer(example.INVALID, add_special_tokens=False)["input_ids"]
    multi_turn = total = 0
    for rollout_id in range(3):
        for s in torch.load(template.format(rollout_id=rollout_id), weights_only=True)["samples"]:
            # The Search-R1 columns that are neither prompt nor label came through preprocess as metadata.
            assert s["metadata"]["golden_answers"] == s["label"]["ground_truth"]["target"]
            assert s["metadata"]["data_source"] == "searchr1_lite" and "question" in s["metadata"]
            assert s["reward"] == example.exact_match(s["response"], s["label"]["ground_truth"]["target"])
            mask, logps = s["loss_mask"], s["rollout_log_probs"]
            response = s["tokens"][len(s["tokens"]) - s["response_length"]:]
            assert len(mask) == len(logps) == len(response) == s["response_length"] and mask[0] == 1
            # Runs of the mask: model turns (1, the engine's log-probs) and the environment's text between them
            # (0: the invalid-action note or retrieved passages, exactly as the generate function appended them).
            runs, start = [], 0
            for i in range(1, len(mask) + 1):
                if i == len(mask) or mask[i] != mask[start]:
                    runs.append((mask[start], response[start:i], logps[start:i]))
                    start = i
            for trains, tokens, lp in runs:
                if trains:
                    assert len(tokens) <= example.TURN_TOKENS and all(v < 0 for v in lp)
                else:
                    assert lp == [0.0] * len(tokens)
                    assert tokens == note or tokenizer.decode(tokens).startswith("\n\n<information>Doc 1(Title: ")
            multi_turn += len(runs) == 3
            total += 1
    # The tiny random model writes no action: every trajectory has a second turn after the note.
    assert total == 3 * 2 * 2 and multi_turn == total, (multi_turn, total)
    rows = [json.loads(line) for line in (tmp_path / "run" / "train" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 3
