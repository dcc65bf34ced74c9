"""Checkpoints we load are checked, not trusted: checksums written at save and verified on load, damaged or
half-kept checkpoints refused naming the file, and pickles (common.pt, .metadata, rng_state.pt) read without
running code from them."""

from __future__ import annotations

import argparse
import logging
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from slimeflow.checkpoint import safe_pickle
from slimeflow.checkpoint.integrity import CHECKSUMS
from slimeflow.checkpoint.torch_dist import read_common, tensor_metadata
from slimeflow.config.train import TrainConfig
from slimeflow.errors import CheckpointError
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io import checkpoints
from slimeflow.io.guard import OWNER_FILENAME, claim_root
from slimeflow.io.storage import Storage
from slimeflow.train.backends.checkpoint import resolve_start
from slimeflow.train.backends.torch import checkpoint as ckpt
from slimeflow.train.backends.torch.backend import TorchBackend
from slimeflow.train.backends.torch.checkpoint import (
    load_checkpoint,
    read_weights,
    save_checkpoint,
)

CONFIG = TrainConfig(batch={"rollout_batch_size": 2, "num_rollout": 4})


def make_backend(hf_dir: Path) -> TorchBackend:
    return TorchBackend(hf_dir, CONFIG.optimizer, CONFIG.algorithm, CONFIG.batch, seed=5, device="cpu", total_steps=4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """An HF dir and a checkpoint root holding one save, iteration 1."""
    tmp = tmp_path_factory.mktemp("safety")
    hf_dir = build_tiny_model(tmp / "hf", TinyModelSpec(seed=3))
    save_checkpoint(make_backend(hf_dir), tmp / "save", 1, {"rollout_id": 1})
    return hf_dir, tmp / "save"


@pytest.fixture
def copy(saved, tmp_path) -> tuple[Path, Path, Path]:
    """(hf dir, a copy of the checkpoint root to damage, its iter_0000001/)."""
    hf_dir, root = saved
    shutil.copytree(root, tmp_path / "save")
    return hf_dir, tmp_path / "save", tmp_path / "save" / "iter_0000001"


def largest_distcp(directory: Path) -> Path:
    return max(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_a_save_writes_checksums_and_a_bit_flip_is_refused_naming_the_file(copy):
    hf_dir, root, directory = copy
    listed = (directory / CHECKSUMS).read_text()
    assert "training_state.pt" in listed and "common.pt" in listed and ".distcp" in listed
    shard = largest_distcp(directory)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, inside the tensor data
    shard.write_bytes(bytes(data))
    start = resolve_start(str(root), None)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: sha256 \w+, \w+ when saved") as err:
        load_checkpoint(make_backend(hf_dir), start.ref, start.weights_only)
    assert "Nothing was loaded from it" in str(err.value)


@pytest.mark.parametrize("lost", ["training_state", "side_folder"])
def test_a_checkpoint_that_lost_its_resume_state_is_refused_not_restarted_at_rollout_0(copy, lost):
    # Before: loaded as weights only, the run restarted at rollout 0 and overwrote iter_0000001.
    hf_dir, root, directory = copy
    if lost == "training_state":
        (directory / "slimeflow" / "training_state.pt").unlink()  # listed in checksums.json: missing
    else:
        for name in ("training_state.pt", "checksums.json"):  # no checksums left either: the resume rule says it
            (directory / "slimeflow" / name).unlink()
    start = resolve_start(str(root), None)
    with pytest.raises(CheckpointError, match="training_state.pt.* missing"):
        load_checkpoint(make_backend(hf_dir), start.ref, start.weights_only)


@pytest.mark.parametrize("checksums", [True, False])
def test_a_truncated_distcp_names_the_file_instead_of_a_raw_eof_error(copy, checksums):
    hf_dir, root, directory = copy
    if not checksums:
        (directory / CHECKSUMS).unlink(missing_ok=True)  # as Megatron writes it: the structure check catches it
    shard = largest_distcp(directory)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: \d+ bytes, .*truncated"):
        load_checkpoint(make_backend(hf_dir), str(root))


def test_a_checkpoint_without_our_checksums_loads_and_says_it_is_unverified(copy, caplog):
    hf_dir, root, directory = copy
    (directory / CHECKSUMS).unlink(missing_ok=True)  # a Megatron/slime checkpoint carries no checksums of ours
    with caplog.at_level(logging.WARNING):
        assert load_checkpoint(make_backend(hf_dir), str(root)) == {"rollout_id": 1}
    assert any("unverified" in r.getMessage() and str(directory) in r.getMessage() for r in caplog.records)


class CreatesAFile:
    """What a crafted checkpoint could hold: unpickling it calls open(path, 'w')."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_common_pt_with_a_malicious_reduce_is_read_without_running_it(copy, tmp_path, caplog):
    hf_dir, _, directory = copy
    marker = tmp_path / "pwned"
    common = read_common(directory)
    common["args"].payload = CreatesAFile(marker)
    torch.save(common, directory / "common.pt")
    (directory / CHECKSUMS).unlink(missing_ok=True)  # a foreign checkpoint: nothing to check its bytes against
    with caplog.at_level(logging.WARNING):
        args = read_common(directory)["args"]
        weights = read_weights(directory, hf_dir)
    assert not marker.exists()
    assert isinstance(args.payload, safe_pickle.Unloaded) and args.num_layers == 2 and weights
    assert any("io.open, not rebuilt" in r.getMessage() for r in caplog.records)


def test_a_malicious_dcp_metadata_is_read_without_running_it(copy, tmp_path):
    from slimeflow.checkpoint.torch_dist import read_dcp_metadata

    _, _, directory = copy
    marker = tmp_path / "pwned"
    metadata = read_dcp_metadata(directory)
    metadata.planner_data = CreatesAFile(marker)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    assert tensor_metadata(directory)
    assert not marker.exists()


def test_megatron_lm_args_load_with_their_dtypes_and_enums(tmp_path):
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    args = argparse.Namespace(num_layers=2, hidden_size=64, params_dtype=torch.bfloat16,
                              main_grads_dtype=torch.float32, attention_backend=AttnBackend.auto,
                              model_type=ModelType.encoder_or_decoder, cp_comm_type=["p2p"],
                              pipeline_model_parallel_layout=PipelineParallelLayerLayout("Ett|ttL", 2))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7,
                "num_floating_point_operations_so_far": 0, "rng": torch.arange(3)}, tmp_path / "common.pt")
    common = read_common(tmp_path)
    loaded = common["args"]
    assert common["iteration"] == 7 and torch.equal(common["rng"], torch.arange(3))
    assert loaded.params_dtype is torch.bfloat16 and loaded.main_grads_dtype is torch.float32
    assert loaded.attention_backend is AttnBackend.auto and loaded.model_type is ModelType.encoder_or_decoder
    assert isinstance(loaded.pipeline_model_parallel_layout, safe_pickle.Unloaded)  # a class of its own: inert


def test_rng_states_are_saved_for_weights_only_loading_and_old_pickled_ones_still_load(copy):
    hf_dir, root, directory = copy
    rng_file = directory / ckpt.SIDE_DIR / ckpt.RNG_STATE
    # No pickled numpy arrays any more: a fresh process loads it with weights_only=True (in this one, megatron-core
    # has registered numpy's classes as safe globals, which would hide them).
    code = f"import torch; torch.load({str(rng_file)!r}, weights_only=True)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    ranks = torch.load(rng_file, weights_only=True)["ranks"]
    # A checkpoint saved before: numpy's state as an array, readable only by unpickling.
    old = [{**rank, "numpy": (rank["numpy"][0], np.array(rank["numpy"][1], dtype=np.uint32), *rank["numpy"][2:])}
           for rank in ranks]
    torch.save({"ranks": old}, rng_file)
    (directory / CHECKSUMS).unlink(missing_ok=True)
    np.random.rand(3)
    assert load_checkpoint(make_backend(hf_dir), str(root)) == {"rollout_id": 1}
    assert np.array_equal(np.random.get_state()[1], old[0]["numpy"][1])


def test_export_and_evaluate_refuse_a_damaged_checkpoint_before_writing(copy, tmp_path):
    from slimeflow.checkpoint.hf_write import write_hf

    hf_dir, _, directory = copy
    (directory / "slimeflow" / "extra_state.json").write_text("{}")  # same size is not enough: the hash differs
    with pytest.raises(CheckpointError, match=r"extra_state.json: (sha256|\d+ bytes)"):
        write_hf(directory, tmp_path / "hf-out", hf_dir)
    assert not (tmp_path / "hf-out").exists()


def test_saving_over_an_existing_checkpoint_says_so(copy, caplog):
    hf_dir, root, _ = copy
    with caplog.at_level(logging.WARNING):
        save_checkpoint(make_backend(hf_dir), root, 1, {"rollout_id": 1})
    assert any("replacing the checkpoint" in r.getMessage() and "iter_0000001" in r.getMessage()
               for r in caplog.records)


KILLED_MID_COMMIT = """
import sys, time
from pathlib import Path
from slimeflow.config.train import TrainConfig
from slimeflow.train.backends.torch.backend import TorchBackend
from slimeflow.train.backends.torch.checkpoint import save_checkpoint

hf_dir, root, marker = (Path(a) for a in sys.argv[1:])
config = TrainConfig(batch={"rollout_batch_size": 2, "num_rollout": 4})
backend = TorchBackend(hf_dir, config.optimizer, config.algorithm, config.batch, seed=5, device="cpu", total_steps=4)
save_checkpoint(backend, root, 1, {"rollout_id": 1})

def staged():  # everything written, fsynced and hashed: the moment before the rename and the tracker
    marker.touch()
    time.sleep(600)

save_checkpoint(backend, root, 2, {"rollout_id": 2}, before_commit=staged, async_save=True)
time.sleep(600)  # training would go on here
"""


@pytest.mark.slow  # ~20 s: a fresh interpreter imports torch and transformers
def test_a_process_killed_during_an_async_commit_resumes_from_the_previous_checkpoint(saved, tmp_path):
    hf_dir, _ = saved
    root, marker = tmp_path / "save", tmp_path / "staged"
    script = tmp_path / "save.py"
    script.write_text(KILLED_MID_COMMIT)
    process = subprocess.Popen([sys.executable, str(script), str(hf_dir), str(root), str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"the background commit never reached its last step (exit code {process.poll()})"
    finally:
        process.kill()  # SIGKILL
        process.wait()
    assert [p.name for p in root.glob(".iter_0000002.tmp-*")]  # staged in full, never renamed
    latest = checkpoints.find_latest(Storage(), str(root))
    assert latest is not None and latest.iteration == 1 and checkpoints.read_tracker(Storage(), str(root)) == 1
    assert not (root / "iter_0000002").exists()
    claim_root(root)  # the next run removes what the killed commit staged
    assert sorted(p.name for p in root.iterdir()) == [OWNER_FILENAME, "iter_0000001", checkpoints.TRACKER_FILENAME]
    assert load_checkpoint(make_backend(hf_dir), str(root)) == {"rollout_id": 1}
