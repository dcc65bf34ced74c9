"""integrity.Ledger: a save's files hashed while they are written, so that write_checksums reads none back."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from slimeflow.checkpoint import integrity
from slimeflow.checkpoint.integrity import CHECKSUMS, Ledger, write_checksums
from slimeflow.io.storage import Storage


def test_a_file_written_through_the_ledger_is_recorded_with_the_sha256_of_its_bytes_and_fsynced(tmp_path, monkeypatch):
    fsynced = []
    monkeypatch.setattr(integrity.os, "fsync", lambda fd: fsynced.append(fd))
    ledger, path = Ledger(), tmp_path / "state.pt"
    big = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB: hashed in the thread beside the write
    with ledger.open(path) as file:
        torch.save({"big": big, "small": torch.ones(3)}, file)
    data = path.read_bytes()
    record = ledger.get(path)
    assert (record.sha256, record.size) == (hashlib.sha256(data).hexdigest(), len(data)) and len(data) > 2 << 20
    assert len(fsynced) == 1
    assert torch.equal(torch.load(path, weights_only=True)["big"], big)


def test_write_checksums_takes_the_ledgers_records_and_hashes_only_the_rest_from_disk(tmp_path, monkeypatch):
    ledger = Ledger()
    with ledger.open(tmp_path / "a.distcp") as file:
        file.write(b"a" * 100)
    with ledger.open(tmp_path / "grown.bin") as file:
        file.write(b"b" * 10)
    with (tmp_path / "grown.bin").open("ab") as file:  # changed after it was recorded: its size tells
        file.write(b"more")
    (tmp_path / "plain.json").write_text("{}")
    read_back = []
    real = Storage.sha256
    monkeypatch.setattr(Storage, "sha256", lambda self, uri: read_back.append(uri) or real(self, uri))
    records = {r.path: r for r in write_checksums(tmp_path, ledger)}
    assert sorted(read_back) == [str(tmp_path / "grown.bin"), str(tmp_path / "plain.json")]
    for name in ("a.distcp", "grown.bin", "plain.json"):
        assert records[name].sha256 == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest(), name
    assert json.loads((tmp_path / CHECKSUMS).read_text())["files"] == [r.model_dump() for r in records.values()]


def test_a_failed_write_records_nothing(tmp_path):
    ledger = Ledger()
    with pytest.raises(OSError), ledger.open(tmp_path / "x") as file:
        file.write(b"partial")
        raise OSError("disk full")
    assert ledger.get(tmp_path / "x") is None

