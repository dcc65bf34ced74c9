"""The rollout function: prompts -> samples over SGLang's HTTP API -> rewards -> dynamic sampling.

It speaks only HTTP to an engine URL (the embedded engine, sglang-router or real SGLang servers), with at most
`concurrency` requests in flight. Groups are requested `over_sampling_batch_size` at a time until
`rollout_batch_size` groups pass the dynamic-sampling filter; the stragglers are then aborted and, with
`--partial-rollout`, put back into the buffer to be continued next rollout (their generated tokens kept, the
first rollout id recorded in metadata; a continued sample's earlier tokens masked out of the loss with
`--mask-offpolicy-in-partial-rollout`, else the version of the oldest recorded, and with --async a buffered group
that would train on tokens older than the staleness bound generated again from its prompt). A custom generate
function (`--custom-generate-function-path`, `async generate(args, sample, sampling_params) -> Sample`) replaces the single-turn default; `args` is the
`RolloutContext` (its `client`, `tokenizer` and `config`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from slimeflow.config.train import RolloutConfig, TrainConfig
from slimeflow.engine.client import EngineUnavailableError
from slimeflow.rollout.data_source import START_ROLLOUT_ID, BufferedDataSource, Group
from slimeflow.rollout.filters import DynamicSampler
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.rewards import RewardScorer
from slimeflow.rollout.slime_plugins import call_generate, load_group_filter, slime_args
from slimeflow.rollout.slime_rollout_hooks import apply_sample_hooks, finish_rollout
from slimeflow.rollout.types import Sample, Status
from slimeflow.slime_compat.utils import http_utils

GenerateFn = Callable[[Any, Sample, dict[str, Any]], Awaitable[Sample]]
OLDEST_WEIGHT_VERSION = "oldest_weight_version"
"""metadata key of a continued partial sample: the weight version that generated its oldest token that trains
("weight_version" is the newest's)."""
_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
_FINISHED = (Status.COMPLETED, Status.TRUNCATED)


class WeightVersionError(RuntimeError):
    """An engine answered from other weights than the rollout's: the weight sync did not reach every engine."""


class RolloutError(RuntimeError):
    """A rollout that cannot produce its batch (every group keeps failing): the message has the last reason."""


_FATAL = (EngineUnavailableError, WeightVersionError)
MAX_FAILED_ROUNDS = 4
"""A rollout stops when this many over-sampling batches' worth of groups failed and none was kept."""
"""Errors that stop the rollout; any other generate error fails only its sample, with the reason."""


class Engine(Protocol):
    """What the rollout needs of an engine client (engine.client.EngineClient, engines.RoutedClient)."""

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *, return_logprob: bool = True,
                       rid: str | None = None) -> dict[str, Any]: ...

    async def generate_batch(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], *,
                             return_logprob: bool = True, rids: list[str] | None = None) -> list[dict[str, Any]]: ...

    async def abort(self, rid: str | None = None) -> Any: ...


@dataclass
class RolloutContext:
    """What a rollout needs: the config, the tokenizer, an engine client and the reward scorer."""

    config: TrainConfig
    tokenizer: Any
    client: Engine
    scorer: RewardScorer
    concurrency: int = 64
    weight_version: str | None = None
    """The weight version every response of this rollout must come from (None: not checked)."""
    generate_fn: GenerateFn | None = None
    batch_groups: bool = True
    """Send a group's samples as one batched /generate (SGLang's batch form) with the default generate."""
    router_url: str | None = None
    """The engine or router URL the rollout talks to (slime plug-ins' args.sglang_router_ip/port)."""
    api_key: str | None = field(default=None, repr=False)
    """The engines' API key (slime's `post` to router_url sends it)."""
    args: Any = None
    """What plug-ins get as `args` (slime_plugins.slime_args; built from the rest when not given)."""
    rollout_id: int | None = None
    """The rollout being generated (set by generate_rollout; slime's sample hooks get it)."""
    max_staleness: int | None = None
    """With --async: a buffered partial group whose tokens would lag rollout `rollout_id`'s trained policy by more
    versions is generated again from its prompt (config.staleness_bound; None: never)."""

    def __post_init__(self) -> None:
        path = self.config.rollout.custom_generate_function_path
        if self.generate_fn is None and path is not None:
            self.generate_fn = load_plugin(path, "custom-generate-function-path")
        if self.args is None:
            self.args = slime_args(self.config, router_url=self.router_url, concurrency=self.concurrency,
                                   client=self.client, tokenizer=self.tokenizer, _slimeflow_tokenizer=self.tokenizer,
                                   weight_version=self.weight_version,
                                   _slimeflow_reward=self.scorer.reward_of,
                                   _slimeflow_group_reward=self.scorer.rewards_of_group,
                                   _slimeflow_context=self)
            if self.api_key:
                self.args.sglang_api_key = self.api_key
            http_utils.init_http_client(self.args)
        if self.scorer.args is None:
            self.scorer.args = self.args
        self.sample_hooks = [load_plugin(path, "rollout-sample-hook-path")
                             for path in self.config.rollout.rollout_sample_hook_path or []]
        self._in_flight = 0
        self._freed = asyncio.Condition()
        self.aborting = False
        """Set while the stragglers are aborted: a group that gets its slots then is aborted unsent (slime's)."""

    @asynccontextmanager
    async def slots(self, n: int) -> AsyncIterator[None]:
        """Hold `n` of the `concurrency` request slots (a group larger than it runs alone)."""
        n = min(n, self.concurrency)
        async with self._freed:
            await self._freed.wait_for(lambda: self._in_flight + n <= self.concurrency)
            self._in_flight += n
        try:
            yield
        finally:
            async with self._freed:
                self._in_flight -= n
                self._freed.notify_all()


