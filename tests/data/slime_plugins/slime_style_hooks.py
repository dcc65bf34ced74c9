"""Reward, filter and buffer plug-ins with slime's signatures."""

import torch
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample

EVALUATION_FLAGS: list[bool] = []


async def parity_reward(args, sample: Sample, **kwargs) -> float:
    """slime's per-sample custom reward: 1 for an odd last token."""
    return float(sample.tokens[-1] % 2)


async def dict_reward(args, sample: Sample, **kwargs) -> dict:
    """A reward as a dict; --reward-key picks the entry."""
    return {"acc": float(sample.response.endswith(sample.label)), "format": 0.5}


async def group_length_reward(args, samples: list[Sample], **kwargs) -> list[float]:
    """slime's batched form (--group-rm): one reward per sample of the group, by rank of response length."""
    order = sorted(range(len(samples)), key=lambda i: (samples[i].response_length, i))
    return [float(order.index(i)) for i in range(len(samples))]


def drop_prompt_b(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Drops every group of a prompt starting with 'b', with keep as a tensor, as slime's filters return it."""
    keep = torch.tensor(not str(samples[0].prompt).startswith("b"))
    return DynamicFilterOutput(keep=keep, reason=None if keep else "prompt_b")


def drop_group_zero(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Drops the group with group_index 0 (the e2e run's first prompt)."""
    keep = samples[0].group_index != 0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "group_zero")


def pop_last(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """slime's buffer-filter signature: the newest groups first, removed from the buffer."""
    taken = buffer[-num_samples:][::-1]
    del buffer[-num_samples:]
    return taken


async def record_evaluation(args, sample: Sample, sampling_params, evaluation=False) -> Sample:
    """A custom generate that records the evaluation flag and answers without an engine."""
    EVALUATION_FLAGS.append(evaluation)
    sample.append_response_tokens(args, tokens=[ord("1")], log_probs=[-0.5],
                                  meta_info={"finish_reason": {"type": "stop"}}, text="1")
    return sample


def not_async_generate(args, sample, sampling_params):
    return sample


def slime_megatron_loss(args, batch, logits, sum_of_sample_mean):
    return logits.sum(), {}


def three_arguments(args, rollout_id, buffer):
    """Fits no hook's call (a buffer filter is called with 4 arguments, or slimeflow's with 2)."""
    return buffer


LOGGED: list[tuple] = []


def tag_sample(args, sample: Sample, *, rollout_id=None, evaluation=False):
    """A sample hook that changes the sample in place and returns None."""
    sample.metadata["hooked"] = [rollout_id, evaluation]


async def answer_label(args, sample: Sample, **kwargs) -> Sample:
    """An async sample hook that returns the sample, its response replaced by the label (before the reward)."""
    sample.response = str(sample.label)
    return sample


def remove_odd_samples(args, data: list[list[Sample]]) -> None:
    """slime's rollout sample filter: marks samples that must not train."""
    for group in data:
        for sample in group:
            sample.remove_sample = sample.index % 2 == 1


def log_and_skip_default(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    """slime's custom rollout log: records what it got and skips the default logging."""
    LOGGED.append((rollout_id, len(samples), rollout_extra_metrics["rollout/reward_mean"], rollout_time > 0))
    return True


def slime_megatron_advantage(args, rollout_data):
    rollout_data["advantages"] = rollout_data["returns"] = rollout_data["rewards"]


def scale_rewards(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """slime's reward post-process: (raw rewards, the rewards to train on)."""
    raw = [sample.get_reward_value(args) for sample in samples]
    return raw, [10.0 * r - 1.0 for r in raw]


SEEN_ALL: list[tuple] = []


def see_all_samples(args, all_samples: list[list[Sample]], data_source) -> None:
    """slime's all-samples process: sees kept and filtered-out groups, and may change samples."""
    SEEN_ALL.append(([group[0].prompt for group in all_samples], data_source.get_buffer_length()))
    for group in all_samples:
        for sample in group:
            sample.metadata["seen_by_process"] = True


EVAL_LOGGED: list[tuple] = []


def log_eval(rollout_id, args, data, extra_metrics) -> bool:
    """slime's custom eval log: records the per-set data and keeps the default logging (returns False)."""
    EVAL_LOGGED.append((rollout_id, {name: (d["rewards"], d["truncated"], len(d.get("samples", []))) for name, d in data.items()},
                        sorted(extra_metrics)[:1]))
    return False


def to_train_data(args, samples: list[Sample]) -> dict:
    """slime's convert-samples-to-train-data: the train-data dict, rewards centred over the whole rollout."""
    rewards = [sample.get_reward_value(args) for sample in samples]
    mean = sum(rewards) / len(rewards)
    return {"tokens": [sample.tokens for sample in samples],
            "response_lengths": [sample.response_length for sample in samples],
            "rewards": [r - mean for r in rewards], "raw_reward": rewards,
            "truncated": [int(sample.status == Sample.Status.TRUNCATED) for sample in samples],
            "loss_masks": [sample.loss_mask or [1] * sample.response_length for sample in samples],
            "sample_indices": [sample.index for sample in samples]}


def to_train_data_with_teacher(args, samples: list[Sample]) -> dict:
    return {**to_train_data(args, samples), "teacher_log_probs": [[-0.5]] * len(samples)}


def to_train_data_with_values(args, samples: list[Sample]) -> dict:
    return {**to_train_data(args, samples), "values": [[0.0]] * len(samples)}


async def ground_truth_reward(args, sample, **kwargs) -> float:
    """Search-R1's reward pattern: a dict label with the answers under 'ground_truth', an isinstance check."""
    if not isinstance(sample, Sample):
        raise TypeError("Sample must be an instance of Sample class.")
    return float(sample.response.strip() in sample.label["ground_truth"]["target"])


async def teacher_answer(args, sample: Sample, **kwargs) -> dict:
    """A teacher server's /generate answer (input-token log-probs of prompt + response), as on_policy_distillation's
    reward_func returns it."""
    return {"meta_info": {"input_token_logprobs": [[None, sample.tokens[0], None]] +
                          [[-0.1 * i, token, None] for i, token in enumerate(sample.tokens[1:], start=1)]}}
