"""slime.rollout.rm_hub.gpqa: the GPQA multiple-choice reward, over slimeflow.rollout.rule_rewards."""

from __future__ import annotations

from typing import Any

from slimeflow.rollout.rule_rewards import GPQA_LETTERS, choice_letter, gpqa_reward
from slimeflow.slime_compat.rollout.rm_hub.math_utils import JUDGE

__all__ = ["DEFAULT_VALID_LETTERS", "compute_gpqa_reward"]

DEFAULT_VALID_LETTERS = list(GPQA_LETTERS)
_extract_letter_from_response = choice_letter


def compute_gpqa_reward(response: str | None, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """1.0 when the response picks (or, without a letter, states) the right option, else 0.0; 0.0 without a response
    (a failed generation). What `label` and `metadata` may hold: rule_rewards.gpqa_reward."""
    if response is None:
        return 0.0
    return gpqa_reward(response, label, metadata or {}, JUDGE)
