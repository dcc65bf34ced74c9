"""slime.rollout.sglang_rollout: `GenerateState`, `generate`, `generate_and_rm` and `get_model_url` for slime's
custom generate functions, over the running router's (or engine's) SGLang HTTP API, as slime's; and
`generate_rollout`, slime's default rollout function, which is slimeflow's own rollout (for a rollout function that
wraps slime's default).

`args` is the namespace slimeflow gives plug-ins (slimeflow.rollout.slime_plugins.slime_args): slime's attribute
names, with `sglang_router_ip` / `sglang_router_port` of the engine or router the rollout talks to.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from transformers import AutoTokenizer

from slimeflow.rollout.data_source import Group
from slimeflow.rollout.rollout import collect_rollout
from slimeflow.rollout.slime_rollout_hooks import SlimeDataSource, filter_and_process
from slimeflow.slime_compat.rollout.base_types import RolloutFnTrainOutput
from slimeflow.slime_compat.utils.async_utils import run
from slimeflow.slime_compat.utils.http_utils import post
from slimeflow.slime_compat.utils.misc import SingletonMeta, load_function
from slimeflow.slime_compat.utils.types import Sample

__all__ = ["GenerateState", "generate", "generate_and_rm", "generate_and_rm_group", "generate_rollout",
           "get_model_url"]


def get_model_url(args: Any, model_name: str, endpoint: str = "/generate") -> str:
    """The URL of `endpoint` on the router (slimeflow serves one model: `model_name` picks nothing else)."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


class GenerateState(metaclass=SingletonMeta):
    """The process-wide generation state, created once from the first `args` (slime's singleton): tokenizer,
    a semaphore of sglang_server_concurrency x engines, and the rollout's sampling_params."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.tokenizer = getattr(args, "_slimeflow_tokenizer", None)
        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        self.processor = None
        engines = getattr(args, "rollout_num_engines", None) or 1
        self.semaphore = asyncio.Semaphore(args.sglang_server_concurrency * engines)
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop=args.rollout_stop,
            stop_token_ids=args.rollout_stop_token_ids, skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True, spaces_between_special_tokens=False,
        )
        self.dp_counts = [0] * (getattr(args, "sglang_dp_size", None) or 1)
        self.dp_rank = 0
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One turn: the prompt (or the sample's tokens so far) -> the response appended to `sample`, as slime's."""
    state = GenerateState(args)
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"generate: sample status is {sample.status}; it must be PENDING or ABORTED")
    prompt = sample.prompt
    if isinstance(prompt, list):  # slimeflow keeps a messages list as it is (slime renders it when loading data)
        prompt = state.tokenizer.apply_chat_template(prompt, tools=sample.metadata.get("tools"), tokenize=False,
                                                     add_generation_prompt=True)
    prompt_ids = sample.tokens or state.tokenizer.encode(prompt, add_special_tokens=False)
    sampling_params["max_new_tokens"] -= sample.response_length
    if sampling_params["max_new_tokens"] < 0:
        raise ValueError(f"max_new_tokens: {sampling_params['max_new_tokens']} should not be less than 0")
    if sampling_params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload = {"input_ids": list(prompt_ids), "sampling_params": sampling_params, "return_logprob": True}
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    output = await post(get_model_url(args, "default"), payload)
    pairs = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(args, tokens=[item[1] for item in pairs], log_probs=[item[0] for item in pairs],
                                  trainable=True, meta_info=output["meta_info"], text=output["text"])
    return sample


async def generate_and_rm(args: Any, sample: Sample, sampling_params: dict[str, Any],
                          evaluation: bool = False) -> Sample | list[Sample]:
    """Generate (--custom-generate-function-path, else `generate`) then reward what has no reward yet, as slime's.

    With --group-rm the reward is left to the group (slimeflow rewards the group after every sample is done).
    """
    if args.partial_rollout and args.mask_offpolicy_in_partial_rollout and sample.response_length > 0:
        sample.loss_mask = [0] * sample.response_length
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        path = sample.generate_function_path or args.custom_generate_function_path
        if path is None:
            result = await generate(args, sample, sampling_params)
        else:
            custom = load_function(path)
            if "evaluation" in inspect.signature(custom).parameters:
                result = await custom(args, sample, sampling_params, evaluation=evaluation)
            else:
                result = await custom(args, sample, sampling_params)
    if args.group_rm:
        return result
    samples = result if isinstance(result, list) else [result]
    if any(s.status is Sample.Status.ABORTED for s in samples):
        return result
    for s in samples:
        if s.reward is None:
            s.reward = await args._slimeflow_reward(s)
    return result


async def generate_and_rm_group(args: Any, group: list[Sample], sampling_params: dict[str, Any],
                                evaluation: bool = False) -> list[Sample]:
    """`generate_and_rm` for every sample of a group, concurrently (each with its own copy of sampling_params);
    with --group-rm the group is then rewarded at once, as slime's."""
    state = GenerateState(args)
    if state.aborted:
        return group
    group = list(await asyncio.gather(*(generate_and_rm(args, sample, dict(sampling_params), evaluation=evaluation)
                                        for sample in group)))
    if args.group_rm and not state.aborted:
        for sample, reward in zip(group, await args._slimeflow_group_reward(group), strict=True):
            sample.reward = reward
    return group


class _SlimeSourceGroups:
    """slimeflow's data-source interface (get_groups, add_groups) over a slime data source object (a
    --data-source-path class's, which slime passes to rollout functions as it is)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def get_groups(self, num_groups: int) -> list[Group]:
        return self.source.get_samples(num_groups) if num_groups else []

    def add_groups(self, groups: list[Group], rollout_id: int) -> None:
        if groups:
            self.source.add_samples([list(group) for group in groups])

    def __len__(self) -> int:
        return len(self.source)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> RolloutFnTrainOutput:
    """slime's default rollout function, for a --rollout-function-path function that calls it: slimeflow's own
    rollout (dynamic sampling, partial rollouts, sample hooks and filters, as without a rollout function), then
    slime's --rollout-sample-filter-path and --rollout-all-samples-process-path; the reward post-process and the
    rollout log function are the caller's, as in slime. `args` must be the one slimeflow gave the rollout function
    (it carries the rollout's engines and reward). Evaluation is slimeflow's own (--eval-prompt-data)."""
    if evaluation:
        raise ValueError("slime.rollout.sglang_rollout.generate_rollout(evaluation=True): slimeflow evaluates "
                         "--eval-prompt-data itself; leave --eval-function-path unset (slime's default means the "
                         "same), or give an evaluation function of your own")
    ctx = getattr(args, "_slimeflow_context", None)
    if ctx is None:
        raise ValueError("slime.rollout.sglang_rollout.generate_rollout runs slimeflow's rollout and needs the `args` "
                         "slimeflow passes to a --rollout-function-path function (its engines, tokenizer and "
                         "reward); call it from such a function with the args it was given")
    data = data_source.data if isinstance(data_source, SlimeDataSource) else _SlimeSourceGroups(data_source)
    kept, offered, metrics = run(collect_rollout(ctx, data, rollout_id))
    filter_and_process(ctx, kept, metrics, offered, data)
    return RolloutFnTrainOutput(samples=kept, metrics=metrics)