@dataclass
class RolloutResult:
    """The kept groups of one rollout (in request order) and what happened on the way."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]


def sampling_params(rollout: RolloutConfig, max_new_tokens: int | None = None, temperature: float | None = None,
                    top_p: float | None = None, top_k: int | None = None) -> dict[str, Any]:
    """SGLang sampling_params from the rollout flags (eval overrides as keyword arguments)."""
    params: dict[str, Any] = {
        "temperature": rollout.rollout_temperature if temperature is None else temperature,
        "top_p": rollout.rollout_top_p if top_p is None else top_p,
        "top_k": rollout.rollout_top_k if top_k is None else top_k,
        "max_new_tokens": rollout.rollout_max_response_len if max_new_tokens is None else max_new_tokens,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if rollout.rollout_stop:
        params["stop"] = list(rollout.rollout_stop)
    if rollout.rollout_stop_token_ids:
        params["stop_token_ids"] = list(rollout.rollout_stop_token_ids)
    return params


def prompt_ids(ctx: RolloutContext, sample: Sample) -> list[int]:
    """The prompt's token ids: a string as it is (slime: no special tokens added), a messages list through the
    tokenizer's chat template (with metadata['tools'])."""
    prompt = sample.prompt
    if isinstance(prompt, list):
        if not ctx.config.data.apply_chat_template:
            raise ValueError(f"sample {sample.index}: the prompt is a messages list; pass --apply-chat-template to "
                             "render it (or preprocess with --apply-chat-template)")
        prompt = ctx.tokenizer.apply_chat_template(prompt, tools=sample.metadata.get("tools"), tokenize=False,
                                                   add_generation_prompt=True)
    return list(ctx.tokenizer(prompt, add_special_tokens=False)["input_ids"])


async def default_generate(ctx: RolloutContext, sample: Sample, params: dict[str, Any]) -> Sample:
    """One turn: prompt (or a partial sample's tokens so far) -> response tokens, text and log-probs."""
    request = _prepare(ctx, sample, params)
    if request is None:
        return sample
    out = await ctx.client.generate(sample.tokens, request, return_logprob=True, rid=_rid(sample))
    return _apply(ctx, sample, out)


async def default_generate_group(ctx: RolloutContext, group: Group, params: dict[str, Any]) -> Group:
    """`default_generate` for a whole group in one batched /generate request (SGLang's batch form)."""
    share_prompt_tokens(ctx, group)
    requests = [(sample, _prepare(ctx, sample, params)) for sample in group]
    todo = [(sample, request) for sample, request in requests if request is not None]
    if todo:
        suffix = uuid.uuid4().hex[:8]  # one per request: (group, index) already tells its samples apart
        outs = await ctx.client.generate_batch([s.tokens for s, _ in todo], [r for _, r in todo],
                                               return_logprob=True, rids=[_rid(s, suffix) for s, _ in todo])
        for (sample, _), out in zip(todo, outs, strict=True):
            _apply(ctx, sample, out)
    return group


