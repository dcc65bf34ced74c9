"""A whole rollout function in slime's form: takes groups from slime's data source, generates and rewards them
with slime's generate_and_rm on slime's background loop, puts one group back, and returns RolloutFnTrainOutput."""

import asyncio

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    assert not evaluation
    groups = data_source.get_samples(args.rollout_batch_size + 1)
    data_source.add_samples([groups.pop()])  # kept for the next rollout
    state = GenerateState(args)

    async def all_groups():
        return await asyncio.gather(*(generate_and_rm_group(args, group, state.sampling_params) for group in groups))

    done = run(all_groups())
    return RolloutFnTrainOutput(samples=[list(group) for group in done], metrics={"custom/groups": len(done)})


def eval_rollout(args, rollout_id, data_source, evaluation=False):
    """slime's eval function form: reads its own sets (here args.eval_prompt_data, slime's name/path list) and
    returns RolloutFnEvalOutput with per-set rewards."""
    from slime.rollout.base_types import RolloutFnEvalOutput

    assert evaluation
    names = args.eval_prompt_data[::2]
    data = {name: {"rewards": [1.0, 0.0, 0.0, 1.0], "truncated": [0, 0, 0, 1]} for name in names}
    return RolloutFnEvalOutput(data=data, metrics={"custom/eval_rollout_id": rollout_id})
