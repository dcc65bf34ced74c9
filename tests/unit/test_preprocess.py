"""The preprocess stage on real shapes of data: dapo-math JSONL, a Search-R1 table, CSV, parquet shards, s3."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from preprocess_helpers import messages, quarantine, reasons, run_stage, write_jsonl

from slimeflow.errors import StageInputError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.manifest import Manifest
from slimeflow.io.prompts import PromptDataset, iter_prompts
from slimeflow.io.storage import Storage

DAPO = [{"prompt": messages(f"Compute {a} * {a + 3}. Answer in \\boxed{{}}."), "label": str(a * (a + 3)),
         "metadata": {"source": "dapo", "level": a % 5}} for a in range(40)]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tok") / "qwen3", TinyModelSpec.from_uri("tiny:qwen3?seed=0"))


@pytest.fixture(scope="module")
def tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


def test_dapo_math_jsonl_round_trips_through_the_reader_exactly(tmp_path):
    source = write_jsonl(tmp_path / "dapo.jsonl", DAPO)
    manifest = run_stage(tmp_path, input=[str(source)], input_key="prompt", label_key="label")

    assert manifest.counts["rows_in"] == manifest.counts["rows_out"] == 40
    train = manifest.outputs["train"]
    assert pq.ParquetFile(f"{train}/part-00000.parquet").schema_arrow.metadata[b"slimeflow.prompt_format"] == b"messages"
    dataset = PromptDataset(train)
    got = [(d["prompt"], d["label"], d["metadata"]) for d in dataset]
    assert got == [(r["prompt"], r["label"], r["metadata"]) for r in DAPO]
    assert list(iter_prompts(train, batch_size=7)) == list(dataset)
    assert len({d["row_id"] for d in dataset}) == 40 and dataset[0]["tools"] is None


def test_chat_template_renders_and_counts_tokens_with_the_same_tokenizer(tmp_path, qwen_dir, tokenizer):
    source = write_jsonl(tmp_path / "dapo.jsonl", DAPO)
    manifest = run_stage(tmp_path, input=[str(source)], input_key="prompt", label_key="label",
                         apply_chat_template=True, hf_checkpoint=str(qwen_dir))

    table = pq.read_table(f"{manifest.outputs['train']}/part-00000.parquet")
    assert table.schema.metadata[b"slimeflow.prompt_format"] == b"text"
    expected = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in DAPO]
    assert table.column("prompt").to_pylist() == expected
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in expected]
    assert table.column("prompt_tokens").to_pylist() == lengths
    stats = manifest.facts["sets"]["train"]["prompt_tokens"]
    assert (stats["min"], stats["max"], stats["rows"]) == (min(lengths), max(lengths), 40)
    assert sum(stats["histogram"].values()) == 40
    assert [f.name for f in table.schema] == ["row_id", "prompt", "label", "metadata", "tools", "prompt_tokens"]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_token_counts_of_ascii_and_unicode_texts_are_the_tokenizers_own(tmp_path, family):
    """ASCII texts skip a Unicode-form normalizer (Qwen's NFC); texts that need it, mixed among them, keep it."""
    from transformers import AutoTokenizer

    from slimeflow.preprocess.tokens import PromptTokenizer

    model_dir = build_tiny_model(tmp_path / family, TinyModelSpec.from_uri(f"tiny:{family}?seed=0"))
    counter = PromptTokenizer(str(model_dir), need_template=False)
    reference = AutoTokenizer.from_pretrained(model_dir)
    assert (counter._ascii_encoder is not None) == (reference.backend_tokenizer.normalizer is not None)
    texts = ["plain ascii 1 + 2", "cafe\u0301 au lait", "", "e\u0301" * 5, "x = 3", "\u212b ngstro\u0308m", "ok"]
    texts = texts * 700  # more than one COUNT_CHUNK, unicode texts in each
    assert counter.count(texts) == [len(reference(t, add_special_tokens=False)["input_ids"]) for t in texts]
    composed = family == "qwen3"  # NFC makes e + U+0301 one 2-byte character: 2 byte tokens, not 3
    assert counter.count(["e\u0301", "ab"]) == [2 if composed else 3, 2]


def test_search_r1_table_packs_extra_columns_into_metadata_and_reports_collisions(tmp_path):
    rows = [{"question": f"Who wrote book {i}?", "final_answer": f"author {i}", "session_id": f"s{i}",
             "tool_code": f"search('book {i}')", "metadata": json.dumps({"split": "train"})} for i in range(6)]
    rows[4]["metadata"] = json.dumps({"session_id": "other"})  # collides with the session_id column
    rows[5]["metadata"] = json.dumps({"session_id": "s5"})  # same value: merged, not a collision
    path = tmp_path / "search_r1.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    manifest = run_stage(tmp_path, input=[str(path)], input_key="question", label_key="final_answer")

    assert reasons(quarantine(manifest)) == [("search_r1.parquet", 5, "metadata_collision")]
    assert "session_id" in quarantine(manifest)[0]["detail"]
    got = list(PromptDataset(manifest.outputs["train"]))
    assert [g["prompt"] for g in got] == [r["question"] for r in rows if r is not rows[4]]
    assert got[0]["metadata"] == {"split": "train", "session_id": "s0", "tool_code": "search('book 0')"}
    assert got[-1]["metadata"] == {"session_id": "s5", "tool_code": "search('book 5')"}
    assert manifest.facts["sets"]["train"]["packed_columns"] == {"session_id": 5, "tool_code": 5}

    kept = run_stage(tmp_path / "keep", input=[str(path)], input_key="question", label_key="final_answer",
                     drop_columns=["session_id"])
    assert kept.counts["rows_out"] == 6  # no collision once the column is dropped
    assert kept.facts["sets"]["train"]["dropped_columns"] == {"session_id": 6}
    only = run_stage(tmp_path / "only", input=[str(path)], input_key="question", metadata_key="none",
                     keep_columns=["tool_code"])
    assert PromptDataset(only.outputs["train"])[1]["metadata"] == {"tool_code": "search('book 1')"}


def test_csv_input_with_missing_labels_bad_rows_and_header_only_files(tmp_path):
    data = tmp_path / "csv"
    data.mkdir()
    (data / "qa.csv").write_bytes(
        b'question,answer,topic\n"What is 2+2?",4,math\n"Multi\nline?",yes,misc\nNo answer,,misc\n'
        b"too,many,fields,here\n\xff\xfe broken,1,x\nLast,5,math\n")
    (data / "header.csv").write_text("question,answer,topic\n")
    (data / "README.md").write_text("not data")
    manifest = run_stage(tmp_path, input=[str(data)], input_key="question", label_key="answer")

    assert reasons(quarantine(manifest)) == [
        ("header.csv", 1, "header_only_csv"), ("qa.csv", 5, "missing_label"), ("qa.csv", 6, "bad_csv_row"),
        ("qa.csv", 7, "invalid_utf8")]
    got = list(PromptDataset(manifest.outputs["train"]))
    assert [(g["prompt"], g["label"], g["metadata"]) for g in got] == [
        ("What is 2+2?", "4", {"topic": "math"}), ("Multi\nline?", "yes", {"topic": "misc"}),
        ("Last", "5", {"topic": "math"})]
    assert manifest.facts["sets"]["train"]["skipped_files"] == [str(data / "README.md")]

    kept = run_stage(tmp_path / "keep", input=[str(data / "qa.csv")], input_key="question", label_key="answer",
                     missing_label="keep")
    assert [g["label"] for g in PromptDataset(kept.outputs["train"])] == ["4", "yes", None, "5"]


def test_sharded_parquet_by_directory_and_glob_with_small_row_groups(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for shard in range(3):
        rows = [{"prompt": f"shard {shard} row {i}", "label": str(i), "score": i / 2} for i in range(7)]
        pq.write_table(pa.Table.from_pylist(rows), shards / f"part-{shard}.parquet")
    (shards / "_SUCCESS").write_text("")
    by_dir = run_stage(tmp_path / "a", input=[str(shards)], input_key="prompt", label_key="label",
                       row_group_size=4, read_batch_size=3)
    by_glob = run_stage(tmp_path / "b", input=[str(shards / "part-*.parquet")], input_key="prompt",
                        label_key="label", row_group_size=4)

    assert by_dir.counts["rows_out"] == by_glob.counts["rows_out"] == 21
    file = pq.ParquetFile(f"{by_dir.outputs['train']}/part-00000.parquet")
    assert [file.metadata.row_group(i).num_rows for i in range(file.num_row_groups)] == [4, 4, 4, 4, 4, 1]
    assert list(PromptDataset(by_dir.outputs["train"])) == list(PromptDataset(by_glob.outputs["train"]))
    assert [f["path"] for f in by_dir.facts["sets"]["train"]["inputs"]] == [
        str(shards / f"part-{i}.parquet") for i in range(3)]
    assert PromptDataset(by_dir.outputs["train"])[8]["metadata"] == {"score": 0.5}


def test_s3_input_and_output_on_the_moto_server(tmp_path, s3_config, s3_bucket):
    storage = Storage(s3_config)
    body = "".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(12))
    storage.write_bytes(f"{s3_bucket}/raw/a.jsonl.gz", gzip.compress(body.encode()))
    storage.write_text(f"{s3_bucket}/raw/eval.json", json.dumps([{"input": "e1", "label": "1"}, 7]))
    manifest = run_stage(tmp_path, storage, input=[f"{s3_bucket}/raw/*.jsonl.gz"], eval_input={"aime": f"{s3_bucket}/raw/eval.json"},
                         output=f"{s3_bucket}/prompts", label_key="label")

    assert manifest.outputs["train"] == f"{s3_bucket}/prompts/train"
    train = PromptDataset(manifest.outputs["train"], storage)
    assert [d["prompt"] for d in train] == [f"q{i}" for i in range(12)]
    assert [d["prompt"] for d in iter_prompts(manifest.outputs["eval.aime"], storage=storage)] == ["e1"]
    assert reasons(quarantine(manifest, storage)) == [("eval.json", 2, "wrong_type")]
    on_s3 = json.loads(storage.read_text(f"{s3_bucket}/prompts/manifest.json"))
    assert on_s3["counts"] == manifest.counts and manifest.facts["sets"]["aime"]["inputs"][0]["size"] > 0


def test_every_bad_input_lands_in_the_quarantine_with_file_line_and_reason(tmp_path):
    bad = tmp_path / "in"
    write_jsonl(bad / "a.jsonl", [{"prompt": "ok 1", "label": "1"}])
    with (bad / "a.jsonl").open("ab") as f:
        f.write(b'{"prompt": "cut off\n')                          # line 2
        f.write(b'{"prompt": "caf\xe9", "label": "1"}\n')          # line 3: latin-1, not UTF-8
        f.write(b'{"question": "no prompt key", "label": "1"}\n')  # line 4
        f.write(b'{"prompt": 42, "label": "1"}\n')                 # line 5
        f.write(b'["an", "array"]\n\n')                            # line 6, then a blank line (not a row)
        f.write(b'{"prompt": "ok 2", "label": {"a": 1}}\n')        # line 8: an object label among strings
        f.write(b'{"prompt": "ok 3", "label": "3", "metadata": "not json"}\n')  # line 9
        f.write(b'{"prompt": "ok 4", "label": "4"}\n')
    (bad / "b.jsonl").write_bytes(b"")
    (bad / "c.json").write_text('[{"prompt": "x"')
    (bad / "d.jsonl.gz").write_bytes(b"not gzip at all")
    manifest = run_stage(tmp_path, input=[str(bad)], label_key="label", input_key="prompt")

    assert reasons(quarantine(manifest)) == [
        ("a.jsonl", 2, "malformed_json"), ("a.jsonl", 3, "invalid_utf8"), ("a.jsonl", 4, "missing_key"),
        ("a.jsonl", 5, "wrong_type"), ("a.jsonl", 6, "wrong_type"), ("a.jsonl", 8, "mixed_label_format"),
        ("a.jsonl", 9, "wrong_type"), ("b.jsonl", 0, "empty_file"), ("c.json", 0, "malformed_json"),
        ("d.jsonl.gz", 0, "unreadable_file")]
    assert [d["prompt"] for d in PromptDataset(manifest.outputs["train"])] == ["ok 1", "ok 4"]
    records = quarantine(manifest)
    assert records[0]["raw"].startswith('{"prompt": "cut off') and records[2]["raw"] == '{"question":"no prompt key","label":"1"}'


def test_a_dangling_symlink_in_an_input_directory_is_quarantined_not_fatal(tmp_path):
    source = write_jsonl(tmp_path / "in" / "a.jsonl", [{"prompt": "ok", "label": "1"}])
    (source.parent / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    manifest = run_stage(tmp_path, input=[str(source.parent)], input_key="prompt", label_key="label")
    assert reasons(quarantine(manifest)) == [("b.jsonl", 0, "unreadable_file")]
    assert quarantine(manifest)[0]["detail"].startswith(f"a dangling symlink to {tmp_path / 'gone.jsonl'}")
    assert manifest.counts["quarantined.unreadable_file"] == 1 and manifest.counts["rows_out"] == 1


def test_strict_mode_fails_on_the_first_problem_naming_file_and_line(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "fine"}, {"prompt": ""}, {"prompt": None}, "x"])
    with pytest.raises(StageInputError, match=r"a\.jsonl line 3: missing_key") as err:
        run_stage(tmp_path, input=[str(source)], input_key="prompt", strict=True)
    assert "without --strict" in str(err.value)


