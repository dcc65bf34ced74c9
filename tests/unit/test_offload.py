"""--offload-train / --offload-rollout (colocated mode): the flags as slime resolves them, the trainer's state moved
off the device and back bit for bit (CPU file, GPU pinned memory; the torch backend trains on exactly as without),
and the order of the hand-overs. The colocated run on Ray and the Megatron backend's offload are in
tests/integration/test_offload_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slimeflow.config.pipeline import load_stage_config
from slimeflow.errors import ConfigError
from slimeflow.offload import StateOffload, module_tensors, optimizer_tensors, resident_bytes

TRAIN = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2"]


def offloads(*flags: str) -> tuple[bool, bool]:
    placement = load_stage_config("train", None, [*TRAIN, *flags]).placement
    return placement.offload_train, placement.offload_rollout


def test_the_offload_flags_resolve_as_slimes():
    assert offloads() == (False, False)
    assert offloads("--colocate") == (True, True)  # slime: colocate turns both on
    assert offloads("--offload") == (True, True)
    assert offloads("--offload-rollout") == (False, True)
    assert offloads("--colocate", "--no-offload-train") == (False, True)
    assert offloads("--colocate", "--no-offload-rollout") == (True, False)
    assert offloads("--colocate", "--offload-train", "false") == (False, True)
    assert offloads("--colocate", "--debug-rollout-only") == (False, False)  # as slime: no trainer to make room for
    with pytest.raises(ConfigError, match="--async with --offload-train/--offload-rollout: the trainer and the engines"):
        load_stage_config("train", None, [*TRAIN, "--async", "--offload-train"])


def test_an_offload_frees_the_resident_memory_and_restores_every_byte(tmp_path, one_thread):
    """64 MiB of state in tensors that share storage (a tied weight, a view), as modules and optimizers hold it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
    model[1].weight = model[0].weight  # tied: one storage, offloaded once
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    view = model[0].weight[:16]  # a view into an offloaded storage stays a view into it
    before = [t.clone() for t in [*module_tensors(model), *optimizer_tensors(optimizer)]]

    offload = StateOffload(tmp_path / "offload")
    report = offload.offload([*module_tensors(model), *optimizer_tensors(optimizer)])
    # The weight and two biases, their gradients and Adam's two moments (4 copies, fp32), and Adam's three steps.
    assert report.moved_bytes == 4 * (2048 * 2048 + 2 * 2048) * 4 + 3 * 4
    assert report.rss_before - report.rss_after >= 0.9 * report.moved_bytes
    assert model[0].weight.untyped_storage().nbytes() == 0 and list(model[0].weight.shape) == [2048, 2048]
    assert list((tmp_path / "offload").iterdir()) == []  # the file is unlinked while it holds the bytes

    offload.onload()
    after = [*module_tensors(model), *optimizer_tensors(optimizer)]
    assert all(torch.equal(want, got) for want, got in zip(before, after, strict=True))
    assert model[1].weight is model[0].weight and view.data_ptr() == model[0].weight.data_ptr()
    assert not offload.offloaded
    rss = resident_bytes()
    assert rss - report.rss_after >= 0.9 * report.moved_bytes  # really back in memory
    offload.offload(module_tensors(model))
    with pytest.raises(RuntimeError, match="offloaded already"):
        offload.offload(module_tensors(model))
    offload.onload()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "hf", TinyModelSpec(seed=7))


def train_twice(backend, config, offload_dir: Path | None) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """Two rollouts' training, with the backend's state offloaded and restored in between when `offload_dir` is set
    (what a colocated rollout does to it); each rollout's metrics and the final weights."""
    from test_torch_backend import make_batch

    from slimeflow.train.train_step import train_on_rollout

    metrics = [train_on_rollout(backend, make_batch(seed=0), config)]
    if offload_dir is not None:
        offload = StateOffload(offload_dir)
        report = offload.offload(backend.state_tensors())
        # the policy, Adam's two moments and the reference model: four copies of the weights at least
        weight_bytes = sum(p.numel() * 4 for p in backend.model.parameters())
        assert report.moved_bytes >= 4 * weight_bytes
        assert all(p.untyped_storage().nbytes() == 0 for p in backend.model.parameters())
        offload.onload()
    metrics.append(train_on_rollout(backend, make_batch(seed=1), config))
    return metrics, {k: v.clone() for k, v in backend.named_weights().items()}


