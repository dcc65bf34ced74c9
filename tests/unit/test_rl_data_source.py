"""Data source and buffer: exact positions across restarts and epochs, the prompt-parquet contract, partial groups."""

from __future__ import annotations

import json

import pytest
from preprocess_helpers import messages, run_stage, write_jsonl

from slimeflow.rollout.data_source import START_ROLLOUT_ID, BufferedDataSource, DataSource, pop_first
from slimeflow.rollout.types import Sample, Status

PROMPTS = [{"prompt": f"question {i}", "label": str(i), "metadata": {"rm_type": "math"}, "row_id": f"r{i}"}
           for i in range(7)]


def signature(groups: list[list[Sample]]) -> list[tuple]:
    return [(g[0].group_index, g[0].prompt, tuple(s.index for s in g)) for g in groups]


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_restore_after_k_rollouts_reproduces_the_next_groups(shuffle, k):
    """3 groups per rollout over 7 prompts: rollouts 2 and 3 cross the epoch boundaries."""
    uninterrupted = DataSource(PROMPTS, n_samples_per_prompt=2, shuffle=shuffle, seed=5)
    expected = [signature(uninterrupted.get_groups(3)) for _ in range(6)]
    first = DataSource(PROMPTS, n_samples_per_prompt=2, shuffle=shuffle, seed=5)
    for _ in range(k):
        first.get_groups(3)
    state = json.loads(json.dumps(first.state_dict()))  # it survives a JSON round trip, as checkpoints store it
    resumed = DataSource(PROMPTS, n_samples_per_prompt=2, shuffle=shuffle, seed=5)
    resumed.load_state_dict(state)
    assert [signature(resumed.get_groups(3)) for _ in range(6 - k)] == expected[k:]


