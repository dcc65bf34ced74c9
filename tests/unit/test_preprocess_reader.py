"""The prompt-parquet reader, the dedup index and token statistics (the stage through the CLI and the pipeline:
tests/integration/test_preprocess_under_prefect.py)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from preprocess_helpers import run_stage, write_jsonl

from slimeflow.io.prompts import PromptDataset, iter_prompts
from slimeflow.preprocess.tokens import TokenStats
from slimeflow.preprocess.writer import Deduper


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reader")
    rows = [{"input": f"question {i}", "label": str(i), "metadata": {"i": i, "tags": ["a", str(i)]}} for i in range(50)]
    source = write_jsonl(tmp / "a.jsonl", rows)
    manifest = run_stage(tmp, input=[str(source)], label_key="label", row_group_size=8)
    return rows, manifest.outputs["train"]


def test_reader_is_a_sequence_with_random_access_slices_and_negative_indices(written):
    rows, uri = written
    dataset = PromptDataset(uri)
    assert len(dataset) == 50
    for i in (0, 7, 8, 49, 23, 3):  # across row groups, out of order
        assert (dataset[i]["prompt"], dataset[i]["label"], dataset[i]["metadata"]) == (
            rows[i]["input"], rows[i]["label"], rows[i]["metadata"])
    assert dataset[-1] == dataset[49] and [d["label"] for d in dataset[5:12:3]] == ["5", "8", "11"]
    with pytest.raises(IndexError, match="out of range for 50 rows"):
        dataset[50]
    assert list(dataset) == list(iter_prompts(uri, batch_size=3)) == list(iter_prompts(f"{uri}/part-00000.parquet"))


def test_reader_rejects_a_parquet_that_is_not_a_prompt_parquet(tmp_path):
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"not a prompt parquet, it lacks \['row_id', 'label'"):
        PromptDataset(str(tmp_path / "other.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .parquet files"):
        PromptDataset(str(tmp_path / "empty"))


def test_dedup_index_matches_a_set_across_batches():
    rng = np.random.default_rng(0)
    deduper, seen = Deduper(), set()
    for _ in range(40):
        batch = rng.integers(0, 3000, size=rng.integers(1, 200)).astype(np.uint64)
        expected = []
        for value in batch.tolist():
            expected.append(value not in seen)
            seen.add(value)
        assert deduper.first_seen(batch).tolist() == expected
    assert sum(len(run) for run in deduper._runs) == len(seen)


def test_token_stats_are_exact_percentiles_and_a_histogram():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 3000, size=5000)
    stats = TokenStats()
    for chunk in np.array_split(lengths, 7):
        stats.add(chunk.tolist())
    summary = stats.summary()
    assert (summary["min"], summary["max"], summary["rows"]) == (lengths.min(), lengths.max(), 5000)
    assert summary["p50"] == int(np.percentile(lengths, 50, method="inverted_cdf"))
    assert summary["p99"] == int(np.percentile(lengths, 99, method="inverted_cdf"))
    assert summary["mean"] == round(float(lengths.mean()), 2)
    assert sum(summary["histogram"].values()) == 5000 and list(summary["histogram"])[-1] == "[2048, 4096)"


def test_jsonl_lines_longer_than_a_read_chunk_and_an_unterminated_last_line(tmp_path):
    from slimeflow.preprocess.sources import READ_CHUNK

    long = "y" * (READ_CHUNK + READ_CHUNK // 2)  # crosses two chunk boundaries
    source = tmp_path / "a.jsonl"
    source.write_bytes(b"\n".join([json.dumps({"input": "a"}).encode(), b"", json.dumps({"input": long}).encode(),
                                   b'{"input": "cut', json.dumps({"input": "b"}).encode(), b'{"input": "end']))
    manifest = run_stage(tmp_path, input=[str(source)])

    assert [d["prompt"] for d in PromptDataset(manifest.outputs["train"])] == ["a", long, "b"]
    records = [json.loads(line) for line in (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"], r["raw"]) for r in records] == [
        (4, "malformed_json", '{"input": "cut\n'), (6, "malformed_json", '{"input": "end')]