def test_inputs_that_are_entirely_bad_fail_with_a_summary(tmp_path):
    source = write_jsonl(tmp_path / "bad.jsonl", [{"q": "no key"}, {"prompt": " "}])
    (tmp_path / "bad.jsonl").open("a").write("{oops\n")
    with pytest.raises(StageInputError) as err:
        run_stage(tmp_path, input=[str(source)], input_key="prompt")
    message = str(err.value)
    assert "train: 3 rows in, 0 out" in message and "quarantined.missing_key 1" in message
    assert "filtered.empty_prompt 1" in message and "bad.jsonl line 3: malformed_json" in message
    kept = tmp_path / "work" / "preprocess" / "quarantine.jsonl"  # the file the message names outlives the stage
    assert f"The quarantine {kept} lists every bad row" in message
    assert [(r["line"], r["reason"]) for r in map(json.loads, kept.read_text().splitlines())] == \
        [(1, "missing_key"), (3, "malformed_json")]
    with pytest.raises(StageInputError, match="no such file"):
        run_stage(tmp_path, input=[str(tmp_path / "missing.jsonl")])
    with pytest.raises(StageInputError, match="need a tokenizer"):
        run_stage(tmp_path, input=[str(source)], rollout_max_prompt_len=5)


def test_length_empty_and_duplicate_filters(tmp_path, qwen_dir):
    rows = [{"prompt": "short", "label": "1"}, {"prompt": "x" * 300, "label": "2"}, {"prompt": "", "label": "3"},
            {"prompt": "short", "label": "4"}, {"prompt": [], "label": "5"}, {"prompt": "other", "label": "6"}]
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "other", "label": "7"}])
    manifest = run_stage(tmp_path, input=[str(a), str(b)], input_key="prompt", label_key="label",
                         hf_checkpoint=str(qwen_dir), rollout_max_prompt_len=100)

    counts = manifest.counts
    assert (counts["filtered.too_long"], counts["filtered.empty_prompt"], counts["filtered.duplicate_prompt"]) == (1, 2, 2)
    got = list(PromptDataset(manifest.outputs["train"]))
    assert [(g["prompt"], g["label"]) for g in got] == [("short", "1"), ("other", "6")]
    assert pq.read_table(f"{manifest.outputs['train']}/part-00000.parquet").column("prompt_tokens").to_pylist() == [5, 5]
    no_dedup = run_stage(tmp_path / "d", input=[str(a), str(b)], input_key="prompt", dedup=False)
    assert no_dedup.counts["rows_out"] == 5 and "filtered.duplicate_prompt" not in no_dedup.counts


