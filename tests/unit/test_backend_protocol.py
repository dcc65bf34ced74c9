"""The Backend protocol and the registry by --train-backend name: both backends provide every member (the Megatron
one read from its source, not built), every accepted name has a spec, and the registry builds the torch backend,
which saves and loads its checkpoints through the protocol. mypy checks the signatures (protocol.py's TYPE_CHECKING
lines); these tests check what a type checker cannot: that each attribute is set and that the names line up."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest
import torch

from slimeflow.config.train import PlacementConfig, TrainConfig
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.train.backends import BACKENDS, Backend, backend_class, backend_spec, build_backend, rank_args
from slimeflow.train.backends.torch.backend import TorchBackend

MEMBERS = sorted(name for name in vars(Backend) if not name.startswith("_"))
"""The protocol's members: each is a method or a read-only property of the protocol class."""


def assigned_attributes(cls: type) -> set[str]:
    """Every `self.<name>` a class's methods assign (plain, annotated or tuple targets), read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for target in targets:
            for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def test_the_protocol_names_what_its_callers_use():
    assert {"build", "compute_log_probs", "forward_backward", "optimizer_step", "save_checkpoint", "load_checkpoint",
            "named_weights", "state_tensors", "dp_rank", "dp_size", "close"} <= set(MEMBERS)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_backend_provides_every_protocol_member(name):
    cls = backend_class(name)
    provided = set(dir(cls)) | assigned_attributes(cls)
    assert [member for member in MEMBERS if member not in provided] == []
    for member in MEMBERS:  # a method takes the protocol's parameters, by the same names
        wanted = getattr(Backend, member)
        if callable(wanted) and not isinstance(wanted, property):
            params = list(inspect.signature(wanted).parameters)
            assert list(inspect.signature(getattr(cls, member)).parameters)[:len(params)] == params, member


def test_every_accepted_train_backend_has_a_spec():
    accepted = get_args(PlacementConfig.model_fields["train_backend"].annotation)
    assert sorted(accepted) == sorted(BACKENDS)
    with pytest.raises(ValueError, match=r"--train-backend 'fsdp'.*\['megatron', 'torch'\]"):
        backend_spec("fsdp")


def test_the_registry_imports_no_backend_until_one_is_built():
    """The driver reads the specs (preflight, process group) without importing torch or megatron-core."""
    code = ("import sys, slimeflow.train.backends as b; b.backend_spec('megatron'); "
            "print(sorted(m for m in ('torch', 'megatron.core', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_megatron_backend_refuses_a_run_without_a_torch_dist_checkpoint(tmp_path):
    config = TrainConfig(batch={"rollout_batch_size": 2, "num_rollout": 1}, placement={"train_backend": "megatron"})
    args = rank_args(config, rank=0, world_size=1, init_method=None, total_steps=1)
    with pytest.raises(ValueError, match="--train-backend megatron starts from a torch_dist checkpoint"):
        backend_class("megatron").build(config, str(tmp_path), args, None)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "hf", TinyModelSpec(seed=7))


def test_the_registry_builds_the_torch_backend_and_its_checkpoints_go_through_it(hf_dir, tmp_path):
    config = TrainConfig(batch={"rollout_batch_size": 2, "num_rollout": 1}, seed=5,
                         rollout={"rollout_temperature": 0.7})
    backend = build_backend("torch", config, str(hf_dir), rank=0, world_size=1, init_method="", total_steps=1)
    assert type(backend) is TorchBackend
    assert (backend.dp_rank, backend.dp_size, backend.temperature) == (0, 1, 0.7)
    ref = backend.save_checkpoint(tmp_path / "save", 0, {"rollout_id": 0})
    weights = {name: w.clone() for name, w in backend.named_weights().items()}
    fresh = build_backend("torch", config, str(hf_dir), rank=0, world_size=1, init_method="", total_steps=1)
    with torch.no_grad():
        for parameter in fresh.model.parameters():
            parameter.add_(1.0)
    assert fresh.load_checkpoint(ref.uri) == {"rollout_id": 0}
    assert all(torch.equal(weights[name], w) for name, w in fresh.named_weights().items())
