"""Rewards: built-in rm_types, a custom function, or a remote reward server; a reward that raises fails the sample.

Precedence, as slime: --custom-rm-path, else the rm_type of the sample (metadata["rm_type"], else --rm-type);
rm_type "remote_rm" (or no rm_type with --rm-url set) asks the reward server; the built-in rm_types (and their
`boxed_` prefix) are rule_rewards'. A custom function, a server or rm_type dapo may answer a dict: --reward-key
(--eval-reward-key for eval samples) names the entry that is the reward.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import random
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import httpx

from slimeflow.config.train import RewardConfig
from slimeflow.rollout.answers import MathJudge
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.rule_rewards import builtin_reward
from slimeflow.rollout.slime_plugins import returned_sample
from slimeflow.rollout.types import Sample, Status

EVAL_SET = "eval_set"
"""metadata key naming an eval sample's set (evaluation sets it): such a sample's reward is --eval-reward-key's."""


class RemoteRewardError(RuntimeError):
    """The reward server did not answer usefully after all retries."""


class RemoteReward:
    """A reward server over HTTP: POST {prompt, response, label, metadata} -> a number, or {"reward": number}."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5):
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    async def __call__(self, sample: Sample, reward_key: str | None = None) -> float:
        return await self.ask(sample, lambda body: _reward_value(body, reward_key))

    async def ask(self, sample: Sample, read: Callable[[Any], Any] = lambda body: body) -> Any:
        """The server's JSON answer for `sample`, passed through `read`; a ValueError from `read` (a body that is not
        a reward) counts as a failed attempt, like an HTTP error."""
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
                   "metadata": sample.metadata, "index": sample.index, "group_index": sample.group_index}
        last = ""
        for attempt in range(self.retries):
            try:
                async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                    reply = await client.post(self.url, json=payload)
                reply.raise_for_status()
                return read(reply.json())
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                if attempt + 1 < self.retries:
                    await asyncio.sleep(self.backoff_s * 2**attempt)
        raise RemoteRewardError(f"reward server {self.url} failed after {self.retries} attempts "
                                f"(timeout {self.timeout_s} s each); last error: {last}. Check --rm-url and the server")


def _reward_value(body: Any, reward_key: str | None) -> float:
    try:
        return reward_value(body, reward_key)
    except ValueError as err:
        raise ValueError(f"the reward server answered {str(body)[:200]!r}: {err}; expected a number or "
                         "{'reward': number}") from None


def reward_value(value: Any, reward_key: str | None) -> float:
    """A reward function's answer as a finite number: a number, or the `reward_key` entry of a dict (without a key,
    its 'reward', else its 'score')."""
    if isinstance(value, dict):
        if reward_key is None and not {"reward", "score"} & set(value):
            raise ValueError(f"returned a dict with keys {sorted(value)[:10]}; name the reward's with --reward-key "
                             "(and --eval-reward-key for evaluation)")
        key = reward_key or ("reward" if "reward" in value else "score")
        if key not in value:
            raise ValueError(f"returned a dict without {key!r} (--reward-key / --eval-reward-key); its keys are "
                             f"{sorted(value)[:10]}")
        value = value[key]
    return _finite(value)


class RewardScorer:
    """Scores samples in place: sets `reward`, or marks the sample failed with the reason when scoring raised.

    A judge passed in stays the caller's to close; one made here is closed by `close()`. `seed` seeds rm_type
    random (callers pass --rollout-seed, which seeds slime's rollout-process generator).
    """

    def __init__(self, config: RewardConfig, judge: MathJudge | None = None, remote: RemoteReward | None = None,
                 seed: int = 0, args: Any = None, post_processed: bool = False):
        """`post_processed`: a --custom-reward-post-process-path turns the rewards into numbers afterwards, so a
        custom reward's dict answer is kept as it is for it (slime's on-policy distillation returns the teacher
        server's whole answer)."""
        self.config, self.seed, self.post_processed = config, seed, post_processed
        self.args = args
        """slime's `args` for --custom-rm-path (slime_plugins.slime_args; the rollout sets it when None)."""
        self._owns_judge = judge is None
        self.judge = judge or MathJudge()
        self.custom = load_plugin(config.custom_rm_path, "custom-rm-path") if config.custom_rm_path else None
        if config.group_rm and self.custom is None:
            raise ValueError("--group-rm needs --custom-rm-path (a function that rewards a whole group)")
        self.remote = remote or (RemoteReward(config.rm_url) if config.rm_url else None)

    def close(self) -> None:
        """Stop the grading worker process of a judge this scorer made."""
        if self._owns_judge:
            self.judge.close()

    async def score_group(self, group: Sequence[Sample]) -> None:
        """Reward every sample of one group (a group function with --group-rm, else sample by sample). Without
        --group-rm a reward the generate function already set is kept (as slime), read with --reward-key."""
        if not self.config.group_rm:
            group = [s for s in group if not self._keep_preset(s)]
        if not self.config.group_rm and self.custom is None and self.remote is None:
            for sample in group:  # built-ins are plain functions: no task per sample (~4 us each)
                self._score_builtin(sample)
            return
        if not self.config.group_rm:
            await asyncio.gather(*(self.score(sample) for sample in group))
            return
        try:
            rewards = await _maybe_await(self.custom(self._args(), list(group)))
            if len(rewards) != len(group):
                raise ValueError(f"returned {len(rewards)} rewards for a group of {len(group)}")
            values = [reward_value(r, self.reward_key(s)) for r, s in zip(rewards, group, strict=True)]
        except Exception as exc:
            for sample in group:
                sample.mark_failed(f"group reward {self.config.custom_rm_path} raised {type(exc).__name__}: {exc}")
            return
        for sample, value in zip(group, values, strict=True):
            sample.reward = value

    def _keep_preset(self, sample: Sample) -> bool:
        """Whether `sample` already has its reward (set by a generate function); a dict one is read by key."""
        if sample.reward is None:
            return False
        try:
            sample.reward = reward_value(sample.reward, self.reward_key(sample))
        except ValueError as exc:
            sample.mark_failed(f"the reward the generate function set: {exc}")
        return True

    async def score(self, sample: Sample) -> None:
        """Reward one sample."""
        if self.custom is None and self.remote is None:
            self._score_builtin(sample)
            return
        source = "reward"
        try:
            source = self._source(sample)
            if self.custom is not None:
                value = await _maybe_await(self.custom(self._args(), sample))
                if self.post_processed and isinstance(value, dict) and self.reward_key(sample) is None:
                    sample.reward = value  # for the post-process, which returns the numbers
                    return
            elif source == "remote_rm":
                value = await self.remote(sample, self.reward_key(sample))
            else:
                value = self._builtin(source, sample)
            sample.reward = reward_value(value, self.reward_key(sample))
        except Exception as exc:
            sample.mark_failed(f"{source} raised {type(exc).__name__}: {exc}")

    def _args(self) -> Any:
        """What a custom reward gets as `args`: the rollout's slime args, else the reward flags by their names."""
        return self.args if self.args is not None else SimpleNamespace(**self.config.model_dump())

    async def reward_of(self, view: Any) -> float:
        """The reward of slime's Sample `view` (for slime's generate_and_rm); raises what scoring raised. A copy is
        scored: scoring marks a failure on its sample, and slime's generate_and_rm takes only the number."""
        sample = copy.copy(returned_sample(view, "generate_and_rm"))
        await self.score(sample)
        if sample.status is Status.FAILED:
            raise ValueError(sample.failure_reason)
        return sample.reward

    async def rewards_of_group(self, views: list[Any]) -> list[float]:
        """The rewards of a group of slime Samples with --group-rm (for slime's generate_and_rm_group)."""
        samples = [copy.copy(returned_sample(view, "generate_and_rm_group")) for view in views]
        await self.score_group(samples)
        failed = [s.failure_reason for s in samples if s.status is Status.FAILED]
        if failed:
            raise ValueError(failed[0])
        return [s.reward for s in samples]

    def _score_builtin(self, sample: Sample) -> None:
        """Reward one sample with a built-in rm_type (no custom function, no reward server)."""
        source = "reward"
        try:
            source = self._source(sample)
            sample.reward = reward_value(self._builtin(source, sample), self.reward_key(sample))
        except Exception as exc:
            sample.mark_failed(f"{source} raised {type(exc).__name__}: {exc}")

    def _builtin(self, rm_type: str, sample: Sample) -> Any:
        return builtin_reward(rm_type, sample.response, sample.label, sample.metadata, self.judge, self._rng(sample))

    def _rng(self, sample: Sample) -> random.Random:
        return sample_rng(self.seed, sample)

    def reward_key(self, sample: Sample) -> str | None:
        """--reward-key, or for an eval sample --eval-reward-key (default --reward-key), as slime."""
        if EVAL_SET in sample.metadata:
            return self.config.eval_reward_key or self.config.reward_key
        return self.config.reward_key

    def _source(self, sample: Sample) -> str:
        if self.custom is not None:
            return str(self.config.custom_rm_path)
        rm_type = sample.metadata.get("rm_type") or self.config.rm_type
        if rm_type is None and self.remote is not None:
            return "remote_rm"
        if rm_type is None:
            raise ValueError("no reward is configured: set --rm-type, metadata['rm_type'], --custom-rm-path or --rm-url")
        if rm_type == "remote_rm" and self.remote is None:
            raise ValueError("rm_type remote_rm needs --rm-url (the reward server's URL)")
        return rm_type


def sample_rng(seed: int, sample: Sample) -> random.Random:
    """rm_type random's generator for `sample`: seeded by (seed, sample), so a rerun draws the same rewards
    whatever order the samples are scored in (slime draws from its rollout process's global generator)."""
    return random.Random(f"{seed}:{sample.metadata.get(EVAL_SET, '')}:{sample.group_index}:{sample.index}")


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _finite(value: Any) -> float:
    # A bool is a number, as in slime (dapo's 'acc' as --eval-reward-key): True is 1.0.
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"the reward must be a finite number, got {value!r}")
    return float(value)
