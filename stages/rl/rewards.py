"""Rewards: built-in rm_types, a custom function, or a remote reward server; a reward that raises fails the sample.

Precedence, as slime: --custom-rm-path, else the rm_type of the sample (metadata["rm_type"], else --rm-type);
rm_type "remote_rm" (or no rm_type with --rm-url set) asks the reward server. A `boxed_` prefix scores the content
of the response's last \\boxed{} with the rm_type after the prefix. A custom function or a server may answer a
dict: --reward-key (--eval-reward-key for eval samples) names the entry that is the reward.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import httpx

from slimeflow.stages.rl.answers import MathJudge, after_thinking, last_boxed
from slimeflow.stages.rl.config import RewardConfig
from slimeflow.stages.rl.plugins import load_plugin
from slimeflow.stages.rl.slime_plugins import from_slime, to_slime
from slimeflow.stages.rl.types import Sample, Status

EVAL_SET = "eval_set"
"""metadata key naming an eval sample's set (evaluation sets it): such a sample's reward is --eval-reward-key's."""

BuiltinReward = Callable[[str, str | None, dict[str, Any], MathJudge], float]
"""(response, label, metadata, judge) -> reward."""


def _need_label(label: Any, rm_type: str) -> str:
    """The label as text (a number from a JSON-label set as its JSON text); a structured label is refused."""
    if label is None:
        raise ValueError(f"rm_type {rm_type!r} compares against a label, and this sample has none (set --label-key)")
    if isinstance(label, int | float) and not isinstance(label, bool):
        return json.dumps(label)
    if not isinstance(label, str):
        raise ValueError(f"rm_type {rm_type!r} compares against a text label, and this sample's label is a "
                         f"{type(label).__name__}; score structured labels with --custom-rm-path")
    return label


def math_reward(response: str, label: str | None, metadata: dict[str, Any], judge: MathJudge) -> float:
    """1.0 when the last \\boxed{} answer equals the label (math-verify), else 0.0 (also when nothing is boxed)."""
    gold = _need_label(label, "math")
    answer = last_boxed(response)
    return float(answer is not None and judge.equal(answer, last_boxed(gold) or gold))


def deepscaler_reward(response: str, label: str | None, metadata: dict[str, Any], judge: MathJudge) -> float:
    """DeepScaleR: 0.0 unless the response closes its reasoning (</think>); then the math reward of the rest."""
    solution = after_thinking(response)
    return 0.0 if solution is None else math_reward(solution, label, metadata, judge)


_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def dapo_reward(response: str, label: str | None, metadata: dict[str, Any], judge: MathJudge) -> float:
    """DAPO: the last `Answer: ...` in the final 300 characters; 1.0 when it equals the label, else -1.0."""
    gold = _need_label(label, "dapo")
    found = _DAPO_ANSWER.findall(response[-300:])
    if not found:
        return -1.0
    answer = found[-1].strip().rstrip(".")
    return 1.0 if judge.equal(last_boxed(answer) or answer, gold) else -1.0


_PUNCTUATION = frozenset(string.punctuation)


def _f1_tokens(text: str) -> list[str]:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1_reward(response: str, label: str | None, metadata: dict[str, Any], judge: MathJudge) -> float:
    """SQuAD token F1 between the answer (boxed, else the text after the reasoning, else all) and the label."""
    gold = _f1_tokens(_need_label(label, "f1"))
    answer = last_boxed(response) or after_thinking(response) or response
    pred = _f1_tokens(answer)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


_CHOICE_PATTERNS = (
    r"\\boxed\{\s*\(?([A-Z])\)?\s*\}",
    r"(?i:answer)\s*(?:is|:)?\s*:?\s*\(?([A-Z])\)?(?![A-Za-z])",
    r"\(([A-Z])\)",
)


def choice_letter(text: str, letters: str) -> str | None:
    """The multiple-choice letter a response commits to (boxed, `answer is (B)`, `Answer: B`, `(B)`), else None."""
    for pattern in _CHOICE_PATTERNS:
        found = [m for m in re.findall(pattern, text) if m in letters]
        if found:
            return found[-1]
    return None


def gpqa_reward(response: str, label: str | None, metadata: dict[str, Any], judge: MathJudge) -> float:
    """GPQA-style multiple choice: 1.0 when the chosen letter is the label's.

    The label is a letter (`B` or `(B)`), or the text of the right option when metadata["choices"] lists them.
    """
    gold = _need_label(label, "gpqa").strip()
    choices = metadata.get("choices") or []
    letters = string.ascii_uppercase[:max(len(choices), 4)]
    if gold in choices:
        gold = letters[choices.index(gold)]
    gold = gold.strip("()")
    if gold not in letters:
        raise ValueError(f"gpqa label {label!r} is neither a choice letter ({letters}) nor one of metadata['choices']")
    return float(choice_letter(after_thinking(response) or response, letters) == gold)


def prefix_match_reward(response: str, label: str | None, metadata: dict[str, Any], judge: MathJudge) -> float:
    """1.0 when the response, leading whitespace removed, starts with the label (short exact answers), else 0.0."""
    gold = _need_label(label, "prefix_match").strip()
    if not gold:
        raise ValueError("rm_type 'prefix_match' needs a non-empty label")
    return float(response.lstrip().startswith(gold))


BUILTIN_REWARDS: dict[str, BuiltinReward] = {
    "math": math_reward,
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "f1": f1_reward,
    "gpqa": gpqa_reward,
    "prefix_match": prefix_match_reward,
}