def share_prompt_tokens(ctx: RolloutContext, group: Group) -> None:
    """Tokenise the prompt once for the samples of a group that share it (256 tokenizer calls took ~15 ms of a
    rollout of 16 x 16); samples that already have tokens (partial ones) keep theirs."""
    fresh = [s for s in group if not s.tokens]
    if not fresh:
        return
    first = fresh[0]
    if all(s.prompt == first.prompt and s.metadata.get("tools") == first.metadata.get("tools") for s in fresh):
        ids = prompt_ids(ctx, first)
        for sample in fresh:
            sample.tokens = list(ids)


def _prepare(ctx: RolloutContext, sample: Sample, params: dict[str, Any]) -> dict[str, Any] | None:
    """The sample's prompt tokens and its sampling params for what is left of its budget (None: nothing left)."""
    if not sample.tokens:
        sample.tokens = prompt_ids(ctx, sample)
    continue_partial(ctx, sample)
    if sample.status in _FINISHED:
        return None  # a buffered sample that finished as the stragglers were aborted: nothing to generate (slime's)
    done = sample.response_length
    if params["max_new_tokens"] - done <= 0:
        sample.status = Status.TRUNCATED
        return None
    return dict(params, max_new_tokens=params["max_new_tokens"] - done,
                sampling_seed=sample_seed(ctx.config.data.rollout_seed, sample))


def continue_partial(ctx: RolloutContext, sample: Sample) -> None:
    """Before a partial sample (aborted in an earlier rollout) is continued: with --mask-offpolicy-in-partial-rollout
    all its earlier tokens leave the loss (as slime: an older policy generated them, even those of an earlier
    continuation); else the version that generated the oldest of them is kept, for the staleness accounting."""
    done = sample.response_length
    if not done:
        return
    if ctx.config.rollout.mask_offpolicy_in_partial_rollout:
        sample.loss_mask = [0] * done
        sample.metadata.pop(OLDEST_WEIGHT_VERSION, None)
    elif sample.metadata.get("weight_version") is not None:
        sample.metadata.setdefault(OLDEST_WEIGHT_VERSION, sample.metadata["weight_version"])


def too_stale(ctx: RolloutContext, group: Group, rollout_id: int) -> bool:
    """Whether continuing buffered `group` in rollout `rollout_id` would train tokens older than ctx.max_staleness
    versions (never when its earlier tokens are masked out of the loss)."""
    if ctx.max_staleness is None or ctx.config.rollout.mask_offpolicy_in_partial_rollout:
        return False
    versions = [s.metadata.get(OLDEST_WEIGHT_VERSION, s.metadata.get("weight_version"))
                for s in group if s.response_length]
    return any(str(v).isdigit() and rollout_id - int(v) > ctx.max_staleness for v in versions)


def _rid(sample: Sample, suffix: str | None = None) -> str:
    """A request id unique to this attempt at `sample` (a random suffix, drawn per call unless given)."""
    return f"sample-{sample.group_index}-{sample.index}-{suffix or uuid.uuid4().hex[:8]}"


def _apply(ctx: RolloutContext, sample: Sample, out: dict[str, Any]) -> Sample:
    """Append an SGLang /generate answer to the sample: tokens, text, log-probs, loss mask, status, version."""
    meta = out["meta_info"]
    check_version(ctx, meta)
    new_ids = [int(tok) for _, tok, _ in meta["output_token_logprobs"]]
    sample.tokens = sample.tokens + new_ids
    sample.response = sample.response + out["text"]
    sample.response_length += len(new_ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [float(lp) for lp, _, _ in
                                                                   meta["output_token_logprobs"]]
    if sample.loss_mask is not None:
        sample.loss_mask = sample.loss_mask + [1] * len(new_ids)
    sample.status = _FINISH[meta["finish_reason"]["type"]]
    sample.metadata["weight_version"] = meta.get("weight_version")
    return sample


def sample_seed(rollout_seed: int, sample: Sample) -> int:
    """A per-sample sampling seed, so a rerun with the same seed and weights draws the same responses."""
    key = f"{rollout_seed}:{sample.metadata.get('eval_set', '')}:{sample.group_index}:{sample.index}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")


def check_version(ctx: RolloutContext, meta: dict[str, Any]) -> None:
    """A response from other weights than the rollout's is an error, never silently mixed in."""
    served = meta.get("weight_version")
    aborted = meta["finish_reason"]["type"] == "abort"
    if ctx.weight_version is not None and served != ctx.weight_version and not aborted:
        raise WeightVersionError(f"an engine answered with weight version {served!r} during a rollout of version "
                           f"{ctx.weight_version!r}: the engines were not all updated; check the weight sync")


