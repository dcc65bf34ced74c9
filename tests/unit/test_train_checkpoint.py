"""Training checkpoints of the torch backend: exact resume, Megatron/convert compatibility, atomic saves, start rule."""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from slimeflow.checkpoint.hf_write import write_hf
from slimeflow.checkpoint.integrity import CHECKSUMS
from slimeflow.checkpoint.torch_dist import read_dcp_metadata
from slimeflow.config.train import TrainConfig
from slimeflow.errors import CheckpointError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io import checkpoints, guard
from slimeflow.io.storage import Storage
from slimeflow.rollout.types import TrainBatch
from slimeflow.train.backends.checkpoint import StartPoint, resolve_start
from slimeflow.train.backends.torch import checkpoint as ckpt
from slimeflow.train.backends.torch.backend import TorchBackend
from slimeflow.train.backends.torch.checkpoint import load_checkpoint, save_checkpoint
from slimeflow.train.train_step import train_on_rollout

CONFIG = TrainConfig(batch={"rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 4},
                     optimizer={"lr": 1e-3, "lr_warmup_iters": 1, "lr_decay_style": "cosine", "min_lr": 1e-4})
EXTRA = {"rollout_id": 3, "data_source": {"epoch": 1, "sample_offset": 12, "group_index": 6}}


def make_backend(hf_dir: Path) -> TorchBackend:
    return TorchBackend(hf_dir, CONFIG.optimizer, CONFIG.algorithm, CONFIG.batch, seed=5, device="cpu", total_steps=4)


def make_batch(seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 3), (6, 2), (9, 5), (7, 4)]
    return TrainBatch(tokens=[torch.randint(3, 250, (t,), generator=g) for t, _ in shapes],
                      response_lengths=[n for _, n in shapes], loss_masks=[torch.ones(n) for _, n in shapes],
                      rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]))


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An HF dir, a backend trained for two rollouts, and its save as iteration 3."""
    tmp = tmp_path_factory.mktemp("ckpt")
    hf_dir = build_tiny_model(tmp / "hf", TinyModelSpec(seed=11))
    backend = make_backend(hf_dir)
    for seed in (0, 1):
        train_on_rollout(backend, make_batch(seed), CONFIG)
    ref = save_checkpoint(backend, tmp / "save", 3, EXTRA)
    return hf_dir, backend, ref


def test_load_restores_weights_optimizer_scheduler_rng_and_extra_state(saved):
    hf_dir, trained, ref = saved
    assert ref.iteration == 3 and Path(ref.uri).name == "iter_0000003"
    assert checkpoints.find_latest(Storage(), ref.root) == ref
    resumed = make_backend(hf_dir)
    draws()  # move every generator away from the saved states
    assert load_checkpoint(resumed, ref.root) == EXTRA
    # Compared as states, not draws: in a full test session other threads (servers of earlier tests) may draw
    # from python's global generator between a restore and a draw.
    restored = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    saved_rng = torch.load(Path(ref.uri) / ckpt.SIDE_DIR / ckpt.RNG_STATE, weights_only=False)["ranks"][0]
    assert restored[0] == saved_rng["python"] and torch.equal(restored[2], saved_rng["torch"])
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(restored[1], saved_rng["numpy"], strict=True))
    for name, weight in trained.named_weights().items():
        assert torch.equal(resumed.named_weights()[name], weight), name
    a, b = trained.training_state(), resumed.training_state()
    assert a["scheduler"] == b["scheduler"] and a["scheduler"]["last_epoch"] == 2
    for key, state in a["optimizer"]["state"].items():
        for field, value in state.items():
            assert torch.equal(b["optimizer"]["state"][key][field], value), (key, field)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    # Resuming is exact: one more rollout on both gives bit-identical weights and metrics.
    metrics = [train_on_rollout(backend, make_batch(2), CONFIG) for backend in (trained, resumed)]
    for m in metrics:
        m.pop("train_tokens_per_s")  # wall-clock
    assert metrics[0] == metrics[1]
    for name, weight in trained.named_weights().items():
        assert torch.equal(resumed.named_weights()[name], weight), name


def test_the_checkpoint_is_megatron_torch_dist_and_converts_back_to_identical_hf(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir, _, ref = saved
    directory = Path(ref.uri)
    assert checkpoints.is_complete(Storage(), ref.uri) and list(directory.glob("*.distcp"))
    assert torch.load(directory / "common.pt", weights_only=False)["iteration"] == 3
    weights = {k: v.clone() for k, v in make_backend(hf_dir).named_weights().items()}
    resumed = make_backend(hf_dir)
    load_checkpoint(resumed, ref)
    write_hf(directory, tmp_path / "hf-out", hf_dir)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-out", dtype=torch.float32)
    exported = dict(model.named_parameters())
    for name, weight in resumed.named_weights().items():
        assert torch.equal(exported[name].detach(), weight), name
    assert any(not torch.equal(weights[n], w) for n, w in resumed.named_weights().items())  # it trained


@pytest.mark.parametrize("fail_at", ["side_files", "before_commit", "commit"])
def test_an_interrupted_save_leaves_the_previous_checkpoint_latest(saved, tmp_path, monkeypatch, fail_at):
    hf_dir, _, _ = saved
    backend = make_backend(hf_dir)
    root = tmp_path / "save"
    first = save_checkpoint(backend, root, 1, {"rollout_id": 1})

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    if fail_at != "before_commit":
        monkeypatch.setattr(*((ckpt, "write_side_files") if fail_at == "side_files" else (checkpoints, "commit")),
                            crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(backend, root, 2, {"rollout_id": 2}, before_commit=crash if fail_at == "before_commit" else None)
    storage = Storage()
    assert checkpoints.find_latest(storage, str(root)) == first
    assert checkpoints.list_checkpoints(storage, str(root), include_incomplete=True) == [first]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", checkpoints.TRACKER_FILENAME]


def test_resolve_start_falls_back_from_load_to_ref_load_to_hf(saved, tmp_path):
    hf_dir, trained, ref = saved
    empty = tmp_path / "empty"
    empty.mkdir()
    half = tmp_path / "half" / "iter_0000007"
    half.mkdir(parents=True)
    (half / "common.pt").write_bytes(b"")  # a save that never finished
    assert resolve_start(ref.root, None) == StartPoint("load", ref, weights_only=False)
    for load in (str(empty), str(tmp_path / "missing"), str(tmp_path / "half"), None):
        start = resolve_start(load, ref.root)
        assert (start.source, start.ref, start.weights_only) == ("ref_load", ref, True)
    assert resolve_start(str(empty), None) == StartPoint("hf_checkpoint", None, weights_only=True)
    with pytest.raises(CheckpointError):
        resolve_start(None, str(empty))
    # ref_load: the weights only (fresh optimizer and schedule), no extra state.
    fresh = make_backend(hf_dir)
    start = resolve_start(str(empty), ref.root)
    assert load_checkpoint(fresh, start.ref, weights_only=start.weights_only) == {}
    assert fresh.training_state()["scheduler"]["last_epoch"] == 0 and not fresh.optimizer.state
    saved_weights = ckpt.read_weights(ref.uri, hf_dir)
    for name, weight in fresh.named_weights().items():
        assert torch.equal(saved_weights[name], weight), name


def test_a_reference_model_loads_from_ref_load(saved):
    hf_dir, _, ref = saved
    algorithm = CONFIG.algorithm.model_copy(update={"use_kl_loss": True})
    backend = TorchBackend(hf_dir, CONFIG.optimizer, algorithm, CONFIG.batch, device="cpu", total_steps=4,
                           ref_load=ref.root)
    saved_weights = ckpt.read_weights(ref.uri, hf_dir)
    reference = dict(backend.ref_model.named_parameters())
    for name, weight in saved_weights.items():
        if name in reference:
            assert torch.equal(reference[name].detach(), weight), name
    assert not any(p.requires_grad for p in backend.ref_model.parameters())


def test_a_train_actor_whose_ray_node_died_or_whose_root_was_claimed_refuses_to_commit(tmp_path, monkeypatch):
    # After a SIGKILL of the job, an actor finishing a save finds itself reparented (its raylet exited); on a
    # cluster, the run restarted on the same --save has claimed the root.
    from slimeflow.stages.train.trainer import Trainer

    root = tmp_path / "save"
    actor = object.__new__(Trainer)  # the check reads the parent pid and run token recorded at start, and --save
    actor.config = CONFIG.model_copy(update={"checkpoint": CONFIG.checkpoint.model_copy(update={"save": str(root)})})
    actor.parent_pid, actor.run_token = os.getppid(), guard.claim_root(root)
    actor.check_may_commit()  # the parent is alive and the root is this run's: nothing to say
    newer = guard.claim_root(root)
    with pytest.raises(RuntimeError, match=r"not committing the checkpoint: .* was claimed by another run .*--save"):
        actor.check_may_commit()
    guard.check_owner(root, newer)
    actor.run_token = newer
    monkeypatch.setattr(os, "getppid", lambda: 1)
    with pytest.raises(RuntimeError, match="not committing the checkpoint: this TrainActor's parent process"):
        actor.check_may_commit()


def test_a_run_claiming_its_root_removes_the_staging_killed_saves_left_and_keeps_a_live_ones(tmp_path):
    """A SIGKILL mid-save leaves `.hf-weights-*` (the HF weights being converted) and `.iter_XXXXXXX.tmp-*` (the
    staged checkpoint); they are ours by name, their owner is gone, and the next run on the root removes them."""
    root = tmp_path / "ckpt"
    left = [root / ".hf-weights-0a1b2c3d", root / ".iter_0000003.tmp-4e5f6a7b"]
    others = [root / ".hf-weights-notours", root / "iter_0000001", root / "notes"]
    for path in left + others:
        (path / "inside").mkdir(parents=True)
    with guard.claimed_dir(root, ".hf-weights-") as live:  # a save still running (this process holds its lock)
        guard.claim_root(root)
        assert live.is_dir()
    assert not [p for p in left if p.exists()]
    assert all(p.is_dir() for p in others)


def test_a_save_fsyncs_every_file_and_reads_none_back_for_its_checksums(saved, tmp_path, monkeypatch):
    # The tracker may name a checkpoint only once its bytes are on disk; the checksums of the data files and the
    # side files come from the bytes in memory as they were written (integrity.Ledger), not from a second read
    # (Megatron's small index files, written apart, are hashed from disk).
    hf_dir, _, _ = saved
    backend = make_backend(hf_dir)
    fsynced, real_fsync = set(), os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: fsynced.add(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    read_back, real_sha256 = [], Storage.sha256
    monkeypatch.setattr(Storage, "sha256", lambda self, uri: read_back.append(Path(uri).name) or real_sha256(self, uri))
    ref = save_checkpoint(backend, tmp_path / "save", 1, {"rollout_id": 1})
    assert sorted(read_back) == [".metadata", "common.pt", "metadata.json"]
    directory = Path(ref.uri)
    saved_files = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    synced = {_in_staging(path) for path in fsynced if ".iter_0000001.tmp-" in path}
    assert saved_files == synced - {"slimeflow/.checksums.json.tmp"} | {"slimeflow/checksums.json"}
    monkeypatch.undo()
    assert ckpt.verify_checkpoint(directory)


def _in_staging(path: str) -> str:
    """`path` (a file in the staging directory of iteration 1) relative to that directory."""
    parts = Path(path).parts
    at = next(i for i, part in enumerate(parts) if part.startswith(".iter_0000001.tmp-"))
    return Path(*parts[at + 1:]).as_posix()


def test_an_async_save_writes_what_a_sync_save_would_while_training_goes_on(saved, tmp_path, monkeypatch):
    # --async-save: the save returns once it holds its own copy; training then changes the weights and the
    # optimizer state while the copy is written, and the checkpoint still holds the state at the save, byte for byte.
    hf_dir, _, _ = saved
    backend = make_backend(hf_dir)
    train_on_rollout(backend, make_batch(0), CONFIG)
    # Both saves record one RNG state: in the full suite another test's thread in this process drew from Python's
    # global RNG between the two saves, and the two rng_state.pt files differed for that reason alone.
    state = ckpt.rng_state()
    monkeypatch.setattr(ckpt, "rng_state", lambda: state)
    sync = save_checkpoint(backend, tmp_path / "sync", 1, EXTRA)
    proceed = threading.Event()
    ref = save_checkpoint(backend, tmp_path / "async", 1, EXTRA, before_commit=proceed.wait, async_save=True)
    assert checkpoints.find_latest(Storage(), str(tmp_path / "async")) is None  # not committed yet
    assert not Path(ref.uri).exists()
    train_on_rollout(backend, make_batch(1), CONFIG)  # the originals change under the pending commit
    proceed.set()
    backend.wait_for_save()
    assert checkpoints.find_latest(Storage(), str(tmp_path / "async")) == ref
    assert _files(Path(ref.uri)) == _files(Path(sync.uri))
    written, expected_metadata = read_dcp_metadata(Path(ref.uri)), read_dcp_metadata(Path(sync.uri))
    assert written.state_dict_metadata == expected_metadata.state_dict_metadata
    assert written.storage_data == expected_metadata.storage_data
    resumed = make_backend(hf_dir)
    assert load_checkpoint(resumed, ref.root) == EXTRA
    expected = make_backend(hf_dir)
    load_checkpoint(expected, sync.root)
    for name, weight in expected.named_weights().items():
        assert torch.equal(resumed.named_weights()[name], weight), name
    # the buffers of the first snapshot are reused by the next one (no new host memory per save)
    buffers = dict(backend.save_snapshot._buffers)
    save_checkpoint(backend, tmp_path / "async", 2, {"rollout_id": 2}, async_save=True)
    backend.wait_for_save()
    assert all(backend.save_snapshot._buffers[key] is buffer for key, buffer in buffers.items())


def test_a_new_save_waits_for_the_commit_in_flight(saved, tmp_path):
    hf_dir, _, _ = saved
    backend = make_backend(hf_dir)
    root, proceed = tmp_path / "save", threading.Event()
    save_checkpoint(backend, root, 1, {"rollout_id": 1}, before_commit=proceed.wait, async_save=True)
    second = threading.Thread(target=save_checkpoint, args=(backend, root, 2, {"rollout_id": 2}))
    second.start()
    second.join(timeout=1.0)
    assert second.is_alive()  # blocked behind checkpoint 1's commit
    assert checkpoints.read_tracker(Storage(), str(root)) is None
    proceed.set()
    second.join(timeout=60)
    assert not second.is_alive()
    assert [r.iteration for r in checkpoints.list_checkpoints(Storage(), str(root))] == [1, 2]
    assert checkpoints.read_tracker(Storage(), str(root)) == 2


def test_a_failed_background_commit_is_raised_with_its_cause_and_commits_nothing(saved, tmp_path):
    hf_dir, _, _ = saved
    backend = make_backend(hf_dir)
    root = tmp_path / "save"
    first = save_checkpoint(backend, root, 1, {"rollout_id": 1})

    def disk_gone():
        raise OSError(28, "No space left on device")

    save_checkpoint(backend, root, 2, {"rollout_id": 2}, before_commit=disk_gone, async_save=True)
    with pytest.raises(CheckpointError, match=r"checkpoint 2 under .*failed in the background.*No space left") as err:
        save_checkpoint(backend, root, 3, {"rollout_id": 3})  # the next save reports it, and does not save
    assert isinstance(err.value.__cause__, OSError)
    assert checkpoints.find_latest(Storage(), str(root)) == first
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", checkpoints.TRACKER_FILENAME]
    save_checkpoint(backend, root, 2, {"rollout_id": 2}, before_commit=disk_gone, async_save=True)
    with pytest.raises(CheckpointError, match="No space left"):  # the end of the run reports it as well
        backend.wait_for_save()
    backend.wait_for_save()  # reported once: nothing pending now


def _files(directory: Path) -> dict[str, bytes]:
    """Every file's bytes but .metadata's (every save records its own staging path and a random save id there) and
    its checksum."""
    files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name != ".metadata"}
    checksums = json.loads(files.pop(CHECKSUMS))
    files[CHECKSUMS] = json.dumps([r for r in checksums["files"] if r["path"] != ".metadata"]).encode()
    return files
