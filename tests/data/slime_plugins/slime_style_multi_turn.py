"""A two-turn custom generate in the style of slime's search-r1 / retool examples: it calls slime's `generate` for
the model's turn, appends a tool answer (not trained on), lets the model continue, sets its own reward for some
trajectories, and returns the trajectory as two training samples (list[Sample])."""

import copy

from slime.rollout.sglang_rollout import GenerateState, generate
from slime.utils.types import Sample

TOOL_TEXT = " [tool: 42] "
SET_REWARD = 0.7


async def generate_two_turns(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    state = GenerateState(args)
    params = dict(sampling_params, max_new_tokens=1)
    sample = await generate(args, sample, dict(params))
    first = copy.deepcopy(sample)
    tool_ids = state.tokenizer.encode(TOOL_TEXT, add_special_tokens=False)
    sample.append_response_tokens(args, tokens=tool_ids, trainable=False, text=TOOL_TEXT)
    sample.status = Sample.Status.PENDING
    sample = await generate(args, sample, dict(params, max_new_tokens=params["max_new_tokens"] + sample.response_length))
    if sample.index % 2 == 0 and not evaluation:
        first.reward = SET_REWARD
        sample.reward = SET_REWARD
    sample.metadata["turns"] = 2
    return [first, sample]