@pytest.mark.parametrize("limit", [None, 100])
def test_batches_counted_while_the_next_is_read_give_what_one_batch_gives(tmp_path, qwen_dir, tokenizer, limit):
    prompts = ["a", "x" * 300, "b", "x" * 300, "a", "c", "b", "y" * 200, "d", "c", "y" * 200]
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "label": str(i)} for i, p in enumerate(prompts)])
    common = {"input": [str(source)], "input_key": "prompt", "label_key": "label", "hf_checkpoint": str(qwen_dir),
              "rollout_max_prompt_len": limit}
    whole = run_stage(tmp_path / "whole", **common)
    batched = run_stage(tmp_path / "batched", read_batch_size=2, **common)

    assert batched.counts == whole.counts
    counts = whole.counts  # a too-long copy counts as too long, not as a duplicate
    assert (counts.get("filtered.too_long", 0), counts["filtered.duplicate_prompt"]) == ((4, 3) if limit else (0, 5))
    tables = [pq.read_table(f"{m.outputs['train']}/part-00000.parquet") for m in (whole, batched)]
    assert tables[0].equals(tables[1])
    expected = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in tables[1].column("prompt").to_pylist()]
    assert tables[1].column("prompt_tokens").to_pylist() == expected


def test_tools_are_stored_and_rendered_by_the_template(tmp_path, qwen_dir):
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    rows = [{"input": messages("Find it."), "tools": [tool]}, {"input": messages("No tools."), "tools": None}]
    source = write_jsonl(tmp_path / "t.jsonl", rows)
    manifest = run_stage(tmp_path, input=[str(source)], tool_key="tools", apply_chat_template=True,
                         hf_checkpoint=str(qwen_dir))

    got = list(PromptDataset(manifest.outputs["train"]))
    assert got[0]["tools"] == [tool] and got[1]["tools"] is None
    assert '"name": "search"' in got[0]["prompt"] and "<tools>" not in got[1]["prompt"]


