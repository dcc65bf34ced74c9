"""slime's training-side hooks (slimeflow/train/train_hooks.py) outside a training step: the disk weight sync's post-write
hook, and the start-up check of the hooks' signatures. Their calls inside a step are tested on each backend
(test_megatron_backend.py, test_torch_backend.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from paths import DATA

from slimeflow.config.train import TrainConfig

PLUGINS = DATA / "slime_plugins"


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    import slime_megatron_hooks

    slime_megatron_hooks.CALLS.clear()
    return slime_megatron_hooks


class RecordingServer:
    """An external SGLang server's side of the disk sync: it records the load, then serves the version."""

    def __init__(self, calls: list):
        self.calls, self.version = calls, None

    async def update_weights_from_disk(self, path: str, version: str) -> None:
        self.calls.append(("load", path))
        self.version = version

    async def weight_version(self) -> str | None:
        return self.version


def test_the_post_write_hook_runs_after_the_files_are_written_and_before_the_engines_load(plugin, tmp_path):
    from slimeflow.rollout.slime_plugins import slime_args
    from slimeflow.stages.train.engines import WeightTargets
    from slimeflow.stages.train.weight_sync import WeightSync
    from slimeflow.train.train_hooks import post_write_hook

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    urls = ("http://127.0.0.1:30001", "http://127.0.0.1:30002")
    config = TrainConfig(batch={"rollout_batch_size": 1, "num_rollout": 1},
                         sglang={"args": {"worker_urls": list(urls), "weights_dir": str(tmp_path / "w")}},
                         weight_sync={"custom_update_weight_post_write_path": "slime_megatron_hooks:publish"})
    targets = WeightTargets(urls, str(hf), str(tmp_path / "w"))
    sync = WeightSync(targets, post_write=post_write_hook(config, slime_args(config), targets))
    sync.clients = [RecordingServer(plugin.CALLS) for _ in urls]  # the servers' side, recorded
    assert asyncio.run(sync.push({"lm_head.weight": torch.zeros(4, 2)}, "3")) == "3"
    version_dir = str(tmp_path / "w" / "v3")
    assert plugin.CALLS[0] == ("post_write", version_dir, ["config.json", "model.safetensors"], list(urls))
    assert plugin.CALLS[1:] == [("load", version_dir)] * 2


def test_hooks_that_cannot_take_slimes_call_are_named_at_start_up(plugin):
    from slimeflow.errors import StageInputError
    from slimeflow.stages.train.preflight import check_plugins

    config = TrainConfig(batch={"rollout_batch_size": 1, "num_rollout": 1}, placement={"train_backend": "megatron"},
                         train_hooks={"custom_megatron_before_train_step_hook_path": "slime_megatron_hooks:no_step_id",
                                      "custom_model_provider_path": "slime_megatron_hooks:weight_sum",
                                      "rollout_data_postprocess_path": "slime_megatron_hooks:zero_first_half",
                                      "custom_megatron_init_path": "slime_megatron_hooks:missing"})
    with pytest.raises(StageInputError) as err:
        check_plugins(config)
    message = str(err.value)
    assert "--custom-megatron-before-train-step-hook-path 'slime_megatron_hooks:no_step_id'" in message
    assert "hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)" in message
    assert "takes no pre_process or post_process keyword" in message
    assert "has no attribute 'missing'" in message
    assert "--rollout-data-postprocess-path" not in message  # slime's (args, rollout_id, rollout_data): it passes


def test_a_ranks_rollout_data_is_its_own_samples_and_its_changes_land_on_them():
    """With several data-parallel ranks slime's rollout_data is the rank's partition: here samples 1 and 3 of 4.
    The hook's replaced advantages and in-place loss-mask edits go back to those samples, and only to them."""
    from slimeflow.rollout.types import TrainBatch
    from slimeflow.train.train_hooks import TrainHooks, postprocess_rollout_data
    from slimeflow.train.train_step import Prepared

    seen = {}

    def hook(args, rollout_id, rollout_data):
        seen.update(rollout_id=rollout_id, partition=rollout_data["partition"], rewards=rollout_data["rewards"])
        rollout_data["advantages"] = [a * 10 for a in rollout_data["advantages"]]  # slime's dict: a new list
        rollout_data["loss_masks"][0][0] = 0.0

    batch = TrainBatch(tokens=[torch.arange(4) + i for i in range(4)], response_lengths=[2] * 4,
                       loss_masks=[torch.ones(2) for _ in range(4)], rewards=torch.tensor([0.0, 1.0, 2.0, 3.0]))
    prepared = Prepared(old_log_probs=None, advantages=[torch.full((2,), float(i)) for i in range(4)],
                        ref_log_probs=None)
    postprocess_rollout_data(TrainHooks(args=None, rollout_data_postprocess=hook), 9, batch, [1, 3], prepared)
    assert seen == {"rollout_id": 9, "partition": [1, 3], "rewards": [1.0, 3.0]}
    assert [a.tolist() for a in prepared.advantages] == [[0, 0], [10, 10], [2, 2], [30, 30]]
    assert [m.tolist() for m in batch.loss_masks] == [[1, 1], [0, 1], [1, 1], [1, 1]]


@pytest.mark.parametrize("per_token", [False, True])
def test_a_provided_models_routers_take_the_runs_loss_scaling(per_token):
    """megatron's routers copy calculate_per_token_loss from the config when built (it decides how they weigh their
    aux and z losses): check_provided sets the run's --calculate-per-token-loss on the config and on them."""
    import types

    from slimeflow.train.train_hooks import check_provided

    model = torch.nn.Module()
    model.config = types.SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                         calculate_per_token_loss=not per_token, batch_p2p_comm=True)
    model.router = torch.nn.Module()
    model.router.calculate_per_token_loss = not per_token
    check_provided(model, 1, 1, "--custom-model-provider-path", per_token)
    assert model.config.calculate_per_token_loss is per_token and model.router.calculate_per_token_loss is per_token
    assert model.config.batch_p2p_comm is False