def test_the_torch_backend_trains_after_an_offload_exactly_as_without(hf_dir, tmp_path, one_thread):
    from test_torch_backend import make_backend, make_config

    config = make_config(optimizer={"lr": 1e-3}, algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1})
    plain = train_twice(make_backend(hf_dir, config), config, None)
    offloaded = train_twice(make_backend(hf_dir, config), config, tmp_path)
    for got, want in zip(offloaded[0], plain[0], strict=True):  # every loss and metric, to the bit
        assert {k: v for k, v in got.items() if "per_s" not in k} == {k: v for k, v in want.items() if "per_s" not in k}
    assert all(torch.equal(offloaded[1][k], v) for k, v in plain[1].items())


"""~17M parameters (68 MB in fp32): the trainer's state (weights and Adam's two moments, ~200 MB) and the engine's
weights are far above the resident-memory noise of a process."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the pinned host memory path")
def test_on_a_gpu_the_state_goes_to_pinned_host_memory_and_the_device_memory_is_freed(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(2, 4096, device="cuda")).sum().backward()
    optimizer.step()
    tensors = [*module_tensors(model), *optimizer_tensors(optimizer)]
    before = [t.cpu() for t in tensors]
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    offload = StateOffload(tmp_path)
    report = offload.offload(tensors)
    assert report.moved_bytes >= 4 * 2 * 4096 * 4096 * 4  # weights, gradients and Adam's two moments
    assert allocated - torch.cuda.memory_allocated() >= report.moved_bytes
    # Handed back to the device, not kept in PyTorch's cache: all but the biases and steps, which share 2 MB blocks
    # with other small tensors (measured on an H200: 536870912 of 537002000 bytes).
    assert reserved - torch.cuda.memory_reserved() >= 0.99 * report.moved_bytes
    assert report.device_freed_bytes == reserved - torch.cuda.memory_reserved()
    assert list(tmp_path.iterdir()) == []  # nothing written to disk on a GPU

    offload.onload()
    assert torch.cuda.memory_allocated() == allocated
    assert all(torch.equal(want, got.cpu()) for want, got in zip(before, tensors, strict=True))


class _Recorder:
    """A fake actor: `x.method.remote(*args)` logs (name, method, *args) and returns `answers[method]` (with
    placement.call made the identity, that is what the caller gets; generate's three returns are one tuple)."""

    def __init__(self, name: str, log: list, answers: dict):
        self.name, self.log, self.answers = name, log, answers

    def __getattr__(self, method: str):
        recorder = self

        class _Method:
            def options(self, **_):
                return self

            def remote(self, *args):
                recorder.log.append((recorder.name, method, *args))
                return recorder.answers.get(method)

        return _Method()


def test_the_devices_are_handed_over_as_slimes_train_py_does(monkeypatch):
    """Interval 2: after rollout 0 (no push follows) the engines keep their weights and release the KV cache; after
    rollout 1 they release both, and take their weights back before the push; the trainer offloads before each
    rollout and evaluation (it reloads its state itself when it trains or pushes)."""
    from slimeflow.stages.train import placement

    log: list = []
    monkeypatch.setattr(placement, "call", lambda ref, what: ref)
    manager = _Recorder("manager", log, {"release_memory": {"offload/rollout_rss_drop_bytes": 5.0},
                                         "generate": ({}, {"rollout/reward_mean": 1.0}, [])})
    trainer = _Recorder("trainer", log, {"offload": {"offload/train/offloaded_bytes": 7.0}})
    colocation = placement.Colocation(manager, [trainer], True, True, update_weights_interval=2)
    rollouts = placement.RolloutManagerHandle(manager, colocation)
    trainers = placement.ActorGroup([trainer], colocation=colocation)

    _, metrics, _ = rollouts.generate(0)
    trainers.train(0, None)
    _, later, _ = rollouts.generate(1)
    trainers.train(1, None)
    trainers.update_weights(2)
    rollouts.evaluate("2")
    assert log == [
        ("trainer", "offload"), ("manager", "resume_memory"), ("manager", "generate", 0),
        ("manager", "release_memory", ["kv_cache"]), ("trainer", "train", 0, None),
        ("trainer", "offload"), ("manager", "resume_memory"), ("manager", "generate", 1),
        ("manager", "release_memory", None), ("trainer", "train", 1, None),
        ("manager", "resume_memory", ["weights"]), ("trainer", "update_weights", "2", []),
        ("trainer", "offload"), ("manager", "resume_memory"), ("manager", "evaluate", "2")]
    assert metrics["offload/train/offloaded_bytes"] == 7.0 and metrics["offload/rollout_rss_drop_bytes"] == 5.0
    assert {"time/handover_to_rollout", "time/handover_to_train"} <= set(later)
