"""Rewards: rm_type precedence, custom and group rewards, the remote server, failures, threads."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from paths import DATA

from slimeflow.config.train import RewardConfig
from slimeflow.rollout import answers
from slimeflow.rollout.answers import MathJudge
from slimeflow.rollout.rewards import RemoteReward, RewardScorer
from slimeflow.rollout.rule_rewards import builtin_reward
from slimeflow.rollout.types import Sample, Status


@pytest.fixture(scope="module")
def judge():
    with MathJudge() as judge:
        yield judge


def sample(response: str, label: str | None = "0.5", **metadata) -> Sample:
    return Sample(group_index=0, index=0, prompt="q", response=response, label=label, metadata=metadata)


def score(scorer: RewardScorer, *samples: Sample) -> list[Sample]:
    asyncio.run(scorer.score_group(list(samples)))
    return list(samples)


def test_metadata_rm_type_overrides_the_flag(judge):
    scorer = RewardScorer(RewardConfig(rm_type="f1"), judge=judge)
    by_flag, by_metadata = score(scorer, sample(r"\boxed{1/2}"), sample(r"\boxed{1/2}", rm_type="math"))
    assert by_flag.reward == 0.0 and by_metadata.reward == 1.0


def test_unknown_or_missing_rm_type_fails_the_sample_with_the_reason(judge):
    unknown, missing = score(RewardScorer(RewardConfig(), judge=judge), sample("x", rm_type="nope"), sample("x"))
    assert unknown.status is Status.FAILED and "built-ins are math, deepscaler, dapo, f1, gpqa" in unknown.failure_reason
    assert missing.status is Status.FAILED and "no reward is configured" in missing.failure_reason
    (no_label,) = score(RewardScorer(RewardConfig(rm_type="f1"), judge=judge), sample("1", label=None))
    assert "has none (set --label-key)" in no_label.failure_reason


async def length_reward(args, sample):
    return len(sample.response) / 10


def failing_reward(args, sample):
    raise RuntimeError(f"judge model is down for {sample.response!r}")


def nan_reward(args, sample):
    return math.nan


async def group_reward(args, samples):
    best = max(len(s.response) for s in samples)
    return [float(len(s.response) == best) for s in samples]


def test_custom_rewards_sync_async_and_failing(judge):
    (ok,) = score(RewardScorer(RewardConfig(custom_rm_path=f"{__name__}:length_reward"), judge=judge), sample("abcde"))
    assert ok.reward == 0.5 and ok.status is Status.PENDING
    (bad,) = score(RewardScorer(RewardConfig(custom_rm_path=f"{__name__}:failing_reward"), judge=judge), sample("xy"))
    assert bad.status is Status.FAILED and bad.reward is None
    assert bad.failure_reason == (f"{__name__}:failing_reward raised RuntimeError: judge model is down for 'xy'")
    (nan,) = score(RewardScorer(RewardConfig(custom_rm_path=f"{__name__}:nan_reward"), judge=judge), sample("xy"))
    assert nan.status is Status.FAILED and "finite number" in nan.failure_reason


def test_group_reward(judge):
    scorer = RewardScorer(RewardConfig(custom_rm_path=f"{__name__}:group_reward", group_rm=True), judge=judge)
    assert [s.reward for s in score(scorer, sample("a"), sample("abc"), sample("ab"))] == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="--group-rm needs --custom-rm-path"):
        RewardScorer(RewardConfig(group_rm=True, rm_type="math"))


class _RewardHandler(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):  # noqa: N802 (http.server's naming)
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["response"] == "flaky" and type(self).calls % 2:
            self.send_response(503)
            self.end_headers()
            return
        reply = json.dumps({"reward": 1.0 if body["response"] == body["label"] else 0.0}).encode()
        if body["response"] == "garbage":
            reply = b'"not a number"'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def reward_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/reward"
    server.shutdown()
    server.server_close()


def test_remote_reward_server(judge, reward_server):
    remote = RemoteReward(reward_server, timeout_s=5, retries=3, backoff_s=0.01)
    scorer = RewardScorer(RewardConfig(rm_url=reward_server), judge=judge, remote=remote)
    right, wrong, flaky = score(scorer, sample("0.5"), sample("7"), sample("flaky", label="flaky"))
    assert (right.reward, wrong.reward, flaky.reward) == (1.0, 0.0, 1.0)  # flaky: a 503, then a retry
    (garbage,) = score(scorer, sample("garbage"))
    assert garbage.status is Status.FAILED and "after 3 attempts" in garbage.failure_reason
    assert "expected a number" in garbage.failure_reason


def test_unreachable_reward_server_fails_the_sample_with_url_and_attempts(judge):
    url = "http://127.0.0.1:9/reward"  # the discard port: nothing listens
    scorer = RewardScorer(RewardConfig(rm_url=url), judge=judge,
                          remote=RemoteReward(url, timeout_s=1, retries=2, backoff_s=0.01))
    (down,) = score(scorer, sample("0.5"))
    assert down.status is Status.FAILED
    assert f"reward server {url} failed after 2 attempts" in down.failure_reason and "ConnectError" in down.failure_reason


def test_math_rewards_work_off_the_main_thread(judge):
    """SIGALRM cannot be set outside the main thread; the judge's worker process gives the same answers there."""
    rows = [json.loads(line) for name in ("math", "deepscaler")
            for line in (DATA / "rm_hub" / f"{name}.jsonl").read_text().splitlines()]
    rows = [row for row in rows if not isinstance(row["slime"], dict)]
    results: list[float] = []

    def worker():
        async def main():
            return await asyncio.gather(*(asyncio.to_thread(
                builtin_reward, row["rm_type"], row["response"], row["label"], row["metadata"], judge) for row in rows))
        results.extend(asyncio.run(main()))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=120)
    assert results == [row["slime"] for row in rows]
    assert judge.worker_timeouts == 0


