"""The real demo's reward, a slime custom reward (--custom-rm-path times_reward.reward, with this folder on
PYTHONPATH): 1.0 when the reply ended by itself (the model's end-of-turn token within --rollout-max-response-len)
and its last number is the product, else 0.0.

SmolLM2-135M-Instruct mostly knows its times tables, but it tends to explain first ("To find 9 times 12, we can
use ...") or to go on after the answer ("10 * 4 = 40" then a paragraph), and such a reply is cut at the length limit.
The reward teaches it to give the answer and stop.
"""

from __future__ import annotations

import re

from slimeflow.rollout.types import Sample, Status

NUMBER = re.compile(r"-?\d+")


def score(response: str, label: str, finished: bool) -> float:
    """1.0 for a finished reply whose last integer is `label`."""
    numbers = NUMBER.findall(response)
    return float(finished and bool(numbers) and numbers[-1] == str(label).strip())


async def reward(args, sample: Sample, **kwargs) -> float:
    """slime's custom reward contract: (args, sample) -> the reward."""
    return score(sample.response, sample.label, sample.status is Status.COMPLETED)
