"""slime's plug-in-facing helpers (slime.utils.ppo_utils, data, eval_config, mask_utils; slime.rollout.sample_hooks;
the filter and engine-count names) as plug-ins import them with slime absent: slime's behaviour, our cases."""

import asyncio
import json
import math
from types import SimpleNamespace

import pytest
import torch

from slimeflow.slime_compat import install

install()

from slime.rollout.filter_hub.base_types import DynamicFilterOutput, should_drop_dynamic_filter_output  # noqa: E402
from slime.rollout.sample_hooks import apply_rollout_sample_hooks, set_current_rollout_id  # noqa: E402
from slime.utils import ppo_utils  # noqa: E402
from slime.utils.data import _parse_generalized_path, filter_long_prompt, read_file  # noqa: E402
from slime.utils.eval_config import build_eval_dataset_configs  # noqa: E402
from slime.utils.http_utils import get_rollout_num_engines  # noqa: E402
from slime.utils.types import Sample  # noqa: E402


def test_dual_clip_caps_the_loss_of_negative_advantages():
    ratio = torch.tensor([3.0, 3.0, 0.25])
    losses, clipfrac = ppo_utils.compute_policy_loss(-ratio.log(), torch.tensor([1.0, -1.0, -1.0]), 0.2, 0.3,
                                                     eps_clip_c=2.0)
    # A>0: min(3, 1.3) * 1 -> -1.3 (clipped); A<0, ratio 3: 3 > c=2 -> 2; A<0, ratio 0.25: max(0.25, 0.8) -> 0.8
    torch.testing.assert_close(losses, torch.tensor([-1.3, 2.0, 0.8]))
    torch.testing.assert_close(clipfrac, torch.tensor([1.0, 0.0, 1.0]))


def test_cispo_gradient_goes_through_log_probs_only():
    log_ratio = torch.tensor([0.5, -0.1], requires_grad=True)
    log_probs = torch.tensor([-1.0, -2.0], requires_grad=True)
    losses, clipfrac = ppo_utils.compute_cispo_loss(-log_ratio, log_probs, torch.tensor([2.0, 1.0]), 0.2, 0.2)
    losses.sum().backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([-2.4, -math.exp(-0.1)]))
    assert log_ratio.grad is None or not log_ratio.grad.any()
    torch.testing.assert_close(clipfrac, torch.tensor([1.0, 0.0]))


def test_importance_weighted_kl_is_clamped_after_the_weighting():
    kl = ppo_utils.compute_approx_kl(torch.tensor([0.0]), torch.tensor([3.0]), "low_var_kl",
                                     importance_ratio=torch.tensor([0.5]))
    torch.testing.assert_close(kl, torch.tensor([min(0.5 * (math.exp(3) - 1 - 3), 10.0)]))


def test_discounted_returns_and_gae_equal_the_recursions():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.5, -1.0, 0.0]], dtype=torch.float64)
    expected = torch.stack([rewards[:, 0] + 0.5 * rewards[:, 1] + 0.25 * rewards[:, 2],
                            rewards[:, 1] + 0.5 * rewards[:, 2], rewards[:, 2]], dim=1)
    torch.testing.assert_close(ppo_utils.chunked_discounted_returns(rewards, 0.5), expected)
    values = torch.zeros_like(rewards)
    advantages, returns = ppo_utils.chunked_gae(rewards, values, gamma=0.5, lambd=1.0)
    torch.testing.assert_close(advantages.double(), expected)
    torch.testing.assert_close(ppo_utils.vanilla_gae(rewards, values, 0.5, 1.0)[1], returns)


def test_reinforce_plus_plus_puts_no_kl_penalty_on_masked_out_tokens():
    (returns,) = ppo_utils.get_reinforce_plus_plus_returns(
        torch.tensor([1.0]), [torch.tensor([1.0, 1.0, 1.0])], [torch.tensor([1.0, 1.0, 0.0])], [3], [5], 0.1, 1.0)
    # token rewards -0.1, -0.1 + 1 (last trained token), 0 (masked out)
    torch.testing.assert_close(returns, torch.tensor([0.8, 0.9, 0.0]))


