"""slime.rollout.filter_hub.dynamic_sampling_filters: the filters slime ships, with slime's signature."""

from __future__ import annotations

from typing import Any

import torch

from slimeflow.slime_compat.rollout.filter_hub.base_types import DynamicFilterOutput
from slimeflow.slime_compat.utils.types import Sample

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards are not all equal (std > 1e-6); a dropped one's reason is zero_std_<reward>."""
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = torch.tensor(rewards, dtype=torch.float64).std() > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """check_reward_nonzero_std, but a rejected group is kept when too few would be left to fill the batch."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output
