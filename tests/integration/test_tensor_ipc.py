"""SGLang's /update_weights_from_tensor body (slimeflow/engine/tensor_ipc.py): what the trainer sends decodes in
another process as SGLang's documented steps decode it (MultiprocessingSerializer.deserialize, then
FlattenedTensorBucket.reconstruct_tensors) and as the embedded engine reads it; a crafted or malformed body is a bad
request. The push into the embedded engine: test_engine_control; through the launched-SGLang path (the stand-in
server, colocated on Ray): test_placement_ray."""

from __future__ import annotations

import base64
import io
import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.reduction import ForkingPickler

import psutil
import pytest
import torch
from test_placement_ray import FAKE_SGLANG, fake_sglang  # noqa: F401 (a fixture)

from slimeflow.engine import tensor_ipc
from slimeflow.engine.sampling import BadRequestError

# What SGLang's server does with one entry, step by step (python/sglang/srt/utils MultiprocessingSerializer and
# weight_sync/tensor_bucket.py), run in a process of its own: the handles must open in another process.
SGLANG_DECODE = """
import base64, sys, torch
from multiprocessing.reduction import ForkingPickler
from slimeflow.engine import tensor_ipc
bodies, out = torch.load(sys.argv[1], weights_only=False), {}
for key, body in bodies.items():
    payload = ForkingPickler.loads(base64.b64decode(body["serialized_named_tensors"][0], validate=True))
    if body["load_format"] == "flattened_bucket":
        flat = payload["flattened_tensor"]
        out[key, "classes"] = sorted({type(m).__module__ + "." + type(m).__name__ for m in payload["metadata"]})
        pairs = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in payload["metadata"]]
    else:
        pairs = payload
    out[key, "sglang"] = {name: t.clone() for name, t in pairs}
    out[key, "engine"] = {name: t.clone() for name, t in tensor_ipc.named_tensors(body).items()}
torch.save(out, sys.argv[2])
"""


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "odd_bf16": torch.randn(5, generator=g).to(torch.bfloat16),
            "after_odd": torch.randn(2, 3, generator=g), "ids": torch.arange(7), "empty": torch.zeros(0, 4)}


def test_the_body_decodes_as_sglang_decodes_it_in_another_process(tmp_path, monkeypatch, fake_sglang):  # noqa: F811
    """Both load formats, several dtypes; where SGLang is installed (the stand-in here) the metadata is SGLang's
    class, which the engine's restricted reader maps to its own."""
    sent = weights()
    flattened, kept = tensor_ipc.update_body(sent, tp_size=2, version="3")
    listed, kept_list = tensor_ipc.update_body(sent, load_format=None)
    # slime's request (sglang_engine.update_weights_from_tensor), one entry per TP rank
    assert set(flattened) == {"serialized_named_tensors", "load_format", "flush_cache", "weight_version"}
    assert flattened["load_format"] == "flattened_bucket" and flattened["weight_version"] == "3"
    assert len(flattened["serialized_named_tensors"]) == 2 and not flattened["flush_cache"]
    assert listed["load_format"] is None and "weight_version" not in listed
    assert not any(t.is_shared() for t in sent.values())  # the sender's tensors stay where they were: copies travel
    torch.save({"flattened": flattened, "listed": listed}, tmp_path / "bodies.pt")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SGLANG), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", SGLANG_DECODE, str(tmp_path / "bodies.pt"), str(tmp_path / "out.pt")],
                   check=True, timeout=120)
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["flattened", "classes"] == ["sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata"]
    for key in ("flattened", "listed"):
        for reader in ("sglang", "engine"):
            got = out[key, reader]
            assert list(got) == list(sent)
            assert all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in sent.items()), (key, reader)
    del kept, kept_list


def entry(obj) -> str:
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


def test_bad_bodies_are_refused_with_what_is_wrong():
    good, kept = tensor_ipc.update_body({"w": torch.ones(4)})
    with pytest.raises(BadRequestError, match="names posix.system"):
        tensor_ipc.named_tensors({**good, "serialized_named_tensors": [entry(os.system)]})
    with pytest.raises(BadRequestError, match="file descriptor"):  # torch's default strategy: child processes only
        tensor_ipc.named_tensors({"serialized_named_tensors": [entry([("w", torch.ones(4))])], "load_format": None})
    with pytest.raises(BadRequestError, match="does not decode"):
        tensor_ipc.named_tensors({**good, "serialized_named_tensors": ["not base64!"]})
    with pytest.raises(BadRequestError, match="load_format 'direct' is not one"):
        tensor_ipc.named_tensors({**good, "load_format": "direct"})
    with pytest.raises(BadRequestError, match="an entry per TP rank"):
        tensor_ipc.named_tensors({**good, "serialized_named_tensors": []})
    flat = tensor_ipc.flatten({"w": torch.ones(4)})
    flat["metadata"][0].end_idx += 4  # claims bytes past the flat tensor
    with pytest.raises(BadRequestError, match=r"w: \[0:20\] of the 16-element flat tensor"):
        tensor_ipc.named_tensors({**good, "serialized_named_tensors": [tensor_ipc.serialize(flat)]})
    with pytest.raises(BadRequestError, match="list of \\(name, tensor\\) pairs"):
        tensor_ipc.named_tensors({"serialized_named_tensors": [tensor_ipc.serialize({"w": 1})], "load_format": None})
    assert pickle.loads(base64.b64decode(good["serialized_named_tensors"][0]))["metadata"][0].name == "w"
    del kept


