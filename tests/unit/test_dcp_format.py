"""dcp_format writes torch's Distributed Checkpoint without torch's package: its records are torch's, field for
field; its `.metadata` unpickles as the Metadata torch's own classes build; torch's reader loads its tensors bit
for bit; a conversion rank's start-up imports neither torch.distributed.checkpoint nor megatron-core.
(tests/integration/test_convert.py loads whole converted checkpoints into megatron-core's GPTModel.)"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata

from slimeflow.checkpoint import dcp_format
from slimeflow.checkpoint.dcp_format import (
    ByteItem,
    TensorChunk,
    Written,
    check_coverage,
    write_items,
    write_metadata,
)


def test_each_record_has_the_fields_of_the_torch_class_it_is_pickled_as():
    for record, (module, name) in dcp_format.TORCH_NAMES.items():
        torch_class = getattr(sys.modules[module], name)
        if record is dcp_format._MemFormatEncoding:
            assert torch_class(0) is metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
            continue
        assert [f.name for f in dataclasses.fields(record)] == [f.name for f in dataclasses.fields(torch_class)], name
    assert dcp_format.DCP_VERSION == filesystem.CURRENT_DCP_VERSION


def chunks() -> tuple[torch.Tensor, torch.Tensor, list[TensorChunk | ByteItem]]:
    """A [2, 5, 3] bf16 tensor as irregular row blocks of each layer (the layer axis prepended), one of them a
    strided view of a larger storage (which must be copied, not written whole); a whole fp32 tensor; an object."""
    stacked = torch.arange(30, dtype=torch.bfloat16).view(2, 5, 3)
    wide = torch.arange(12, dtype=torch.float32).view(3, 4)
    odd_view = stacked[1, 2:].t().contiguous().t()  # rows 2-4 of layer 1, column-major
    items = [TensorChunk("w", (2, 5, 3), (0, 0, 0), stacked[0, :2].clone().unsqueeze(0)),
             TensorChunk("w", (2, 5, 3), (0, 2, 0), stacked[0, 2:].clone().unsqueeze(0)),
             TensorChunk("w", (2, 5, 3), (1, 0, 0), stacked[1, :2].clone().unsqueeze(0)),
             TensorChunk("w", (2, 5, 3), (1, 2, 0), odd_view.unsqueeze(0)),
             TensorChunk("wide", (3, 4), (0, 0), torch.cat([wide, wide])[3:]),
             ByteItem("w._extra_state/shard_0_2", dcp_format.object_bytes(None))]
    return stacked, wide, items


def test_torch_reads_what_it_writes_and_its_metadata_is_what_torch_classes_build(tmp_path):
    stacked, wide, items = chunks()
    written = write_items(tmp_path / "__0_0.distcp", items[:3]) + write_items(tmp_path / "__1_0.distcp", items[3:])
    write_metadata(tmp_path, written)

    loaded = pickle.loads((tmp_path / ".metadata").read_bytes())
    properties = {dtype: metadata.TensorProperties(dtype=dtype) for dtype in (torch.bfloat16, torch.float32)}
    storage = {metadata.MetadataIndex(w.key, None if w.size is None else torch.Size(w.chunk_offsets)):
               filesystem._StorageInfo(w.file, w.offset, w.length) for w in written}
    expected = metadata.Metadata(
        state_dict_metadata={
            "w": metadata.TensorStorageMetadata(properties[torch.bfloat16], torch.Size([2, 5, 3]), [
                metadata.ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in
                [((0, 0, 0), (1, 2, 3)), ((0, 2, 0), (1, 3, 3)), ((1, 0, 0), (1, 2, 3)), ((1, 2, 0), (1, 3, 3))]]),
            "wide": metadata.TensorStorageMetadata(properties[torch.float32], torch.Size([3, 4]), [
                metadata.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4]))]),
            "w._extra_state/shard_0_2": metadata.BytesStorageMetadata()},
        storage_data=storage, storage_meta=loaded.storage_meta, version=filesystem.CURRENT_DCP_VERSION)
    assert loaded == expected
    assert [i.index for i in loaded.storage_data if i.fqn == "w"] == [0, 1, 2, 3]  # torch's hints: chunk positions
    assert isinstance(loaded.storage_meta, metadata.StorageMeta) and loaded.storage_meta.checkpoint_id == str(tmp_path)

    state = {"w": torch.zeros(2, 5, 3, dtype=torch.bfloat16), "wide": torch.zeros(3, 4)}
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(state["w"], stacked) and torch.equal(state["wide"], wide)
    extra = next(w for w in written if w.size is None)
    raw = (tmp_path / extra.file).read_bytes()[extra.offset:extra.offset + extra.length]
    assert torch.load(io.BytesIO(raw)) == [None]
    odd = next(w for w in written if w.chunk_offsets == (1, 2, 0))  # copied: its own 9 values, not the 30
    assert odd.length < written[0].length + 2 * 9


def test_a_tensor_with_a_source_is_copied_from_its_file_by_the_kernel(tmp_path):
    """The bytes come from the source (here deliberately not the tensor's own), into the hole torch.save left."""
    stored = torch.arange(4096, dtype=torch.float32).view(64, 64)
    (tmp_path / "hf.bin").write_bytes(b"x" * 100 + stored.numpy().tobytes())
    stand_in = torch.zeros(1, 64, 64)
    origin = {stand_in.data_ptr(): (tmp_path / "hf.bin", 100)}
    items = [ByteItem("o/shard_0_1", dcp_format.object_bytes(None)), TensorChunk("t", (1, 64, 64), (0, 0, 0), stand_in)]
    write_metadata(tmp_path, write_items(tmp_path / "__0_0.distcp", items, lambda t: origin.get(t.data_ptr())))
    state = {"t": torch.ones(1, 64, 64)}
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(state["t"][0], stored) and items == [None, None]  # consumed


def test_where_the_kernel_cannot_copy_between_the_files_the_bytes_go_through_the_process(tmp_path, monkeypatch):
    def cross_device(*_):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    (tmp_path / "src").write_bytes(bytes(range(256)) * 40)
    monkeypatch.setattr(dcp_format, "_BLOCK", 1000)  # several blocks
    monkeypatch.setattr(os, "copy_file_range", cross_device)
    with open(tmp_path / "dst", "wb") as out:
        out.write(b"head")
        dcp_format.copy_range(tmp_path / "src", 7, out.fileno(), 4, 5000)
    assert (tmp_path / "dst").read_bytes() == b"head" + (bytes(range(256)) * 40)[7:5007]


@pytest.mark.parametrize(("change", "says"), [
    (lambda w: w[:-1], "do not add up"),
    (lambda w: [*w, w[0]], "written twice"),
    (lambda w: [dataclasses.replace(w[0], chunk_offsets=(1, 4, 0)), *w[1:]], "outside"),
    (lambda w: [dataclasses.replace(w[0], dtype=torch.float16), *w[1:]], "disagree"),
])
def test_chunks_that_do_not_tile_their_tensor_are_refused(change, says):
    def chunk(offsets: tuple[int, ...], rows: int) -> Written:
        return Written("w", "__0_0.distcp", 0, 1, (2, 5, 3), torch.bfloat16, offsets, (1, rows, 3))

    good = [chunk((0, 0, 0), 2), chunk((0, 2, 0), 3), chunk((1, 0, 0), 5)]
    check_coverage(good)
    with pytest.raises(ValueError, match=says):
        check_coverage(change(good))


def test_a_conversion_rank_imports_neither_torch_checkpoint_nor_megatron():
    code = ("import sys; from slimeflow.checkpoint import worker\n"
            "print(sorted({m.split('.')[0] if m.startswith('megatron') else m for m in sys.modules\n"
            "              if m.startswith(('megatron', 'torch.distributed.checkpoint', 'wandb', 'pydantic'))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