def test_seeded_shuffle_and_held_out_split_are_deterministic_and_lose_nothing(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", [{"input": f"q{i}", "n": i} for i in range(200)])
    common = {"input": [str(source)], "row_group_size": 16, "read_batch_size": 50}
    plain = run_stage(tmp_path / "plain", **common)
    first = run_stage(tmp_path / "s1", shuffle=True, data_seed=3, eval_split_fraction=0.25, **common)
    again = run_stage(tmp_path / "s2", shuffle=True, data_seed=3, eval_split_fraction=0.25, **common)
    other = run_stage(tmp_path / "s3", shuffle=True, data_seed=4, **common)

    def prompts(uri):
        return [d["prompt"] for d in PromptDataset(uri)]

    train, held = prompts(first.outputs["train"]), prompts(first.outputs["eval.heldout"])
    assert train == prompts(again.outputs["train"]) and held == prompts(again.outputs["eval.heldout"])
    assert sorted(train + held) == sorted(prompts(plain.outputs["train"])) and not set(train) & set(held)
    assert 25 <= len(held) <= 75 and first.facts["sets"]["train"]["outputs"] == {"train": len(train), "heldout": len(held)}
    assert prompts(other.outputs["train"]) != prompts(plain.outputs["train"])
    assert sorted(prompts(other.outputs["train"])) == sorted(prompts(plain.outputs["train"]))


@pytest.mark.parametrize("names", [{"eval_input": {"../../escaped": "IN"}}, {"eval_split_name": "../up"}])
def test_a_set_name_that_would_leave_the_output_is_refused(tmp_path, names):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}", "label": "l"} for i in range(20)])
    names = {k: {n: str(source) for n in v} if isinstance(v, dict) else v for k, v in names.items()}
    with pytest.raises(StageInputError, match=r"--eval-input / --eval-split-name[\s\S]*'\.\./"):
        run_stage(tmp_path, input=[str(source)], input_key="prompt", eval_split_fraction=0.5, **names)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "out").exists()