def test_epochs_cover_every_prompt_and_shuffle_changes_per_epoch():
    source = DataSource(PROMPTS, shuffle=True, seed=1)
    epochs = [[g[0].prompt for g in source.get_groups(7)] for _ in range(3)]
    assert all(sorted(e) == sorted(p["prompt"] for p in PROMPTS) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1
    in_order = DataSource(PROMPTS)
    assert [g[0].prompt for g in in_order.get_groups(9)] == [p["prompt"] for p in PROMPTS + PROMPTS[:2]]
    assert in_order.state_dict()["epoch"] == 1


def test_groups_hold_independent_copies_with_running_indices():
    source = DataSource([{"prompt": [{"role": "user", "content": "hi"}], "metadata": '{"a": 1}',
                          "tools": [{"name": "calc"}]}], n_samples_per_prompt=3)
    (group,) = source.get_groups(1)
    assert [s.index for s in group] == [0, 1, 2] and {s.group_index for s in group} == {0}
    group[0].metadata["a"] = 2
    group[0].prompt[0]["content"] = "changed"
    assert group[1].metadata == {"a": 1, "tools": [{"name": "calc"}]}
    assert group[1].prompt[0]["content"] == "hi"
    assert group[0].status is Status.PENDING
    (flat,) = DataSource(PROMPTS[:1], n_samples_per_prompt=2).get_groups(1)  # flat metadata: the shallow-copy path
    flat[0].metadata["rm_type"] = "changed"
    assert flat[1].metadata["rm_type"] == "math" and flat[0].metadata is not flat[1].metadata


def test_reads_the_prompt_parquet_that_the_preprocess_stage_writes(tmp_path):
    """preprocess -> parquet -> DataSource: the same prompts (messages stay messages), labels, metadata and tools."""
    rows = [{"prompt": messages(f"{i} + {i} = ?"), "label": str(2 * i), "session_id": f"s{i}",
             "tools": [{"name": "calc", "parameters": {}}] if i % 2 else None, "row_id": f"own-{i}"}
            for i in range(5)]
    write_jsonl(tmp_path / "raw.jsonl", rows)
    manifest = run_stage(tmp_path, input=[str(tmp_path / "raw.jsonl")], input_key="prompt", label_key="label",
                         tool_key="tools", row_group_size=2)
    source = DataSource.from_prompt_data(manifest.outputs["train"], n_samples_per_prompt=2)
    groups = source.get_groups(5)
    assert [g[0].prompt for g in groups] == [r["prompt"] for r in rows]
    assert [g[0].label for g in groups] == [r["label"] for r in rows]
    for group, row in zip(groups, rows, strict=True):
        assert len(group) == 2 and group[0].metadata == group[1].metadata
        assert group[0].metadata["session_id"] == row["session_id"]
        assert group[0].metadata.get("tools") == row["tools"]
        assert group[0].metadata["row_id"] == row["row_id"]  # the source's own row_id column is kept


def test_a_tools_column_that_contradicts_the_metadata_is_refused():
    item = {"prompt": "x", "metadata": {"tools": [{"name": "a"}]}, "tools": [{"name": "b"}]}
    with pytest.raises(ValueError, match="row 0: its metadata already has a 'tools' entry"):
        DataSource([item]).get_groups(1)
    same = {"prompt": "x", "metadata": {"tools": [{"name": "a"}]}, "tools": [{"name": "a"}]}
    assert DataSource([same]).get_groups(1)[0][0].metadata == {"tools": [{"name": "a"}]}


def test_bad_inputs_say_what_and_where():
    with pytest.raises(ValueError, match="empty"):
        DataSource([])
    with pytest.raises(ValueError, match="row 1 has no 'prompt'"):
        DataSource([{"prompt": "x"}, {"question": "y"}]).get_groups(2)
    with pytest.raises(ValueError, match="row 0: metadata is not valid JSON"):
        DataSource([{"prompt": "x", "metadata": "{oops"}]).get_groups(1)
    state = DataSource(PROMPTS).state_dict()
    with pytest.raises(ValueError, match="saved over 7 prompts but this dataset has 2"):
        DataSource(PROMPTS[:2]).load_state_dict(state)


def test_buffer_returns_partial_groups_first_and_keeps_the_first_rollout_id():
    source = BufferedDataSource(DataSource(PROMPTS, n_samples_per_prompt=2))
    first = source.get_groups(3)
    partial = first[1]
    for sample in partial:
        sample.status, sample.response = Status.ABORTED, "half an ans"
    source.add_groups([partial], rollout_id=4)
    source.add_groups([partial], rollout_id=5)  # aborted again: the first rollout id stays
    assert len(source) == 2
    again = source.get_groups(3)
    assert again[0] is not partial and again[0][0].response == "half an ans"
    assert [s.metadata[START_ROLLOUT_ID] for s in again[0]] == [4, 4]
    assert [g[0].prompt for g in again] == ["question 1", "question 1", "question 3"]
    assert len(source) == 0


def test_buffer_state_round_trip_and_custom_filter():
    def pop_last(buffer, num_groups):
        taken = buffer[-num_groups:][::-1]  # newest first
        del buffer[-num_groups:]
        return taken

    source = BufferedDataSource(DataSource(PROMPTS), buffer_filter=pop_last)
    groups = source.get_groups(3)
    source.add_groups(groups[:2], rollout_id=0)
    state = json.loads(json.dumps(source.state_dict()))
    restored = BufferedDataSource(DataSource(PROMPTS), buffer_filter=pop_last)
    restored.load_state_dict(state)
    assert [g[0].prompt for g in restored.get_groups(2)] == ["question 1", "question 0"]
    assert [g[0].prompt for g in restored.get_groups(1)] == ["question 3"]
    assert pop_first([[1], [2], [3]], 2) == [[1], [2]]


def test_failed_samples_cannot_be_put_back():
    source = BufferedDataSource(DataSource(PROMPTS))
    (group,) = source.get_groups(1)
    group[0].mark_failed("reward raised")
    with pytest.raises(ValueError, match="reward raised"):
        source.add_groups([group], rollout_id=0)