def test_gspo_kl_is_each_sequences_masked_mean_on_its_tokens():
    kl = ppo_utils.compute_gspo_kl([torch.tensor([-1.0, -2.0]), torch.tensor([-1.0])],
                                   [torch.tensor([-1.5, -1.0]), torch.tensor([-1.0])],
                                   [torch.zeros(2), torch.zeros(1)], [torch.tensor([1.0, 0.0]), torch.ones(1)])
    torch.testing.assert_close(kl, torch.tensor([-0.5, -0.5, 0.0]))


def test_calculate_log_probs_and_entropy_in_slimes_shapes():
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)]])
    log_probs, entropy = ppo_utils.calculate_log_probs_and_entropy(logits, torch.tensor([2]), None, with_entropy=True)
    assert log_probs.shape == (1, 1) and entropy.shape == (1,)
    torch.testing.assert_close(log_probs, torch.tensor([[math.log(0.5)]]))
    with pytest.raises(ImportError, match="off-policy sequence masking"):
        from slime.utils.ppo_utils import compute_opsm_mask  # noqa: F401


def test_generalized_paths_slice_rows_like_python(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(6)))
    assert _parse_generalized_path("x.parquet@[2:]") == ("x.parquet", slice(2, None))
    assert _parse_generalized_path("x@y.jsonl") == ("x@y.jsonl", None)
    for suffix, expected in [("", list(range(6))), ("@[1:3]", [1, 2]), ("@[-2:]", [4, 5]), ("@[:-4]", [0, 1])]:
        assert [row["n"] for row in read_file(f"{path}{suffix}")] == expected
    with pytest.raises(FileNotFoundError):
        list(read_file(str(tmp_path / "missing.jsonl")))


def test_filter_long_prompt_keeps_order_and_counts_multimodal_prompts_with_the_processor(monkeypatch):
    import sys
    import types

    vision = types.ModuleType("slime.utils.processing_utils")
    vision.process_vision_info = lambda prompt, processor: {}
    monkeypatch.setitem(sys.modules, "slime.utils.processing_utils", vision)
    tokenizer = lambda prompts, add_special_tokens: {"input_ids": [p.split() for p in prompts]}  # noqa: E731
    processor = lambda text: {"input_ids": [text.split() * 3]}  # noqa: E731
    samples = [Sample(prompt="a b"), Sample(prompt="a b c d"), Sample(prompt="a", multimodal_inputs={"images": [1]}),
               Sample(prompt="a b", multimodal_inputs={"images": [1]})]
    kept = filter_long_prompt(samples, tokenizer, processor, max_length=3)
    assert [s.prompt for s in kept] == ["a b", "a"]
    assert filter_long_prompt(samples, tokenizer, None, max_length=None) is samples


def test_eval_dataset_fields_resolve_entry_then_defaults_then_args():
    args = SimpleNamespace(rollout_temperature=1.0, eval_temperature=None, rollout_top_p=0.9, rollout_stop=["x"])
    first, second = build_eval_dataset_configs(
        args, [{"name": "a", "path": "a.jsonl", "top_p": 0.5, "app_service": None}, {"name": "b", "path": "b.jsonl"}],
        defaults={"app_service": "http://svc", "temperature": 0.6})
    assert (first.top_p, first.temperature, first.app_service, first.stop) == (0.5, 0.6, None, ["x"])
    assert (second.top_p, second.app_service) == (0.9, "http://svc")
    with pytest.raises(ValueError, match="tempreature"):
        build_eval_dataset_configs(args, [{"name": "a", "path": "a"}], defaults={"tempreature": 1})
    with pytest.raises(ValueError, match="bogus"):
        build_eval_dataset_configs(args, [{"name": "a", "path": "a", "bogus": 1}], defaults={})


def tag_hook(args, sample, *, rollout_id=None):
    sample.metadata.setdefault("seen", []).append(rollout_id)


async def replace_hook(args, sample, **kwargs):
    return Sample(index=sample.index, metadata={**sample.metadata, "kwargs": sorted(kwargs)})


