"""slime.utils.types: slime's `Sample` is slimeflow's own record, `slimeflow.rollout.types.Sample`.

There is one class: a slime plug-in gets the very samples the rollout generates, rewards and trains on, with slime's
fields, `Sample.Status` and methods (to_dict/from_dict, get_reward_value, append_response_tokens, ...).
"""

from slimeflow.rollout.types import Sample

__all__ = ["Sample"]