def test_a_worker_check_past_the_backstop_is_killed_and_counts_as_not_equal():
    judge = MathJudge(backstop_s=0.01)  # shorter than the worker's start-up: the first check always overruns
    try:
        results: list[bool] = []
        thread = threading.Thread(target=lambda: results.append(judge.equal("1", "1")))
        thread.start()
        thread.join(timeout=60)
        assert results == [False] and judge.worker_timeouts == 1
        judge.backstop_s = 60
        thread = threading.Thread(target=lambda: results.append(judge.equal("1", "1")))  # a fresh worker
        thread.start()
        thread.join(timeout=90)
        assert results == [False, True]
    finally:
        judge.close()


async def keyed_reward(args, sample):
    """A Search-R1-style reward: the label is a dict (reward_model), the answer a dict of scores."""
    hit = sample.response in sample.label["ground_truth"]["target"]
    return {"score": float(hit), "format": 0.5}


def test_reward_key_picks_the_entry_of_a_dict_reward_and_eval_reward_key_that_of_an_eval_sample(judge):
    label = {"ground_truth": {"target": ["Ada"]}, "style": "rule"}
    config = RewardConfig(custom_rm_path=f"{__name__}:keyed_reward", reward_key="score", eval_reward_key="format")
    train, evaluated = score(RewardScorer(config, judge=judge), sample("Ada", label=label),
                             sample("Ada", label=label, eval_set="held"))
    assert (train.reward, evaluated.reward) == (1.0, 0.5)
    by_default = RewardConfig(custom_rm_path=f"{__name__}:keyed_reward", reward_key="format")
    (evaluated,) = score(RewardScorer(by_default, judge=judge), sample("Bob", label=label, eval_set="held"))
    assert evaluated.reward == 0.5  # --eval-reward-key defaults to --reward-key, as slime
    wrong = RewardConfig(custom_rm_path=f"{__name__}:keyed_reward", reward_key="acc")
    (failed,) = score(RewardScorer(wrong, judge=judge), sample("Ada", label=label))
    assert failed.status is Status.FAILED and "without 'acc'" in failed.failure_reason
    assert "['format', 'score']" in failed.failure_reason


def test_built_in_rewards_take_number_labels_and_refuse_structured_ones_by_name(judge):
    scorer = RewardScorer(RewardConfig(rm_type="prefix_match"), judge=judge)
    number, structured = score(scorer, sample("42 apples", label=42), sample("x", label={"ground_truth": "x"}))
    assert number.reward == 1.0
    assert structured.status is Status.FAILED and "label is a dict; score structured labels with --custom-rm-path" \
        in structured.failure_reason


def _slow_grade(pred: str, gold: str) -> bool:
    time.sleep(5)
    return True


def test_a_check_past_the_timeout_on_the_main_thread_counts_as_not_equal(monkeypatch):
    """slime's grader ends in sympy.simplify, which can run away: SIGALRM ends the check after timeout_s."""
    monkeypatch.setattr(answers, "grade", _slow_grade)
    started = time.monotonic()
    assert MathJudge(timeout_s=1).equal("1", "1") is False
    assert time.monotonic() - started < 3
