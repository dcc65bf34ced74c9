"""slime.rollout.on_policy_distillation: the reward pair slime's on-policy distillation (OPD) runs with.

`--custom-rm-path slime.rollout.on_policy_distillation.reward_func` asks the teacher server at `--rm-url` (an
SGLang server, or slimeflow's engine: `python -m slimeflow.engine.server --model-path TEACHER`) to
score each sample's tokens: a /generate of no new tokens that returns the input tokens' log-probs.
`--custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards` keeps the last
response_length of them as the sample's `teacher_log_probs` and scores every sample 0, so that the learning signal
is the reverse KL to the teacher that `--use-opd --opd-type sglang` adds to the advantages. As slime's: add a task
reward by writing your own post-process.
"""

from __future__ import annotations

from typing import Any

import torch

from slimeflow.slime_compat.utils.http_utils import post
from slimeflow.slime_compat.utils.types import Sample


async def reward_func(args: Any, sample: Sample, **kwargs: Any) -> dict[str, Any]:
    """The teacher server's answer for the sample's prompt + response tokens (its input-token log-probs at the
    rollout temperature): the "reward" the post-process reads."""
    if not getattr(args, "rm_url", None):
        raise ValueError("slime.rollout.on_policy_distillation.reward_func posts to the teacher server at --rm-url, "
                         "which is not set: start the teacher (an SGLang server, or `python -m "
                         "slimeflow.engine.server --model-path TEACHER`) and pass its /generate URL")
    payload = {"input_ids": list(sample.tokens), "return_logprob": True, "logprob_start_len": 0,
               "sampling_params": {"temperature": args.rollout_temperature, "max_new_tokens": 0,
                                   "skip_special_tokens": False}}
    return await post(args.rm_url, payload)


def post_process_rewards(args: Any, samples: list[Sample], **kwargs: Any) -> tuple[list[float], list[float]]:
    """Each sample's teacher_log_probs from its teacher answer (the response's tokens: the last response_length
    input-token log-probs); rewards 0.0, raw and processed, for the estimator."""
    for sample in samples:
        answer = sample.get_reward_value(args)
        entries = answer["meta_info"]["input_token_logprobs"][1:]  # the first token has no log-prob
        if len(entries) < sample.response_length:
            raise ValueError(f"sample {sample.index}: the teacher returned {len(entries) + 1} input-token log-probs "
                             f"for a response of {sample.response_length} tokens; --rm-url must score the whole "
                             "sequence (logprob_start_len 0)")
        logprobs = torch.tensor([entry[0] for entry in entries], dtype=torch.float32)
        sample.teacher_log_probs = logprobs[len(logprobs) - sample.response_length:]
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
