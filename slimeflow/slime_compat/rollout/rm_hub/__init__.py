"""slime.rollout.rm_hub: slime's reward entry points, `async_rm(args, sample)` and `batched_async_rm(args, samples)`,
and its scorers, over slimeflow's rule rewards (slimeflow.rollout.rule_rewards) and reward server client.

`async_rm` decides as slime's: the sample's `custom_rm_path`, else `args.custom_rm_path`, else the rm_type of
`sample.metadata["rm_type"]` or `args.rm_type` (with the `boxed_` prefix): `remote_rm` asks `args.rm_url`, the rest
are slimeflow's built-ins, which answer what slime's do (dapo a {score, acc, pred} dict, the others a number).
rm_type random draws from a generator seeded by `args.rollout_seed` and the sample, as slimeflow's rollout does
(slime draws from its process's global one).
"""

from __future__ import annotations

import asyncio
from typing import Any

from slimeflow.rollout.rewards import RemoteReward, sample_rng
from slimeflow.rollout.rule_rewards import builtin_reward
from slimeflow.slime_compat.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slimeflow.slime_compat.rollout.rm_hub.f1 import f1_score
from slimeflow.slime_compat.rollout.rm_hub.gpqa import compute_gpqa_reward
from slimeflow.slime_compat.rollout.rm_hub.math_dapo_utils import compute_score as compute_score_dapo
from slimeflow.slime_compat.rollout.rm_hub.math_utils import JUDGE, grade_answer_verl
from slimeflow.slime_compat.rollout.rm_hub.math_utils import extract_answer as extract_boxed_answer
from slimeflow.slime_compat.utils.misc import load_function
from slimeflow.slime_compat.utils.types import Sample

__all__ = ["Sample", "async_rm", "batched_async_rm", "compute_gpqa_reward", "compute_score_dapo",
           "extract_boxed_answer", "f1_score", "get_deepscaler_rule_based_reward", "grade_answer_verl",
           "load_function", "remote_rm"]


async def remote_rm(args: Any, sample: Sample, max_retries: int = 10) -> Any:
    """The reward server's JSON answer for `sample` (POST to `args.rm_url`), after up to `max_retries` attempts."""
    if not getattr(args, "rm_url", None):
        raise ValueError("rm_type remote_rm needs args.rm_url (--rm-url, the reward server's URL)")
    return await RemoteReward(args.rm_url, retries=max_retries).ask(sample)


async def async_rm(args: Any, sample: Sample, **kwargs: Any) -> Any:
    """The reward of one sample, decided as slime's (see the module's docstring)."""
    path = sample.custom_rm_path or args.custom_rm_path
    if path is not None:
        return await load_function(path)(args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
    if not rm_type:
        raise ValueError("no reward is configured for this sample: set args.rm_type (--rm-type), "
                         "metadata['rm_type'] or args.custom_rm_path (--custom-rm-path)")
    if rm_type.removeprefix("boxed_") == "remote_rm":
        return await remote_rm(args, sample)
    rng = sample_rng(getattr(args, "rollout_seed", 0), sample)
    return builtin_reward(rm_type, sample.response, sample.label, metadata, JUDGE, rng)


async def batched_async_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[Any]:
    """The rewards of `samples`: `args.custom_rm_path` called once on the list (a batched reward), else `async_rm`
    on each sample, concurrently."""
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))
