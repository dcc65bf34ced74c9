"""Hooks into slime's Megatron actor and its disk weight sync, written to slime's signatures (slime's
backends/megatron_utils: initialize.py, model_provider.py, model.py, actor.py, update_weight/update_weight_from_disk.py).
Each records its call in CALLS, for tests/integration/test_megatron_backend.py and tests/unit/test_train_hooks.py."""

import os

import torch

CALLS: list[tuple] = []
PROVIDED: list[torch.nn.Module] = []


def megatron_init(args):
    """slime's custom init: after megatron's parallel state is set up, before any model exists."""
    from megatron.core import parallel_state

    CALLS.append(("init", parallel_state.model_parallel_is_initialized(), args.num_layers, len(PROVIDED)))


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None, args=None):
    """slime's provider signature; the shape comes from `args` (megatron-core has no megatron.training.get_args)."""
    from slimeflow.families.megatron import gpt_model_from_args

    model = gpt_model_from_args(args, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                                parallel_output=False, sdpa=True)
    PROVIDED.append(model)
    CALLS.append(("provide", pre_process, post_process, vp_stage))
    return model


def before_log_prob(args, model, store_prefix):
    evaluating = all(not getattr(chunk, "module", chunk).training for chunk in model)  # the GPTModel in DDP, if any
    CALLS.append(("log_prob", store_prefix, model, evaluating))


def weight_sum(model) -> float:
    return float(sum(p.detach().double().sum() for chunk in model for p in chunk.parameters()))


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    CALLS.append(("train_step", rollout_id, step_id, model, optimizer, opt_param_scheduler, weight_sum(model)))


def zero_first_half(args, rollout_id, rollout_data):
    """slime's rollout-data post-process: the first half of this rank's samples get no advantage."""
    advantages = rollout_data["advantages"]
    for i in range(len(advantages) // 2):
        advantages[i] = torch.zeros_like(advantages[i])
    CALLS.append(("postprocess", rollout_id, sorted(rollout_data)))


def publish(args, version_dir: str, rollout_engines) -> None:
    """slime's post-write hook: what the version directory holds when it runs, and the engines."""
    CALLS.append(("post_write", version_dir, sorted(os.listdir(version_dir)), list(rollout_engines)))


def no_step_id(args, rollout_id, model, optimizer, opt_param_scheduler):
    """A before-train-step hook missing slime's step_id: refused at start-up."""


def mask_everything(args, rollout_id, rollout_data):
    """A post-process that takes every token out of the loss, through slime's loss_masks."""
    for mask in rollout_data["loss_masks"]:
        mask.zero_()
    CALLS.append(("postprocess", rollout_id, sorted(rollout_data)))


def log_step_to_save_dir(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    """A before-train-step hook in a Ray TrainActor: appends 'rank rollout_id step_id' to <--save>/hook_calls.txt."""
    import torch.distributed

    with open(os.path.join(args.save, "hook_calls.txt"), "a", encoding="utf-8") as out:
        out.write(f"{torch.distributed.get_rank()} {rollout_id} {step_id}\n")


def snapshot_engine_weights(args, rollout_id, data_source, evaluation=False):
    """An eval function (slime's form) that scores nothing: it saves the weights the engine serves when it runs
    (evaluating weight version `rollout_id`, pushed just before), under checkpoint names, to <--save>/engine_weights_<id>.safetensors."""
    from pathlib import Path

    import httpx
    from slime.rollout.base_types import RolloutFnEvalOutput

    key = getattr(args, "sglang_api_key", None)
    answer = httpx.get(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/get_weights_snapshot",
                       headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)
    answer.raise_for_status()
    Path(args.save, f"engine_weights_{rollout_id}.safetensors").write_bytes(answer.content)
    data = {name: {"rewards": [0.0], "truncated": [0]} for name in args.eval_prompt_data[::2]}
    return RolloutFnEvalOutput(data=data, metrics={})