async def generate_group(ctx: RolloutContext, group: Group, params: dict[str, Any],
                         evaluation: bool = False) -> Group:
    """Generate every sample of a group, then reward the group. The default generate sends the group as one
    batched request; a custom generate function runs per sample (with slime's `evaluation=` when it takes it).
    Requests in flight stay within `concurrency` samples."""
    if ctx.generate_fn is None and ctx.batch_groups:
        async with ctx.slots(len(group)):
            try:
                if ctx.aborting:
                    mark_aborted(group)
                else:
                    await default_generate_group(ctx, group, params)
            except _FATAL:
                raise
            except Exception as exc:  # an engine error fails the group's samples with the reason; the rollout goes on
                for sample in group:
                    sample.mark_failed(f"generate raised {type(exc).__name__}: {exc}")
    else:
        async def one(sample: Sample) -> list[Sample]:
            async with ctx.slots(1):
                try:
                    if ctx.aborting:
                        return mark_aborted([sample])
                    if ctx.generate_fn is None:
                        return [await default_generate(ctx, sample, params)]
                    continue_partial(ctx, sample)
                    if sample.status in _FINISHED:
                        return [sample]
                    samples = await call_generate(ctx.generate_fn, ctx.args, sample, params, evaluation)
                    for produced in samples:  # the versions slime's Sample recorded from the engine's answers
                        if produced.metadata.get("weight_version") is not None:
                            check_version(ctx, {"weight_version": produced.metadata["weight_version"],
                                                "finish_reason": {"type": produced.status.value}})
                    return samples
                except _FATAL:
                    raise
                except Exception as exc:  # an engine error fails the sample with the reason; the rollout goes on
                    sample.mark_failed(f"generate raised {type(exc).__name__}: {exc}")
                    return [sample]

        # A custom generate may return several samples (a trajectory's turns): they stay in the group, in order.
        group = [s for produced in await asyncio.gather(*(one(s) for s in group)) for s in produced]
    if any(s.status is Status.ABORTED for s in group):
        return group  # not scored: it is discarded or continued next rollout
    if ctx.sample_hooks and all(s.status is not Status.FAILED for s in group):
        try:
            group = await apply_sample_hooks(ctx.sample_hooks, ctx.args, group, rollout_id=ctx.rollout_id,
                                             evaluation=evaluation)
        except Exception as exc:  # a hook that raises fails the group's samples with the reason
            for sample in group:
                sample.mark_failed(f"--rollout-sample-hook-path raised {type(exc).__name__}: {exc}")
    scorable = [s for s in group if s.status is not Status.FAILED]
    if len(scorable) == len(group):
        await ctx.scorer.score_group(group)
    return group


async def generate_rollout(ctx: RolloutContext, data: BufferedDataSource, rollout_id: int) -> RolloutResult:
    """One rollout: `rollout_batch_size` groups that pass the filter, over-sampling as needed, then slime's
    end-of-rollout hooks (slime_rollout_hooks.finish_rollout)."""
    kept, offered, metrics = await collect_rollout(ctx, data, rollout_id)
    return RolloutResult(groups=kept, metrics=finish_rollout(ctx, kept, metrics, offered, data))


