"""Megatron torch_dist checkpoint layout on a local directory and on S3 (moto), with fake checkpoint files."""

from __future__ import annotations

import logging

import pytest

from slimeflow.errors import CheckpointError
from slimeflow.io.checkpoints import (
    COMPLETE_MARKERS,
    TRACKER_FILENAME,
    CheckpointRef,
    Iteration,
    commit,
    find_latest,
    is_complete,
    iteration_dirname,
    list_checkpoints,
    missing_markers,
    parse_iteration_dirname,
    read_tracker,
    resolve,
)
from slimeflow.io.storage import Storage, join


@pytest.fixture(params=["local", "s3"])
def at(request, tmp_path) -> tuple[Storage, str]:
    """A Storage and a checkpoint root under it that does not exist yet."""
    if request.param == "local":
        return Storage(), str(tmp_path / "ckpt")
    return Storage(request.getfixturevalue("s3_config")), join(request.getfixturevalue("s3_bucket"), "ckpt")


def make_checkpoint(storage: Storage, root: str, iteration: Iteration, skip: tuple[str, ...] = ()) -> str:
    """Write a fake checkpoint directory: two shards and every marker not in `skip`; returns its URI."""
    uri = join(root, iteration_dirname(iteration))
    for name in ("__0_0.distcp", "__1_0.distcp", *COMPLETE_MARKERS):
        if name not in skip:
            storage.write_bytes(join(uri, name), f"{name}@{iteration}".encode())
    return uri


def ref(root: str, iteration: Iteration) -> CheckpointRef:
    return CheckpointRef(root=root, iteration=iteration, uri=join(root, iteration_dirname(iteration)))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "slimeflow.io.checkpoints"]


def test_iteration_dirnames():
    assert iteration_dirname(20) == "iter_0000020"
    assert iteration_dirname(0) == "iter_0000000"
    assert iteration_dirname(12_345_678) == "iter_12345678"
    assert iteration_dirname("release") == "release"
    for bad in (-1, True, "20", 2.0):
        with pytest.raises(ValueError, match="non-negative int or 'release'"):
            iteration_dirname(bad)
    assert parse_iteration_dirname("iter_0000020") == 20
    assert parse_iteration_dirname("iter_12345678") == 12_345_678
    assert parse_iteration_dirname("release") == "release"
    for bad in ("iter_20", "iter_00000020", "iter_0000020.tmp", "releases", TRACKER_FILENAME):
        assert parse_iteration_dirname(bad) is None


def test_commit_writes_the_tracker_only_for_complete_checkpoints(at):
    storage, root = at
    assert read_tracker(storage, root) is None
    make_checkpoint(storage, root, 10)
    make_checkpoint(storage, root, "release")

    assert commit(storage, root, 10) == ref(root, 10)
    assert read_tracker(storage, root) == 10
    assert storage.read_text(join(root, TRACKER_FILENAME)) == "10"  # what Megatron writes and reads
    assert commit(storage, root, "release") == ref(root, "release")
    assert storage.read_text(join(root, TRACKER_FILENAME)) == "release"
    assert find_latest(storage, root) == ref(root, "release")

    incomplete = make_checkpoint(storage, root, 20, skip=("common.pt",))
    assert missing_markers(storage, incomplete) == ["common.pt"] and not is_complete(storage, incomplete)
    with pytest.raises(CheckpointError, match=r"cannot commit .*iter_0000020: missing common.pt"):
        commit(storage, root, 20)
    with pytest.raises(CheckpointError, match=r"missing \.metadata, common\.pt, metadata\.json"):
        commit(storage, root, 30)  # no directory at all
    assert read_tracker(storage, root) == "release"
    files_at_root = [uri for uri in storage.list(root) if not storage.isdir(uri)]
    assert files_at_root == [join(root, TRACKER_FILENAME)]  # no temporary tracker left over


@pytest.mark.parametrize("content", ["iter_20\n", "-5", "²", ""])
def test_a_garbage_tracker_names_the_file_and_its_content(tmp_path, content):
    storage, root = Storage(), str(tmp_path)
    storage.write_text(join(root, TRACKER_FILENAME), content)
    with pytest.raises(CheckpointError) as info:
        read_tracker(storage, root)
    assert join(root, TRACKER_FILENAME) in str(info.value) and repr(content.strip()) in str(info.value)
    with pytest.raises(CheckpointError, match="expected an iteration number or 'release'"):
        find_latest(storage, root)


def test_list_checkpoints_orders_release_first_and_skips_the_rest(at):
    storage, root = at
    assert list_checkpoints(storage, root) == []  # root absent
    make_checkpoint(storage, root, 100)
    make_checkpoint(storage, root, 20)
    make_checkpoint(storage, root, "release")
    make_checkpoint(storage, root, 300, skip=(".metadata",))
    storage.write_text(join(root, "iter_20", "common.pt"), "not a Megatron name")
    storage.write_text(join(root, "notes", "README"), "not a checkpoint")
    storage.write_text(join(root, TRACKER_FILENAME), "100")

    assert list_checkpoints(storage, root) == [ref(root, "release"), ref(root, 20), ref(root, 100)]
    assert list_checkpoints(storage, root, include_incomplete=True)[-1] == ref(root, 300)


def test_find_latest_trusts_the_tracker_and_falls_back_with_a_warning(at, caplog):
    storage, root = at
    assert find_latest(storage, root) is None  # root absent
    make_checkpoint(storage, root, 30, skip=("metadata.json",))
    assert find_latest(storage, root) is None  # nothing complete
    make_checkpoint(storage, root, 10)
    make_checkpoint(storage, root, 20)

    commit(storage, root, 10)
    with caplog.at_level(logging.WARNING, logger="slimeflow.io.checkpoints"):
        assert find_latest(storage, root) == ref(root, 10)  # older, but it is the one the tracker names
        assert _warnings(caplog) == []

        storage.write_text(join(root, TRACKER_FILENAME), "30")  # as a crash between save and commit would
        assert find_latest(storage, root) == ref(root, 20)
        [warning] = _warnings(caplog)
        assert "lacks metadata.json" in warning and "iter_0000020" in warning

        caplog.clear()
        storage.remove(join(root, TRACKER_FILENAME))
        assert find_latest(storage, root) == ref(root, 20)
        [warning] = _warnings(caplog)
        assert f"no {TRACKER_FILENAME}" in warning


def test_resolve_accepts_roots_and_checkpoint_dirs(at):
    storage, root = at
    make_checkpoint(storage, root, 10)
    make_checkpoint(storage, root, "release")
    make_checkpoint(storage, root, 20, skip=("common.pt", ".metadata"))
    commit(storage, root, 10)

    assert resolve(storage, root) == ref(root, 10)
    assert resolve(storage, root + "/") == ref(root, 10)
    assert resolve(storage, join(root, "iter_0000010") + "/") == ref(root, 10)
    assert resolve(storage, join(root, "release")) == ref(root, "release")

    with pytest.raises(
        CheckpointError, match=r"iter_0000020 is not a complete checkpoint: missing \.metadata"
    ):
        resolve(storage, join(root, "iter_0000020"))
    with pytest.raises(CheckpointError, match=r"not a checkpoint: expected a checkpoint directory") as info:
        resolve(storage, join(root, "iter_0000010", "__0_0.distcp"))
    assert "__0_0.distcp" in str(info.value)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        resolve(storage, join(root, "no-such-dir"))
