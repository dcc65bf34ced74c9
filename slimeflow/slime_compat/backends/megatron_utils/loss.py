"""slime.backends.megatron_utils.loss: `compute_advantages_and_returns(args, rollout_data)`, slime's trainer-side
advantage step, over slimeflow's (slimeflow.train.advantages.compute_advantages: one implementation).

As in slime, `rollout_data` holds per-sample lists ("rewards" already post-processed by the rollout: group-normalised
for GRPO-style estimators, "log_probs", "ref_log_probs", "values", "loss_masks", "response_lengths", ...) and
receives "kl", "advantages" and "returns". Context parallelism is not modelled: each tensor is a sample's whole
response, as in slime with a context-parallel size of 1.
"""

from __future__ import annotations

from typing import Any

import torch

from slimeflow.config.train import AlgorithmConfig
from slimeflow.slime_compat.utils.misc import load_function
from slimeflow.train.advantages import AdvantageInputs, compute_advantages, token_kl

__all__ = ["compute_advantages_and_returns"]

_SETTINGS = ("advantage_estimator", "kl_coef", "kl_loss_type", "normalize_advantages", "gamma", "lambd", "use_opd",
             "opd_kl_coef")
"""The slime args the advantage step reads (by slimeflow's AlgorithmConfig field of the same name)."""


def _algorithm(args: Any) -> AlgorithmConfig:
    """slimeflow's AlgorithmConfig of `args` (only the settings this step reads; slime's parser validated them)."""
    settings = {name: getattr(args, name) for name in _SETTINGS if getattr(args, name, None) is not None}
    return AlgorithmConfig.model_construct(**settings)


def compute_advantages_and_returns(args: Any, rollout_data: dict[str, Any]) -> None:
    """Set rollout_data["kl"] (policy vs reference per token, zeros with kl_coef 0), then "advantages" and
    "returns" by args.advantage_estimator, or by args.custom_advantage_function_path (slime's contract:
    `fn(args, rollout_data)` fills both), then whitened with args.normalize_advantages (REINFORCE++ always)."""
    log_probs = rollout_data.get("rollout_log_probs") if getattr(args, "use_rollout_logprobs", False) \
        else rollout_data.get("log_probs")
    values = rollout_data.get("values")
    if log_probs is None and values is None:
        return  # slime: nothing to do on a rank that holds no log-probs (not the last pipeline stage)
    config = _algorithm(args)
    reference = rollout_data.get("ref_log_probs") if config.kl_coef and log_probs else None
    masks = [torch.as_tensor(mask) for mask in rollout_data["loss_masks"]]
    inputs = AdvantageInputs(rewards=torch.as_tensor(rollout_data["rewards"], dtype=torch.float32), loss_masks=masks,
                             log_probs=log_probs or None, ref_log_probs=reference, values=values,
                             teacher_log_probs=rollout_data.get("teacher_log_probs"))
    rollout_data["kl"] = token_kl(config, inputs)
    if getattr(args, "custom_advantage_function_path", None) is not None:
        load_function(args.custom_advantage_function_path)(args, rollout_data)
        return
    result = compute_advantages(config, inputs, n_samples_per_prompt=1, post_processed=True)
    rollout_data["advantages"], rollout_data["returns"] = result.advantages, result.returns
