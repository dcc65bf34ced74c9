"""Raw --prompt-data / --eval-prompt-data (JSONL, JSON, CSV, parquet; local or s3://) preprocessed by the train
stage itself with the preprocess stage's mapping and quarantine, cached by content; our prompt parquet untouched."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from preprocess_helpers import write_jsonl
from test_train_inputs import prompt_parquet

from slimeflow.config.train import TrainConfig
from slimeflow.errors import StageInputError
from slimeflow.io.prompts import PromptDataset
from slimeflow.io.storage import Storage
from slimeflow.preprocess.inline import is_raw
from slimeflow.rollout.data_source import DataSource
from slimeflow.rollout.raw_data import prepare_data
from slimeflow.stages.base import StageContext
from slimeflow.stages.train import stage

ROWS = [{"question": "1+1=", "answer": "2"}, {"question": "2+1=", "answer": "3"}, {"question": "3+1=", "answer": "4"}]


def train_config(prompt_data: str, evals: dict[str, str] | None = None, **data) -> TrainConfig:
    return TrainConfig.model_validate({
        "batch": {"rollout_batch_size": 1, "num_rollout": 1},
        "data": {"prompt_data": prompt_data, "input_key": "question", "label_key": "answer", **data},
        "eval": {"eval_prompt_data": evals or {}}})


def prompts(uri: str, storage: Storage | None = None) -> list[dict]:
    return list(PromptDataset(uri, storage))


def test_raw_or_ours_is_decided_by_content_not_by_the_suffix(tmp_path):
    storage = Storage()
    ours = prompt_parquet(tmp_path / "ours" / "part-00000.parquet", 2)
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), tmp_path / "raw.parquet")
    write_jsonl(tmp_path / "raw.jsonl", ROWS)
    write_jsonl(tmp_path / "rawdir" / "a.jsonl", ROWS)
    assert not is_raw(ours, storage) and not is_raw(str(tmp_path / "ours"), storage)
    write_jsonl(tmp_path / "ours" / "quarantine.jsonl", [{"reason": "missing_key"}])  # as the preprocess output root
    assert not is_raw(str(tmp_path / "ours"), storage)
    assert is_raw(str(tmp_path / "raw.parquet"), storage)
    assert is_raw(str(tmp_path / "raw.jsonl"), storage) and is_raw(str(tmp_path / "rawdir"), storage)
    assert is_raw(str(tmp_path / "*.jsonl"), storage)
    assert not is_raw(str(tmp_path / "missing.jsonl"), storage)  # the prompt-parquet check names it


def test_our_prompt_parquet_passes_through_untouched(tmp_path):
    ours = prompt_parquet(tmp_path / "train.parquet", 2)
    config = train_config(ours, {"eval": ours})
    prepared_config, prepared = prepare_data(config, Storage(), tmp_path / "work")
    assert prepared == {} and prepared_config == config
    assert not (tmp_path / "work" / "train" / "data").exists()


def test_a_csv_and_a_raw_parquet_become_prompt_parquet_with_the_bad_row_quarantined(tmp_path):
    with (tmp_path / "train.csv").open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["question", "answer", "source"])
        writer.writerows([["1+1=", "2", "a"], ["", "9", "b"], ["2+1=", "", "c"], ["3+1=", "4", "d"]])
    pq.write_table(pa.table({"question": ["5+1=", None], "answer": [6, 7]}), tmp_path / "eval.parquet")
    config = train_config(str(tmp_path / "train.csv"), {"held": str(tmp_path / "eval.parquet")})
    prepared_config, prepared = prepare_data(config, Storage(), tmp_path / "work")

    train = prompts(prepared_config.data.prompt_data)
    assert [(p["prompt"], p["label"], p["metadata"]) for p in train] == [("1+1=", "2", {"source": "a"}),
                                                                        ("3+1=", "4", {"source": "d"})]
    assert [(p["prompt"], p["label"]) for p in prompts(prepared_config.eval.eval_prompt_data["held"])] == [("5+1=", "6")]
    counts = prepared["data.train"].counts("data.train")
    assert counts["data.train.rows_in"] == 4 and counts["data.train.rows_out"] == 2
    assert counts["data.train.quarantined.missing_label"] == 1  # an empty CSV cell is null
    assert counts["data.train.quarantined.missing_key"] == 1 and counts["data.train.quarantined"] == 2
    quarantine = [json.loads(line) for line in
                  Path(prepared["data.eval.held"].manifest.outputs["quarantine"]).read_text().splitlines()]
    assert [(q["row"], q["reason"]) for q in quarantine] == [(2, "missing_key")]
    assert str(tmp_path / "work" / "train" / "data") in prepared_config.data.prompt_data


def test_a_rerun_reuses_the_prepared_set_and_a_changed_input_or_mapping_does_not(tmp_path):
    raw = write_jsonl(tmp_path / "raw.jsonl", ROWS)
    storage, work = Storage(), tmp_path / "work"
    first_config, first = prepare_data(train_config(str(raw)), storage, work)
    part = Path(first_config.data.prompt_data) / "part-00000.parquet"
    stamp = part.stat().st_mtime_ns
    again_config, again = prepare_data(train_config(str(raw)), storage, work)
    assert again["data.train"].reused and not first["data.train"].reused
    assert again_config == first_config and part.stat().st_mtime_ns == stamp  # nothing rewritten
    assert again["data.train"].manifest == first["data.train"].manifest

    remapped_config, _ = prepare_data(train_config(str(raw), metadata_key="meta"), storage, work)
    assert remapped_config.data.prompt_data != first_config.data.prompt_data  # another mapping, another set
    write_jsonl(raw, ROWS[:2])
    changed_config, changed = prepare_data(train_config(str(raw)), storage, work)
    assert not changed["data.train"].reused and changed_config.data.prompt_data != first_config.data.prompt_data
    assert len(prompts(changed_config.data.prompt_data)) == 2
    assert len(prompts(first_config.data.prompt_data)) == 3  # the earlier set stays what it was


def test_a_raw_set_on_s3_is_preprocessed(tmp_path, s3_config, s3_bucket):
    storage = Storage(s3_config)
    uri = f"{s3_bucket}/data/raw.jsonl"
    storage.write_text(uri, "".join(json.dumps(r) + "\n" for r in ROWS))
    prepared_config, prepared = prepare_data(train_config(uri), storage, tmp_path / "work")
    assert [p["prompt"] for p in prompts(prepared_config.data.prompt_data)] == ["1+1=", "2+1=", "3+1="]
    assert prepared["data.train"].source == uri
    storage.put_file(prompt_parquet(tmp_path / "ours.parquet", 2), f"{s3_bucket}/ours.parquet")
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), tmp_path / "raw.parquet")
    storage.put_file(tmp_path / "raw.parquet", f"{s3_bucket}/raw.parquet")
    assert not is_raw(f"{s3_bucket}/ours.parquet", storage) and is_raw(f"{s3_bucket}/raw.parquet", storage)


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_dict_labels_read_back_as_dicts(tmp_path, suffix):
    rows = [{"question": "Who?", "reward_model": {"ground_truth": {"target": ["Ada"]}, "style": "rule"}},
            {"question": "When?", "reward_model": {"ground_truth": {"target": ["1843"]}, "style": "rule"}}]
    path = tmp_path / f"search.{suffix}"
    if suffix == "jsonl":
        write_jsonl(path, rows)
    else:
        path.write_text(json.dumps(rows))
    prepared_config, _ = prepare_data(train_config(str(path), label_key="reward_model"), Storage(), tmp_path / "w")
    assert [p["label"] for p in prompts(prepared_config.data.prompt_data)] == [r["reward_model"] for r in rows]
    (group,) = DataSource.from_prompt_data(prepared_config.data.prompt_data, n_samples_per_prompt=2).get_groups(1)
    assert [s.label for s in group] == [rows[0]["reward_model"]] * 2 and group[0].label is not group[1].label


def test_a_raw_set_without_a_usable_row_stops_the_train_stage_before_ray_naming_its_quarantine(tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "init_ray", lambda address: pytest.fail("the train stage started Ray"))
    pq.write_table(pa.table({"prompt": ["1+1="]}), tmp_path / "other.parquet")  # no 'question' (--input-key)
    config = train_config(str(tmp_path / "other.parquet"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"hf_checkpoint": str(hf)})})
    with pytest.raises(StageInputError, match="no usable rows") as err:
        stage.run(config, StageContext(Storage(), tmp_path / "work", str(tmp_path / "out")))
    assert any("row 1: missing_key: no 'question' (--input-key)" in p for p in err.value.problems)
    kept = tmp_path / "work" / "train" / "data" / "preprocess" / "quarantine.jsonl"
    assert str(kept) in str(err.value) and json.loads(kept.read_text())["reason"] == "missing_key"
    assert not (tmp_path / "work" / "checkpoints").exists()


def test_evaluate_preprocesses_a_raw_eval_set_with_its_own_keys(tmp_path):
    from slimeflow.config.evaluate import EvaluateConfig
    from slimeflow.stages.evaluate.stage import _eval_sets

    raw = write_jsonl(tmp_path / "eval.jsonl", [*ROWS, {"question": None, "answer": "0"}])
    config = EvaluateConfig(eval_prompt_data={"raw": str(raw), "ours": prompt_parquet(tmp_path / "ours.parquet", 1)},
                            input_key="question", label_key="answer")
    sets, prepared = _eval_sets(config, StageContext(Storage(), tmp_path / "work", str(tmp_path / "out")))
    assert [(p["prompt"], p["label"]) for p in sets["raw"]] == [(r["question"], r["answer"]) for r in ROWS]
    assert len(sets["ours"]) == 1 and list(prepared) == ["data.eval.raw"]
    assert prepared["data.eval.raw"].counts("data.eval.raw")["data.eval.raw.quarantined.missing_key"] == 1
    assert str(tmp_path / "work" / "evaluate" / "data") in prepared["data.eval.raw"].prompt_data


def test_the_chat_template_and_the_length_filter_use_the_runs_hf_checkpoint(tmp_path):
    from transformers import AutoTokenizer

    from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

    hf = build_tiny_model(tmp_path / "qwen3", TinyModelSpec.from_uri("tiny:qwen3?seed=0"))
    tokenizer = AutoTokenizer.from_pretrained(hf)
    rows = [{"question": [{"role": "user", "content": "word " * n}], "answer": str(n)} for n in (1, 2, 40)]
    rendered = [tokenizer.apply_chat_template(r["question"], tokenize=False, add_generation_prompt=True) for r in rows]
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered]
    config = train_config(str(write_jsonl(tmp_path / "chat.jsonl", rows)), apply_chat_template=True,
                          rollout_max_prompt_len=lengths[1])
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"hf_checkpoint": str(hf)})})
    prepared_config, prepared = prepare_data(config, Storage(), tmp_path / "work")
    assert [p["prompt"] for p in prompts(prepared_config.data.prompt_data)] == rendered[:2]
    assert prepared["data.train"].counts("data.train")["data.train.filtered.too_long"] == 1
    assert prepared["data.train"].manifest.config["hf_checkpoint"] == str(hf)
