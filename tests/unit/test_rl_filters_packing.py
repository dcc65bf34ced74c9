"""Dynamic sampling bookkeeping and packing into micro-batches."""

from __future__ import annotations

import random

import pytest

from slimeflow.rollout.filters import (
    DynamicSampler,
    FilterOutcome,
    check_reward_nonzero_std,
)
from slimeflow.rollout.slime_plugins import load_group_filter
from slimeflow.rollout.types import Sample
from slimeflow.train.packing import (
    balanced_partition,
    pack_micro_batches,
    padded_micro_batches,
    split_for_data_parallel,
)


def group(*rewards: float, failed: bool = False) -> list[Sample]:
    samples = [Sample(group_index=0, index=i, prompt="q", reward=r) for i, r in enumerate(rewards)]
    if failed:
        samples[0].mark_failed("reward raised")
    return samples


def test_check_reward_nonzero_std():
    assert check_reward_nonzero_std(group(1, 0, 1)) == FilterOutcome(True)
    assert check_reward_nonzero_std(group(1, 1, 1)) == FilterOutcome(False, "zero_std")
    assert check_reward_nonzero_std(group(1)).keep is False


def test_over_sampling_until_enough_groups_pass():
    sampler = DynamicSampler(target_groups=3, over_sampling_batch_size=4,
                             group_filter=load_group_filter("slimeflow.rollout.filters:check_reward_nonzero_std"))
    assert sampler.groups_to_request() == 4
    assert sampler.groups_to_request() == 0  # 4 in flight can still reach 3
    outcomes = [sampler.offer(g) for g in (group(1, 1), group(1, 0), group(0, 0), group(1, 0, failed=True))]
    assert outcomes == [False, True, False, False]
    assert sampler.groups_to_request() == 4  # 1 kept, nothing in flight: ask for another round
    for g in (group(0, 1), group(1, 0), group(1, 0)):
        sampler.offer(g)
    assert sampler.done and sampler.groups_to_request() == 0
    kept, surplus = sampler.result()
    assert len(kept) == 3 and len(surplus) == 1
    assert sampler.stats() == {"requested": 8, "finished": 7, "kept": 4, "dropped": 3,
                               "dropped/failed_sample": 1, "dropped/zero_std": 2}


def test_sampler_errors_and_bool_filters():
    with pytest.raises(ValueError, match="smaller than rollout_batch_size"):
        DynamicSampler(target_groups=4, over_sampling_batch_size=2)

    def at_least_one_correct(g):
        return any(s.reward == 1 for s in g)

    sampler = DynamicSampler(target_groups=1, group_filter=at_least_one_correct)
    with pytest.raises(ValueError, match="never requested"):
        sampler.offer(group(1))
    sampler.groups_to_request()
    assert sampler.offer(group(0, 0)) is False
    assert sampler.stats()["dropped/at_least_one_correct"] == 1
    with pytest.raises(ValueError, match="only 0 of 1"):
        sampler.result()


def lognormal_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(8192, max(16, int(rng.lognormvariate(7.0, 1.0)))) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packing_respects_the_budget_and_is_near_minimal(seed):
    lengths = lognormal_lengths(256, seed)
    budget = 16384
    micro = pack_micro_batches(lengths, budget)
    assert sorted(i for m in micro for i in m) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in m) <= budget for m in micro)
    assert len(micro) <= -(-sum(lengths) // budget) + 1
    assert len(micro) < len(padded_micro_batches(lengths, budget))


def test_a_sample_over_the_budget_gets_its_own_micro_batch():
    micro = pack_micro_batches([10, 500, 30, 60], max_tokens=100)
    assert micro == [[0, 2, 3], [1]]
    assert pack_micro_batches([10, 500, 30, 60], max_tokens=100, min_micro_batches=3) in (
        [[0, 2], [1], [3]], [[0, 3], [1], [2]], [[0], [1], [2, 3]])
    with pytest.raises(ValueError, match="3 micro-batches out of 2 samples"):
        pack_micro_batches([1, 2], 10, min_micro_batches=3)


def test_balance_data_across_data_parallel_ranks():
    lengths = lognormal_lengths(64, 3)
    ranks = split_for_data_parallel(lengths, 4, balance_data=True)
    assert sorted(i for r in ranks for i in r) == list(range(64)) and {len(r) for r in ranks} == {16}
    loads = [sum(lengths[i] for i in r) for r in ranks]
    contiguous = [sum(lengths[i] for i in r) for r in split_for_data_parallel(lengths, 4, balance_data=False)]
    assert max(loads) - min(loads) < max(contiguous) - min(contiguous)
    assert max(loads) / min(loads) < 1.1
    with pytest.raises(ValueError, match="do not split evenly over 3"):
        balanced_partition(lengths, 3, equal_size=True)
