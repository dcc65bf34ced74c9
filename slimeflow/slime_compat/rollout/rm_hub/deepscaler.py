"""slime.rollout.rm_hub.deepscaler: the DeepScaleR rule reward, over slimeflow.rollout.rule_rewards."""

from __future__ import annotations

from typing import Any

from slimeflow.rollout.rule_rewards import deepscaler_reward
from slimeflow.slime_compat.rollout.rm_hub.math_utils import JUDGE

__all__ = ["get_deepscaler_rule_based_reward"]


def get_deepscaler_rule_based_reward(response: str, label: Any) -> int:
    """1 when the boxed answer after `</think>` (or `###Response`) grades equal to `label`, else 0."""
    return int(deepscaler_reward(response, label, {}, JUDGE))