def builtin_reward(rm_type: str, response: str, label: str | None, metadata: dict[str, Any],
                   judge: MathJudge) -> float:
    """The reward of built-in `rm_type` (with an optional `boxed_` prefix)."""
    if rm_type.startswith("boxed_"):
        # Only the last boxed answer is scored; it stays boxed so that boxed-answer rm_types still find it.
        boxed = last_boxed(response)
        response, rm_type = ("" if boxed is None else f"\\boxed{{{boxed}}}"), rm_type[len("boxed_"):]
    if rm_type not in BUILTIN_REWARDS:
        raise ValueError(f"unknown rm_type {rm_type!r}; built-ins are {', '.join(BUILTIN_REWARDS)} "
                         "(optionally with a boxed_ prefix), or remote_rm with --rm-url")
    return BUILTIN_REWARDS[rm_type](response, label, metadata, judge)


class RemoteRewardError(RuntimeError):
    """The reward server did not answer usefully after all retries."""


class RemoteReward:
    """A reward server over HTTP: POST {prompt, response, label, metadata} -> a number, or {"reward": number}."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5):
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    async def __call__(self, sample: Sample, reward_key: str | None = None) -> float:
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
                   "metadata": sample.metadata, "index": sample.index, "group_index": sample.group_index}
        last = ""
        for attempt in range(self.retries):
            try:
                async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                    reply = await client.post(self.url, json=payload)
                reply.raise_for_status()
                return _reward_value(reply.json(), reward_key)
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

    A judge passed in stays the caller's to close; one made here is closed by `close()`.
    """

    def __init__(self, config: RewardConfig, judge: MathJudge | None = None, remote: RemoteReward | None = None,
                 args: Any = None):
        self.config = config
        self.args = args
        """slime's `args` for --custom-rm-path (slime_plugins.slime_args; the rollout sets it when None)."""
        self._owns_judge = judge is None
        self.judge = judge or MathJudge()
        self.custom = load_plugin(config.custom_rm_path, "custom-rm-path") if config.custom_rm_path else None
        if config.group_rm and self.custom is None:
            raise ValueError("--group-rm needs --custom-rm-path (a function that rewards a whole group)")
        self.remote = remote or (RemoteReward(config.rm_url) if config.rm_url else None)

    def close(self) -> None:
        """Stop the math-verify worker process of a judge this scorer made."""
        if self._owns_judge:
            self.judge.close()

    async def score_group(self, group: Sequence[Sample]) -> None:
        """Reward every sample of one group (a group function with --group-rm, else sample by sample). Without
        --group-rm, a sample that already has a reward (its custom generate function set it) keeps it, as slime."""
        if not self.config.group_rm:
            given = [s for s in group if s.reward is not None]
            for sample in given:
                try:
                    sample.reward = reward_value(sample.reward, self.reward_key(sample))
                except Exception as exc:
                    sample.mark_failed(f"the reward the generate function set: {type(exc).__name__}: {exc}")
            group = [s for s in group if s.reward is None and s.status is not Status.FAILED]
        if not self.config.group_rm and self.custom is None and self.remote is None:
            for sample in group:  # built-ins are plain functions: no task per sample (~4 us each)
                self._score_builtin(sample)
            return
        if not self.config.group_rm:
            await asyncio.gather(*(self.score(sample) for sample in group))
            return
        try:
            rewards = await _maybe_await(self.custom(self._args(), [to_slime(s) for s in group]))
            if len(rewards) != len(group):
                raise ValueError(f"returned {len(rewards)} rewards for a group of {len(group)}")
            values = [reward_value(r, self.reward_key(s)) for r, s in zip(rewards, group, strict=True)]
        except Exception as exc:
            for sample in group:
                sample.mark_failed(f"group reward {self.config.custom_rm_path} raised {type(exc).__name__}: {exc}")
            return
        for sample, value in zip(group, values, strict=True):
            sample.reward = value

    async def score(self, sample: Sample) -> None:
        """Reward one sample."""
        if self.custom is None and self.remote is None:
            self._score_builtin(sample)
            return
        source = "reward"
        try:
            source = self._source(sample)
            if self.custom is not None:
                value = await _maybe_await(self.custom(self._args(), to_slime(sample)))
            elif source == "remote_rm":
                value = await self.remote(sample, self.reward_key(sample))
            else:
                value = builtin_reward(source, sample.response, sample.label, sample.metadata, self.judge)
            sample.reward = reward_value(value, self.reward_key(sample))
        except Exception as exc:
            sample.mark_failed(f"{source} raised {type(exc).__name__}: {exc}")

    def _args(self) -> Any:
        """What a custom reward gets as `args`: the rollout's slime args, else the reward flags by their names."""
        return self.args if self.args is not None else SimpleNamespace(**self.config.model_dump())

    async def reward_of(self, view: Any) -> float:
        """The reward of slime's Sample `view` (for slime's generate_and_rm); raises what scoring raised."""
        sample = from_slime(view, view, "generate_and_rm")
        await self.score(sample)
        if sample.status is Status.FAILED:
            raise ValueError(sample.failure_reason)
        return sample.reward

    async def rewards_of_group(self, views: list[Any]) -> list[float]:
        """The rewards of a group of slime Samples with --group-rm (for slime's generate_and_rm_group)."""
        samples = [from_slime(view, view, "generate_and_rm_group") for view in views]
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
            sample.reward = _finite(builtin_reward(source, sample.response, sample.label, sample.metadata,
                                                   self.judge))
        except Exception as exc:
            sample.mark_failed(f"{source} raised {type(exc).__name__}: {exc}")

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


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"the reward must be a finite number, got {value!r}")
    return float(value)