def bad_hook(args, sample):
    return "not a sample"


def test_sample_hooks_walk_nested_lists_and_pass_only_the_keywords_a_hook_takes():
    args = SimpleNamespace(rollout_sample_hook_path=[f"{__name__}.tag_hook", f"{__name__}.replace_hook"])
    set_current_rollout_id(3)
    out = asyncio.run(apply_rollout_sample_hooks(args, [[Sample(index=0)], [Sample(index=1), [Sample(index=2)]]],
                                                 evaluation=False))
    assert [out[0][0].index, out[1][0].index, out[1][1][0].index] == [0, 1, 2]
    assert out[1][1][0].metadata == {"seen": [3], "kwargs": ["evaluation", "rollout_id"]}
    with pytest.raises(TypeError, match="expected Sample or None"):
        asyncio.run(apply_rollout_sample_hooks(SimpleNamespace(rollout_sample_hook_path=[f"{__name__}.bad_hook"]),
                                               Sample(index=0)))


def test_a_rejected_group_is_kept_only_when_kept_when_insufficient_and_the_batch_would_fall_short():
    fallback = DynamicFilterOutput(keep=torch.tensor(False), keep_when_insufficient=True)
    assert should_drop_dynamic_filter_output(fallback, remaining_batch_size=5, target_data_size=4)
    assert not should_drop_dynamic_filter_output(fallback, remaining_batch_size=4, target_data_size=4)
    assert should_drop_dynamic_filter_output(DynamicFilterOutput(keep=False), remaining_batch_size=1,
                                             target_data_size=4)
    assert not should_drop_dynamic_filter_output(DynamicFilterOutput(keep=True), remaining_batch_size=9,
                                                 target_data_size=4)


@pytest.mark.parametrize("values, expected", [({"rollout_num_engines": 3, "rollout_num_gpus": 8}, 3),
                                              ({"rollout_num_gpus": 8, "rollout_num_gpus_per_engine": 2}, 4),
                                              ({"rollout_num_gpus": 1, "rollout_num_gpus_per_engine": 4}, 1),
                                              ({}, 0)])
def test_rollout_num_engines(values, expected):
    assert get_rollout_num_engines(SimpleNamespace(**values)) == expected


class ListSource:
    """slime's data-source API over a list of groups (what a fully-async rollout draws from)."""

    def __init__(self, groups):
        self.groups, self.returned = list(groups), []

    def get_samples(self, n):
        taken, self.groups = self.groups[:n], self.groups[n:]
        return taken

    def add_samples(self, groups):
        self.returned += groups


def test_fully_async_rollouts_take_the_oldest_groups_and_requeue_aborted_ones(monkeypatch):
    from slime.rollout import fully_async_rollout as fa

    async def generate(args, group, sampling_params, evaluation):
        group[0].status = Sample.Status.ABORTED if group[0].index == 1 else Sample.Status.COMPLETED
        return group

    monkeypatch.setattr(fa, "GenerateState", lambda args: SimpleNamespace(sampling_params={}))
    monkeypatch.setattr(fa, "generate_and_rm_group", generate)
    args = SimpleNamespace(rollout_global_dataset=True, rollout_batch_size=2, sglang_server_concurrency=2,
                           rollout_num_engines=1)
    source = ListSource([[Sample(index=i)] for i in range(6)])
    worker = fa.AsyncRolloutWorker(args, source, concurrency=4)
    worker.poll_interval = 0.01
    monkeypatch.setattr(fa, "_get_global_worker", lambda args, data_buffer: worker)
    worker.start()
    try:
        first = asyncio.run(fa._generate_rollout_async(args, 0, source))
        second = asyncio.run(fa._generate_rollout_async(args, 1, source))
    finally:
        worker.stop()
    assert [g[0].index for g in first] == [0, 2] and [g[0].index for g in second] == [3, 4]
    assert [g[0].index for g in source.returned] == [1]  # aborted: back to the data source, not trained
    with pytest.raises(ValueError, match="does not evaluate"):
        fa.generate_rollout_fully_async(args, 0, source, evaluation=True)
