"""Weight updates in checkpoint names: every family's full HF checkpoint pushed into the engine's model equals a fresh
from_pretrained of the same weights, bit for bit (transformers fuses MoE experts on load; the engine must fuse them
as it does); a push split across buckets fuses once the last expert comes, and one that ends short says what is
missing. Through the engine's scheduler (Batcher.update_weights), the path every transport ends in."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from slimeflow.engine.batcher import Batcher
from slimeflow.engine.sampling import BadRequestError
from slimeflow.engine.weights import load_model
from slimeflow.families import FAMILIES
from slimeflow.families.hf import load_causal_lm
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

MOE = ("qwen3_moe", "deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny_model(root / family, TinyModelSpec(family=family, seed=5)) for family in FAMILIES}


@pytest.fixture()
def engine(family_dirs, request):
    batcher = Batcher(load_model(str(family_dirs[request.param]), device="cpu"), max_batch_size=2)
    batcher.start()
    yield batcher
    batcher.stop()


def perturbed_checkpoint(directory) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as its safetensors files name them, each moved off its value (so an update that
    misses or misplaces one shows)."""
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        noise = torch.randn(tensor.shape, generator=g).to(tensor.dtype) if tensor.is_floating_point() else 0
        tensors[name] = tensor + noise
    return tensors


def reference(directory, tensors: dict[str, torch.Tensor], tmp_path) -> PreTrainedModel:
    """from_pretrained of `directory` with `tensors` as its weights."""
    copy = tmp_path / "reference"
    copy.mkdir()
    for item in directory.iterdir():
        if not item.name.endswith(".safetensors"):
            (copy / item.name).write_bytes(item.read_bytes())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(copy / "model.safetensors"))
    return load_causal_lm(copy, dtype=torch.float32)


@pytest.mark.parametrize("engine", sorted(FAMILIES), indirect=True)
def test_a_push_of_the_full_checkpoint_equals_from_pretrained(engine, family_dirs, request, tmp_path):
    family = request.node.callspec.params["engine"]
    pushed = perturbed_checkpoint(family_dirs[family])
    engine.update_weights(pushed, "1").result(timeout=60)
    served = engine._loaded.model.state_dict()
    want = reference(family_dirs[family], pushed, tmp_path).state_dict()
    assert sorted(served) == sorted(want)
    unequal = [name for name in want if not torch.equal(served[name], want[name])]
    assert not unequal, unequal
    # The snapshot (what a restarted peer is given) names the tensors as the push did.
    snapshot, version = engine.snapshot_weights().result(timeout=60)
    assert version == "1" and set(pushed) <= set(snapshot)
    assert all(torch.equal(snapshot[name], pushed[name].float()) for name in pushed)


@pytest.mark.parametrize("engine", ["qwen3_moe"], indirect=True)
def test_experts_split_across_buckets_fuse_when_the_last_one_comes(engine, family_dirs, tmp_path):
    pushed = perturbed_checkpoint(family_dirs["qwen3_moe"])
    first = {name: t for name, t in pushed.items() if ".experts.0." in name or "experts" not in name}
    second = {name: t for name, t in pushed.items() if name not in first}
    engine.pause().result(timeout=10)
    engine.update_weights(first, "1").result(timeout=60)
    fused = engine._loaded.model.state_dict()["model.layers.0.mlp.experts.down_proj"]
    assert not torch.equal(fused[0], pushed["model.layers.0.mlp.experts.0.down_proj.weight"])  # held, not applied
    engine.update_weights(second, "1").result(timeout=60)
    engine.resume().result(timeout=10)
    want = reference(family_dirs["qwen3_moe"], pushed, tmp_path).state_dict()
    assert all(torch.equal(t, want[name]) for name, t in engine._loaded.model.state_dict().items())


@pytest.mark.parametrize("engine", ["deepseek_v3"], indirect=True)
def test_a_push_that_ends_with_experts_missing_is_refused_naming_them(engine, family_dirs):
    pushed = perturbed_checkpoint(family_dirs["deepseek_v3"])
    short = {name: t for name, t in pushed.items() if ".experts.3." not in name}
    engine.pause().result(timeout=10)
    engine.update_weights(short, "1").result(timeout=60)
    with pytest.raises(BadRequestError, match=r"the weight push ended with 2 incomplete fused tensors: "
                                              r"model\.layers\.1\.mlp\.experts\.down_proj has 3 of its 4 .*"
                                              r"missing e\.g\. model\.layers\.1\.mlp\.experts\.3\.down_proj"):
        engine.resume().result(timeout=10)
    # The next version's pushes start clean; a push of version 2 after pieces of version 1 names version 1.
    engine.update_weights(short, "2").result(timeout=60)
    with pytest.raises(BadRequestError, match=r"weight version '2' ended .* version '3' was not applied"):
        engine.update_weights(pushed, "3").result(timeout=60)
    engine.update_weights(pushed, "3").result(timeout=60)
    engine.resume().result(timeout=10)
    assert engine.weight_version == "3"
    with pytest.raises(BadRequestError, match=r"experts\.9\.down_proj\.weight would be part of .*experts\.down_proj"):
        engine.update_weights({"model.layers.1.mlp.experts.9.down_proj.weight": torch.zeros(64, 32)}, "4").result()
