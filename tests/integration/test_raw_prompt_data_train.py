"""The train stage on Ray trains on a raw JSONL it preprocesses itself and reports the quarantined row (the raw data
sets' reading, mapping and caching are in tests/unit/test_raw_prompt_data.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from preprocess_helpers import write_jsonl

from slimeflow.io.prompts import PromptDataset
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.stages.train import stage


@pytest.mark.slow
def test_train_on_a_raw_jsonl_trains_and_reports_the_quarantined_row(tmp_path, local_ray):
    from slimeflow.config.model import ModelConfig
    from slimeflow.config.pipeline import load_stage_config
    from slimeflow.stages.model.stage import run as model_run

    ctx = StageContext(Storage(), tmp_path / "work", str(tmp_path / "out"))
    hf = model_run(ModelConfig(hf_checkpoint="tiny:llama?seed=0&hidden_size=64&intermediate_size=128"),
                   ctx).outputs["hf_checkpoint"]
    raw = write_jsonl(tmp_path / "raw.jsonl", [{"question": f"{n}+1=", "answer": str((n + 1) % 10), "n": n}
                                               for n in range(6)])
    with raw.open("a") as out:
        out.write('{"question": "7+1=", "answer": \n')  # line 7: cut short
    config = load_stage_config("train", {
        "hf-checkpoint": hf, "prompt-data": str(raw), "input-key": "question", "label-key": "answer",
        "eval-prompt-data": {"same": str(raw)}, "eval-interval": 1, "eval-max-response-len": 1,
        "rollout-batch-size": 2, "n-samples-per-prompt": 2, "num-rollout": 2, "rollout-max-response-len": 1,
        "rm-type": "prefix_match", "lr": 1.0e-3})
    manifest = stage.run(config, ctx)

    assert manifest.counts["rollouts_run"] == 2
    assert manifest.counts["data.train.rows_in"] == 7 and manifest.counts["data.train.rows_out"] == 6
    assert manifest.counts["data.train.quarantined"] == manifest.counts["data.train.quarantined.malformed_json"] == 1
    quarantine = [json.loads(line) for line in Path(manifest.outputs["data.train.quarantine"]).read_text().splitlines()]
    assert [(q["file"], q["line"], q["reason"]) for q in quarantine] == [(str(raw), 7, "malformed_json")]
    assert manifest.outputs["data.train.source"] == str(raw)
    assert manifest.counts["data.eval.same.rows_out"] == 6 and "eval/same/avg_at_1" in manifest.facts["eval_last"]
    trained_on = {json.loads(line)["rollout_id"]: json.loads(line)["row_ids"]
                  for line in (ctx.workdir / "train" / "row_ids.jsonl").read_text().splitlines()}
    ids = [p["row_id"] for p in PromptDataset(manifest.outputs["data.train.prompt_data"])]
    assert trained_on == {0: ids[:2], 1: ids[2:4]}  # the prepared rows, in file order
