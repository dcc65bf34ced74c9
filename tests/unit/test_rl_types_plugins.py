"""Sample and TrainBatch records, and loading plug-ins by path (each hook's contract)."""

from __future__ import annotations

import pytest
import torch

from slimeflow.config.train import AlgorithmConfig
from slimeflow.errors import PluginError
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.types import Sample, Status, TrainBatch
from slimeflow.train.advantages import AdvantageInputs, compute_advantages, load_custom_advantage

NOT_A_FUNCTION = 3


def scored(index: int, response_length: int, reward: float, **kw) -> Sample:
    return Sample(group_index=index // 2, index=index, prompt="p", tokens=list(range(3 + response_length)),
                  response_length=response_length, reward=reward, status=Status.COMPLETED, **kw)


def test_train_batch_from_samples_and_select():
    samples = [scored(0, 2, 1.0, loss_mask=[1, 0], rollout_log_probs=[-0.1, -0.2]),
               scored(1, 3, 0.0, rollout_log_probs=[-0.3, -0.4, -0.5]), scored(2, 0, 0.5, rollout_log_probs=[])]
    batch = TrainBatch.from_samples(samples)
    assert len(batch) == 3 and batch.total_lengths == [5, 6, 3] and batch.response_lengths == [2, 3, 0]
    assert batch.loss_masks[1].tolist() == [1.0, 1.0, 1.0]  # no mask: the whole response trains
    assert batch.group_indices == [0, 0, 1]
    sub = batch.select([2, 0])
    assert sub.rewards.tolist() == [0.5, 1.0] and sub.rollout_log_probs[1].tolist() == pytest.approx([-0.1, -0.2])


def test_train_batch_refuses_inconsistent_columns_and_unscored_samples():
    with pytest.raises(ValueError, match="field sizes"):
        TrainBatch(tokens=[torch.ones(3)], response_lengths=[1], loss_masks=[torch.ones(1)], rewards=torch.ones(2))
    with pytest.raises(ValueError, match="sample 0: loss_mask has 2 entries, response_length is 1"):
        TrainBatch(tokens=[torch.ones(3)], response_lengths=[1], loss_masks=[torch.ones(2)], rewards=torch.ones(1))
    with pytest.raises(ValueError, match="sample 0: rollout_log_probs has 2 entries, response_length is 1"):
        TrainBatch(tokens=[torch.ones(3)], response_lengths=[1], loss_masks=[torch.ones(1)], rewards=torch.ones(1),
                   rollout_log_probs=[torch.zeros(2)])
    failed = scored(0, 1, 1.0)
    failed.mark_failed("boom")
    with pytest.raises(ValueError, match=r"samples \[0\] have no reward or failed"):
        TrainBatch.from_samples([failed])


def test_sample_dict_round_trip():
    sample = scored(4, 2, 1.0, metadata={"rm_type": "math"})
    assert Sample.from_dict(sample.to_dict()) == sample
    assert sample.to_dict()["status"] == "completed"


@pytest.mark.parametrize("path, message", [
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    (f"{__name__}:missing", "has no attribute 'missing'"),
    (f"{__name__}:NOT_A_FUNCTION", "is a int, not a function"),
])
def test_plugin_errors_name_the_flag_path_and_reason(path, message):
    with pytest.raises(PluginError, match="--custom-rm-path") as err:
        load_plugin(path, "custom-rm-path")
    assert message in str(err.value)


@pytest.mark.parametrize("module, source, message", [
    ("raises_plugin", "raise RuntimeError('needs GPU')\n",
     "importing module 'raises_plugin' failed: RuntimeError: needs GPU (at {dir}/raises_plugin.py:1)"),
    ("syntax_plugin", "def reward(:\n", "importing module 'syntax_plugin' failed: SyntaxError: "),
    ("needs_plugin", "import no_such_dependency_xyz\n",
     "cannot import module 'needs_plugin' (ModuleNotFoundError: No module named 'no_such_dependency_xyz')"),
])
def test_a_plugin_module_that_fails_on_import_names_its_flag(tmp_path, monkeypatch, module, source, message):
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as err:
        load_plugin(f"{module}:reward", "custom-rm-path")
    assert str(err.value).startswith(f"--custom-rm-path '{module}:reward': ")
    assert message.format(dir=tmp_path) in str(err.value)


def test_plugin_path_in_slime_dotted_form():
    assert load_plugin("slimeflow.rollout.data_source.pop_first", "buffer-filter-path").__name__ == "pop_first"


def rank_advantage(config, inputs):
    """A custom advantage: each sample's rank in its batch, on every response token."""
    ranks = inputs.rewards.argsort().argsort().float()
    return [torch.full((n,), float(r)) for r, n in zip(ranks, inputs.response_lengths, strict=True)]


def test_custom_advantage_function_contract():
    config = AlgorithmConfig(custom_advantage_function_path=f"{__name__}:rank_advantage")
    inputs = AdvantageInputs(rewards=torch.tensor([0.3, 0.1]), loss_masks=[torch.ones(2), torch.ones(1)])
    out = compute_advantages(config, inputs, 2, custom=load_custom_advantage(config))
    assert [a.tolist() for a in out.advantages] == [[1.0, 1.0], [0.0]]

    def wrong_shape(config, inputs):
        return [torch.zeros(5), torch.zeros(1)]

    with pytest.raises(ValueError, match="expected the response lengths"):
        compute_advantages(config, inputs, 2, custom=wrong_shape)