_DYING_PREPROCESS = """
import json, os, signal, sys
from pathlib import Path
from slimeflow.io.storage import S3Config, Storage
from slimeflow.stages.base import StageContext
from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.stages.preprocess.stage import run

args = json.loads(sys.argv[1])

class Dying(Storage):  # SIGKILLs its own process when the quarantine upload starts: the parts are in place
    def put_file(self, local_path, uri):
        if uri.endswith("/quarantine.jsonl"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().put_file(local_path, uri)

run(PreprocessConfig(**args["config"]), StageContext(Dying(S3Config(**args["s3"])), Path(args["work"]), args["work"]))
"""


def test_a_run_killed_while_uploading_to_s3_leaves_no_manifest_describing_other_parts(tmp_path, s3_config, s3_bucket):
    import subprocess
    import sys

    storage, output = Storage(s3_config), f"{s3_bucket}/prompts"
    small, large = write_jsonl(tmp_path / "small.jsonl", DAPO[:20]), write_jsonl(tmp_path / "large.jsonl", DAPO)
    keys = {"input_key": "prompt", "label_key": "label"}
    run_stage(tmp_path, storage, input=[str(small)], eval_input={"aime": str(small)}, output=output, **keys)
    s3 = {"endpoint_url": s3_config.endpoint_url, "access_key_id": s3_config.access_key_id,
          "secret_access_key": s3_config.secret_access_key.get_secret_value(), "region": s3_config.region}
    args = {"s3": s3, "config": {"input": [str(large)], "output": output, **keys}, "work": str(tmp_path / "killed")}
    done = subprocess.run([sys.executable, "-c", _DYING_PREPROCESS, json.dumps(args)], capture_output=True, timeout=60)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    if storage.exists(f"{output}/manifest.json"):  # a manifest left behind must describe exactly what is there
        left = Manifest.model_validate_json(storage.read_text(f"{output}/manifest.json"))
        storage.verify_tree(output, left.artifacts)
    assert len(PromptDataset(f"{output}/train", storage)) == 40  # the new part is whole (atomic object)
    again = run_stage(tmp_path, storage, input=[str(large)], output=output, **keys)
    storage.verify_tree(output, again.artifacts)
    assert not storage.exists(f"{output}/eval/aime")  # the earlier run's set, no longer asked for, is gone
    assert sorted(r.path for r in again.artifacts) == ["quarantine.jsonl", "train/part-00000.parquet"]


