"""slimeflow's built-in rewards give slime's rm_hub rewards, row by row (tests/data/rm_hub, see its README)."""

from __future__ import annotations

import asyncio
import json

import pytest
from paths import DATA

from slimeflow.config.pipeline import load_stage_config
from slimeflow.config.train import RewardConfig
from slimeflow.errors import ConfigError
from slimeflow.rollout.answers import MathJudge
from slimeflow.rollout.rewards import RewardScorer
from slimeflow.rollout.rule_rewards import builtin_reward
from slimeflow.rollout.types import Sample, Status

TABLE_DIR = DATA / "rm_hub"
RM_TYPES = ("math", "deepscaler", "dapo", "f1", "gpqa", "boxed")


def _rows():
    for rm_type in RM_TYPES:
        lines = (TABLE_DIR / f"{rm_type}.jsonl").read_text().splitlines()
        assert lines, f"{rm_type}.jsonl is empty"
        for number, line in enumerate(lines, 1):
            yield pytest.param(json.loads(line), id=f"{rm_type}:{number}")


@pytest.fixture(scope="module")
def judge():
    with MathJudge() as judge:
        yield judge


@pytest.mark.parametrize("row", list(_rows()))
def test_builtin_reward_is_slimes(judge, row):
    def ours():
        return builtin_reward(row["rm_type"], row["response"], row["label"], dict(row["metadata"]), judge)

    expected = row["slime"]
    if isinstance(expected, dict) and "error" in expected:
        with pytest.raises(ValueError):  # slime raises (expected["error"]); we raise a ValueError that says why
            ours()
    elif isinstance(expected, dict):
        assert ours() == expected, row["why"]
    else:
        assert ours() == pytest.approx(expected, abs=1e-12), row["why"]


def test_every_rm_type_has_rows_that_score_both_ways():
    rows = [param.values[0] for param in _rows()]
    for rm_type in RM_TYPES:
        values = {json.dumps(r["slime"]) for r in rows if r["rm_type"].strip().startswith(rm_type)}
        assert len(values) >= 2, f"{rm_type}: the table must hold both right and wrong answers"


def _scored(config: RewardConfig, *samples: Sample, seed: int = 0) -> list[Sample]:
    scorer = RewardScorer(config, seed=seed)
    try:
        asyncio.run(scorer.score_group(list(samples)))
    finally:
        scorer.close()
    return list(samples)


def _sample(response: str, label, index: int = 0, **metadata) -> Sample:
    return Sample(group_index=0, index=index, prompt="q", response=response, label=label, metadata=metadata)


def test_dapo_dict_reward_by_reward_key_and_eval_reward_key():
    """slime's dapo answers {score, acc, pred}; --reward-key names the reward (eval: --eval-reward-key)."""
    right, wrong = _sample("Answer: 12", "12"), _sample("Answer: 13", "12")
    _scored(RewardConfig(rm_type="dapo", reward_key="score"), right, wrong)
    assert (right.reward, wrong.reward) == (1.0, -1.0)
    right, wrong = _sample("Answer: 12", "12"), _sample("Answer: 13", "12", eval_set="aime")
    _scored(RewardConfig(rm_type="dapo", reward_key="score", eval_reward_key="acc"), right, wrong)
    assert (right.reward, wrong.reward) == (1.0, 0.0)  # the eval sample's reward is its acc (False)
    (unkeyed,) = _scored(RewardConfig(rm_type="dapo"), _sample("Answer: 13", "12"))
    assert unkeyed.reward == -1.0  # without --reward-key a dict's 'score'
    (bad,) = _scored(RewardConfig(rm_type="dapo", reward_key="pred"), _sample("Answer: 13", "12"))
    assert bad.status is Status.FAILED and "finite number" in bad.failure_reason


def test_a_reward_slime_fails_on_fails_the_sample_with_the_reason():
    (bad,) = _scored(RewardConfig(rm_type="dapo"), _sample("Answer: 1", "one half"))
    assert bad.status is Status.FAILED and "not an integer" in bad.failure_reason


def test_random_is_a_seeded_fair_coin():
    def rewards(seed: int, order=range(400)) -> dict[int, float]:
        samples = [_sample("x", None, index=i) for i in order]
        return {s.index: s.reward for s in _scored(RewardConfig(rm_type="random"), *samples, seed=seed)}

    first = rewards(7)
    assert set(first.values()) == {0.0, 1.0}
    assert 0.4 < sum(first.values()) / 400 < 0.6
    assert rewards(7, order=reversed(range(400))) == first  # the same whatever order samples are scored in
    assert rewards(8) != first
    (boxed,) = _scored(RewardConfig(rm_type="boxed_random"), _sample("no box", None))
    assert boxed.reward in (0.0, 1.0)


def test_ifbench_is_refused_by_name_with_the_reason():
    with pytest.raises(ValueError, match="--rm-type ifbench: rm_type 'ifbench' is not built in.*not a PyPI package"):
        RewardConfig(rm_type="ifbench")
    with pytest.raises(ValueError, match="ifbench"):
        RewardConfig(rm_type="boxed_ifbench")
    with pytest.raises(ConfigError, match="--rm-type ifbench: rm_type 'ifbench' is not built in"):
        load_stage_config("evaluate", None, ["--rm-type", "ifbench"])
    (per_sample,) = _scored(RewardConfig(rm_type="f1"), _sample("x", "x", rm_type="ifbench"))
    assert per_sample.status is Status.FAILED and "allenai/IFBench" in per_sample.failure_reason


def test_a_reward_the_generate_function_set_is_kept_unless_group_rm():
    preset, fresh = _sample("Paris", "London"), _sample("Paris", "London")
    preset.reward = 0.7
    _scored(RewardConfig(rm_type="f1"), preset, fresh)
    assert (preset.reward, fresh.reward) == (0.7, 0.0)
    keyed = _sample("x", "y")
    keyed.reward = {"score": 0.25, "acc": False}
    (keyed,) = _scored(RewardConfig(rm_type="f1", reward_key="score"), keyed)
    assert keyed.reward == 0.25
    group_preset = _sample("x", "y")
    group_preset.reward = 0.7
    (group_preset,) = _scored(RewardConfig(custom_rm_path=f"{__name__}:half_each", group_rm=True), group_preset)
    assert group_preset.reward == 0.5  # a group reward function rewards the whole group, as slime


async def half_each(args, samples):
    return [0.5] * len(samples)