async def collect_rollout(ctx: RolloutContext, data: BufferedDataSource,
                          rollout_id: int) -> tuple[list[Group], list[Group], dict[str, float]]:
    """The generation of `generate_rollout`, without its end-of-rollout hooks: (the kept groups in prompt order,
    every finished group offered to the filter, the rollout's metrics)."""
    config = ctx.config
    ctx.rollout_id = rollout_id
    sampler = DynamicSampler(config.batch.rollout_batch_size, config.rollout.over_sampling_batch_size,
                             load_group_filter(config.rollout.dynamic_sampling_filter_path, ctx.args))
    params = sampling_params(config.rollout)
    started = time.perf_counter()
    pending: set[asyncio.Task] = set()
    order: dict[asyncio.Task, int] = {}
    offered: list[Group] = []  # kept or not (slime's --rollout-all-samples-process-path sees them all)
    restarted = 0
    while not sampler.done:
        for group in data.get_groups(sampler.groups_to_request()):
            if too_stale(ctx, group, rollout_id):
                reset_group(group)
                restarted += 1
            task = asyncio.ensure_future(generate_group(ctx, group, params))
            order[task] = group[0].group_index
            pending.add(task)
        if not pending:
            raise RuntimeError("the rollout has no group in flight and too few kept; this is a bug")
        finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in finished:
            group = task.result()
            check_failures(sampler, group)
            if any(s.status is Status.ABORTED for s in group):
                # Aborted from outside (someone called /abort_request): asked again, from its prompt.
                sampler.withdraw()
                data.add_groups([reset_group(group)], rollout_id)
                continue
            sampler.offer(group)
            offered.append(group)
    aborted = await abort_stragglers(ctx, pending)
    if config.rollout.partial_rollout:
        data.add_groups(aborted, rollout_id)
    kept, surplus = sampler.result()
    kept.sort(key=lambda g: g[0].group_index)
    metrics = rollout_metrics(kept, sampler.stats(), time.perf_counter() - started)
    metrics.update({"rollout/aborted_groups": len(aborted), "rollout/surplus_groups": len(surplus),
                    "rollout/partial_restarted_groups": restarted})
    return kept, offered, metrics


def check_failures(sampler: DynamicSampler, group: Group) -> None:
    """Stop a rollout whose groups all fail (a bad prompt format, a broken reward) instead of looping forever."""
    failed = sampler.dropped["failed_sample"] + any(s.status is Status.FAILED for s in group)
    if not sampler.kept and failed >= MAX_FAILED_ROUNDS * sampler.over_sampling_batch_size:
        reason = next((s.failure_reason for s in group if s.failure_reason), "see the earlier groups")
        raise RolloutError(f"{failed} groups in a row failed and none was kept; the last failure: {reason}")


async def abort_stragglers(ctx: RolloutContext, pending: set[asyncio.Task]) -> list[Group]:
    """Abort every request still in flight and collect their groups (partial responses included)."""
    if not pending:
        return []
    ctx.aborting = True  # those still waiting for a slot: not sent at all
    try:
        await ctx.client.abort()
        done, _ = await asyncio.wait(pending, timeout=60)
    finally:
        ctx.aborting = False
    groups = [t.result() for t in done if not t.cancelled() and t.exception() is None]
    for task in pending - done:
        task.cancel()
    return [g for g in groups if all(s.status is not Status.FAILED for s in g)]


def mark_aborted(samples: list[Sample]) -> list[Sample]:
    """Samples that the abort of the stragglers reached before they were sent: aborted, as they are (a buffered
    sample that had finished stays finished)."""
    for sample in samples:
        if sample.status not in _FINISHED:
            sample.status = Status.ABORTED
    return samples


def reset_group(group: Group) -> Group:
    """A group to generate again from its prompt: its generation was cut from outside, or (a partial one) it would
    train on tokens too stale."""
    for sample in group:
        sample.tokens, sample.response, sample.response_length = [], "", 0
        sample.rollout_log_probs, sample.reward, sample.status, sample.loss_mask = None, None, Status.PENDING, None
        sample.weight_versions = []  # a slime generate's record of the versions that answered (see returned_sample)
        for key in (START_ROLLOUT_ID, OLDEST_WEIGHT_VERSION, "weight_version"):
            sample.metadata.pop(key, None)
    return group


def rollout_metrics(groups: Sequence[Group], sampler_stats: dict[str, int], seconds: float) -> dict[str, float]:
    """Reward mean and spread, response lengths, truncation rate, throughput, sampler counts."""
    samples = [s for g in groups for s in g]
    rewards = [float(s.reward) for s in samples]
    lengths = [s.response_length for s in samples]
    n = max(len(samples), 1)
    mean = sum(rewards) / n
    metrics = {
        "rollout/reward_mean": mean,
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/reward_min": min(rewards, default=0.0),
        "rollout/reward_max": max(rewards, default=0.0),
        "rollout/response_len_mean": sum(lengths) / n,
        "rollout/response_len_max": float(max(lengths, default=0)),
        "rollout/truncated_rate": sum(s.status is Status.TRUNCATED for s in samples) / n,
        "rollout/seconds": seconds,
        "rollout/tokens_per_s": sum(lengths) / max(seconds, 1e-9),
        "rollout/completions_per_s": len(samples) / max(seconds, 1e-9),
    }
    metrics.update({f"rollout/sampler_{k}": float(v) for k, v in sampler_stats.items()})
    return metrics