_DYING_WHILE_STAGING = """
import json, os, signal, sys
from pathlib import Path
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.stages.preprocess.stage import run

args = json.loads(sys.argv[1])

class Dying(Storage):  # SIGKILLs its own process when it fingerprints the input: the staging directory exists
    def sha256(self, uri):
        os.kill(os.getpid(), signal.SIGKILL)

run(PreprocessConfig(**args["config"]), StageContext(Dying(), Path(args["work"]), args["work"]))
"""


def test_the_staging_left_by_a_killed_run_is_removed_by_the_next_and_a_live_runs_is_kept(tmp_path):
    import subprocess
    import sys

    work, source = tmp_path / "work", write_jsonl(tmp_path / "in.jsonl", DAPO[:5])
    config = {"input": [str(source)], "input_key": "prompt", "output": str(tmp_path / "out")}
    args = {"config": config, "work": str(work)}
    done = subprocess.run([sys.executable, "-c", _DYING_WHILE_STAGING, json.dumps(args)], capture_output=True, timeout=60)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert len([p for p in work.iterdir() if p.name.startswith("preprocess-")]) == 1  # the killed run's
    (work / "preprocess-notes").mkdir()  # not a name we create
    (work / "preprocess-abcdefgh").mkdir()  # our name, no lock yet: a run creating it right now
    run_stage(tmp_path, input_key="prompt", input=[str(source)])
    assert sorted(p.name for p in work.iterdir()) == ["preprocess-abcdefgh", "preprocess-notes"]
    from slimeflow.io.guard import claimed_scratch
    from slimeflow.preprocess.pipeline import STAGING_PREFIX

    with claimed_scratch(work, STAGING_PREFIX) as live:  # a concurrent run, alive while this one runs
        run_stage(tmp_path, input_key="prompt", input=[str(source)])
        assert live.is_dir()
    assert not live.exists()