def test_the_ipc_transport_refuses_engines_on_other_hosts():
    from slimeflow.stages.train.engines import WeightTargets
    from slimeflow.stages.train.weight_sync import WeightSync

    with pytest.raises(ValueError, match=r"IPC handles\); \['http://10.0.0.7:30000'\] are elsewhere"):
        WeightSync(WeightTargets(("http://127.0.0.1:30000", "http://10.0.0.7:30000"), "hf", sglang=True),
                   transport="ipc")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA IPC handles")
def test_cuda_tensors_travel_as_ipc_handles_named_by_device_uuid(tmp_path):
    """Written on a CPU machine, not run there: a CUDA bucket goes as a CUDA IPC handle whose device is the GPU's
    UUID (SGLang's patched reductions), and another process opens it with the same bytes."""
    sent = {name: t.cuda() for name, t in weights().items()}
    body, kept = tensor_ipc.update_body(sent, version="g")
    raw = base64.b64decode(body["serialized_named_tensors"][0])
    assert str(torch.cuda.get_device_properties(0).uuid).encode() in raw
    torch.save({"flattened": body}, tmp_path / "bodies.pt")
    subprocess.run([sys.executable, "-c", SGLANG_DECODE.replace("t.clone()", "t.cpu()"), str(tmp_path / "bodies.pt"),
                    str(tmp_path / "out.pt")], check=True, timeout=120)
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    for reader in ("sglang", "engine"):
        assert all(torch.equal(out["flattened", reader][n], t.cpu()) for n, t in sent.items()), reader
    del kept


def test_a_shared_memory_manager_slow_to_answer_is_asked_again(monkeypatch):
    """libshm gives the torch_shm_manager one second to answer; on a busy machine it missed it, on the sender's side
    (moving a buffer into /dev/shm) and on the engine's (opening it). The failure comes before anything is allocated,
    so both sides make the same call again, for up to MANAGER_PATIENCE_S, and only for that error."""
    # The sender's side goes through it: a body is made even when the manager misses its first answer.
    real, failures = torch.UntypedStorage._share_filename_cpu_, []

    def slow_once(storage):
        if not failures:
            failures.append(storage)
            raise RuntimeError("Shared memory manager connection has timed out")
        return real(storage)

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", slow_once)
    body, _ = tensor_ipc.update_body({"w": torch.ones(4)})
    assert failures and body["serialized_named_tensors"]
    monkeypatch.undo()

    calls = []

    def slow_twice(*args):
        calls.append(args)
        if len(calls) < 3:
            raise RuntimeError("Shared memory manager connection has timed out\nException raised from recv at ...")
        return torch.UntypedStorage(4)

    monkeypatch.setattr(tensor_ipc.reductions, "rebuild_storage_filename", slow_twice)
    assert tensor_ipc.rebuild_storage_filename_patiently("cls", "manager", "handle", 4).size() == 4
    assert len(calls) == 3 and calls[0] == ("cls", "manager", "handle", 4)

    calls.clear()
    monkeypatch.setattr(tensor_ipc, "MANAGER_PATIENCE_S", 0.0)
    with pytest.raises(RuntimeError, match=r"did not answer for 0 s: is the machine overloaded.*timed out"):
        tensor_ipc.patiently(slow_twice, "x")
    assert len(calls) == 1

    def missing(*args):
        calls.append(args)
        raise RuntimeError("unable to open shared memory object </torch_1_2> in read-write mode")

    calls.clear()
    with pytest.raises(RuntimeError, match="unable to open"):  # any other error stands at once
        tensor_ipc.patiently(missing, "x")
    assert len(calls) == 1


def test_a_manager_that_stops_answering_for_six_seconds_is_waited_for():
    """The real manager, stopped for longer than the five seconds in a row a loaded suite once saw (SIGSTOP), then
    continued: the sender's call waits and succeeds; its late answer is read by the call made after it."""
    first = torch.ones(4)
    tensor_ipc.patiently(first.untyped_storage()._share_filename_cpu_)  # this process's manager is running
    [manager] = [p for p in psutil.Process().children() if p.name() == "torch_shm_manager"]  # libshm forks it
    manager.suspend()
    resumed = threading.Timer(6.0, manager.resume)
    resumed.start()
    try:
        started = time.monotonic()
        later = torch.ones(8)
        tensor_ipc.patiently(later.untyped_storage()._share_filename_cpu_)
        waited = time.monotonic() - started
    finally:
        resumed.join()
        manager.resume()
    assert later.untyped_storage().is_shared() and waited >= 5.5, waited
