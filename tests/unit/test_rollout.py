"""The rollout function against a scripted engine client: dynamic sampling, stragglers, partial rollouts,
weight versions, failures; and the eval metrics (avg@n, pass@k)."""

from __future__ import annotations

import asyncio
import math

import pytest

from slimeflow.config.train import TrainConfig
from slimeflow.rollout.data_source import START_ROLLOUT_ID, BufferedDataSource, DataSource
from slimeflow.rollout.evaluation import EvalSettings, evaluate_sets, pass_at_k, score_set
from slimeflow.rollout.rewards import RewardScorer
from slimeflow.rollout.rollout import (
    RolloutContext,
    RolloutError,
    WeightVersionError,
    generate_rollout,
    sampling_params,
)
from slimeflow.rollout.types import Sample, Status


class CharTokenizer:
    """One token per character (ids are code points)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


class ScriptedEngine:
    """Answers each prompt with a scripted text, one token per character. Prompts in `hang` stream one token and
    then wait until aborted; `fail` prompts raise; `version` is reported in every response."""

    def __init__(self, answers, hang=(), fail=(), version="0"):
        self.answers, self.hang, self.fail, self.version = answers, set(hang), set(fail), version
        self.aborted = asyncio.Event()
        self.requests: list[tuple[str, dict]] = []
        self.batches = 0

    async def generate(self, input_ids, params, return_logprob=True, rid=None):
        prompt = "".join(chr(i) for i in input_ids)
        self.requests.append((prompt, dict(params)))
        key = next((p for p in self.answers if prompt.startswith(p)), prompt)
        if key in self.fail:
            raise ConnectionError("engine dropped the connection")
        text, finish = self.answers.get(key, "0"), "stop"
        if key in self.hang and not prompt.endswith("…"):
            await self.aborted.wait()
            text, finish = "…", "abort"
        text = text[:params["max_new_tokens"]]
        if finish == "stop" and len(self.answers.get(key, "0")) > params["max_new_tokens"]:
            finish = "length"
        meta = {"finish_reason": {"type": finish}, "weight_version": self.version,
                "output_token_logprobs": [[-0.5, ord(c), None] for c in text]}
        return {"text": text, "meta_info": meta}

    async def generate_batch(self, input_ids, params, return_logprob=True, rids=None):
        self.batches += 1
        return list(await asyncio.gather(*(self.generate(ids, p, return_logprob, rid)
                                           for ids, p, rid in zip(input_ids, params, rids, strict=True))))

    async def abort(self, rid=None):
        self.aborted.set()


def right_on_even_samples_only(engine: ScriptedEngine, prompt: str) -> None:
    """Make `engine` answer `prompt` wrongly ("0") on odd sample indexes, so its group's rewards are mixed."""
    original = engine.generate

    async def half_right(input_ids, params, return_logprob=True, rid=None):
        out = await original(input_ids, params, return_logprob, rid)
        if "".join(map(chr, input_ids)).startswith(prompt) and int(rid.split("-")[2]) % 2:
            out["text"] = "0"
        return out

    engine.generate = half_right


def config(**train) -> TrainConfig:
    base = {"batch": {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 3},
            "reward": {"rm_type": "prefix_match"}, "rollout": {"rollout_max_response_len": 4}}
    for group, values in train.items():
        base.setdefault(group, {}).update(values)
    return TrainConfig.model_validate(base)


def prompts(*texts):
    return [{"prompt": t, "label": t[-1], "row_id": f"row-{t}"} for t in texts]


def run(ctx, data, rollout_id=0):
    return asyncio.run(generate_rollout(ctx, data, rollout_id))


@pytest.fixture
def make_ctx():
    scorers = []

    def make(engine, cfg, version=None, batch_groups=True):
        scorers.append(RewardScorer(cfg.reward))
        return RolloutContext(cfg, CharTokenizer(), engine, scorers[-1], concurrency=8, weight_version=version,
                              batch_groups=batch_groups)

    yield make
    for scorer in scorers:
        scorer.close()


@pytest.mark.parametrize("batch_groups", [True, False], ids=["group-batched", "per-sample"])
def test_samples_carry_tokens_logprobs_rewards_and_status(make_ctx, batch_groups):
    engine = ScriptedEngine({"a1": "1", "b2": "2xxxxxx"})
    cfg = config()
    data = BufferedDataSource(DataSource(prompts("a1", "b2"), n_samples_per_prompt=2))
    result = run(make_ctx(engine, cfg, batch_groups=batch_groups), data)
    assert engine.batches == (2 if batch_groups else 0)
    first, second = result.groups
    assert [s.metadata["row_id"] for s in first] == ["row-a1", "row-a1"]
    sample = first[0]
    assert sample.tokens == [ord("a"), ord("1"), ord("1")] and sample.response_length == 1
    assert sample.rollout_log_probs == [-0.5] and sample.reward == 1.0 and sample.status is Status.COMPLETED
    assert second[0].status is Status.TRUNCATED and second[0].response == "2xxx" and second[0].reward == 1.0
    params = engine.requests[0][1]
    assert params["max_new_tokens"] == 4 and params["temperature"] == 1.0 and "sampling_seed" in params
    assert result.metrics["rollout/truncated_rate"] == 0.5 and result.metrics["rollout/reward_mean"] == 1.0


def test_dynamic_sampling_over_samples_until_enough_groups_pass(make_ctx):
    # Groups of a prompt whose answers all score the same have zero std and are dropped.
    engine = ScriptedEngine({"a1": "1", "b2": "9", "c3": "3", "d4": "4"})
    mixed = {"e5": "5"}
    engine.answers.update(mixed)
    cfg = config(rollout={"dynamic_sampling_filter_path": "slimeflow.rollout.filters:check_reward_nonzero_std",
                          "over_sampling_batch_size": 2}, batch={"rollout_batch_size": 1})
    source = DataSource(prompts("a1", "b2", "c3", "d4", "e5"), n_samples_per_prompt=2)
    right_on_even_samples_only(engine, "e5")  # that prompt's group is mixed
    result = run(make_ctx(engine, cfg), BufferedDataSource(source))
    assert len(result.groups) == 1 and result.groups[0][0].prompt == "e5"
    assert sorted(s.reward for s in result.groups[0]) == [0.0, 1.0]
    # Rounds of 2: (a1, b2), (c3, d4) all dropped, then e5 kept (a1 of the next epoch may finish first).
    assert result.metrics["rollout/sampler_dropped/zero_std"] in (4.0, 5.0)
    assert result.metrics["rollout/sampler_requested"] == 6.0


def test_stragglers_are_aborted_and_continued_next_rollout_with_partial_rollout(make_ctx):
    engine = ScriptedEngine({"a1": "1", "b2": "2", "c3": "3"}, hang={"c3"})
    cfg = config(rollout={"over_sampling_batch_size": 3, "partial_rollout": True})
    data = BufferedDataSource(DataSource(prompts("a1", "b2", "c3"), n_samples_per_prompt=2))
    ctx = make_ctx(engine, cfg)
    result = run(ctx, data, rollout_id=0)
    assert [g[0].prompt for g in result.groups] == ["a1", "b2"]
    assert result.metrics["rollout/aborted_groups"] == 1 and len(data) == 1
    partial = data.buffer[0][0]
    assert partial.response == "…" and partial.response_length == 1 and partial.metadata[START_ROLLOUT_ID] == 0
    # Next rollout: the buffered group comes first and continues from its tokens, with the budget left.
    engine.hang.clear()
    second = run(make_ctx(engine, config(rollout={"partial_rollout": True})), data, rollout_id=1)
    continued = second.groups[0][0]
    assert continued.prompt == "c3" and continued.response == "…3" and continued.response_length == 2
    assert continued.metadata[START_ROLLOUT_ID] == 0 and continued.rollout_log_probs == [-0.5, -0.5]
    resumed = [params for prompt, params in engine.requests if prompt == "c3…"]
    assert resumed and {p["max_new_tokens"] for p in resumed} == {3}
    assert second.groups[1][0].prompt == "a1"  # the source continues where the first rollout left it


def test_without_partial_rollout_stragglers_are_dropped(make_ctx):
    engine = ScriptedEngine({"a1": "1", "b2": "2", "c3": "3"}, hang={"c3"})
    cfg = config(rollout={"over_sampling_batch_size": 3})
    data = BufferedDataSource(DataSource(prompts("a1", "b2", "c3"), n_samples_per_prompt=1))
    result = run(make_ctx(engine, cfg), data)
    assert len(result.groups) == 2 and len(data) == 0 and result.metrics["rollout/aborted_groups"] == 1


def test_a_failing_request_fails_its_sample_and_the_group_is_dropped(make_ctx):
    engine = ScriptedEngine({"a1": "1", "b2": "2", "c3": "3"}, fail={"b2"})
    cfg = config(rollout={"over_sampling_batch_size": 3})
    data = BufferedDataSource(DataSource(prompts("a1", "b2", "c3"), n_samples_per_prompt=1))
    result = run(make_ctx(engine, cfg), data)
    assert [g[0].prompt for g in result.groups] == ["a1", "c3"]
    assert result.metrics["rollout/sampler_dropped/failed_sample"] == 1.0


def test_a_response_from_other_weights_stops_the_rollout(make_ctx):
    engine = ScriptedEngine({"a1": "1"}, version="3")
    data = BufferedDataSource(DataSource(prompts("a1"), n_samples_per_prompt=1))
    cfg = config(batch={"rollout_batch_size": 1})
    with pytest.raises(WeightVersionError, match="'3' during a rollout of version '4'"):
        run(make_ctx(engine, cfg, version="4"), data)


def test_a_rollout_where_every_group_fails_stops_with_the_reason(make_ctx):
    engine = ScriptedEngine({})
    cfg = config(batch={"rollout_batch_size": 1})
    data = BufferedDataSource(DataSource([{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}]))
    with pytest.raises(RolloutError, match="apply-chat-template"):
        run(make_ctx(engine, cfg), data)
    assert engine.requests == []


def test_pass_at_k_matches_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert math.isclose(pass_at_k(4, 1, 1), 0.25) and math.isclose(pass_at_k(4, 1, 2), 0.5)
    assert math.isclose(pass_at_k(5, 2, 3), 1 - math.comb(3, 3) / math.comb(5, 3))
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def test_score_set_reports_avg_and_pass_at_k_and_leaves_failures_out():
    def g(*rewards):
        return [Sample(0, i, "q", reward=r, status=Status.COMPLETED, response_length=2) for i, r in enumerate(rewards)]

    failed = g(1.0, 0.0)
    failed[1].mark_failed("reward raised")
    metrics = score_set("s", [g(1.0, 0.0), g(0.0, 0.0), failed])
    assert metrics["eval/s/avg_at_2"] == pytest.approx(2 / 5)
    assert metrics["eval/s/pass_at_1"] == pytest.approx(0.25) and metrics["eval/s/pass_at_2"] == pytest.approx(0.5)
    assert metrics["eval/s/failed"] == 1.0 and metrics["eval/s/prompts"] == 3.0


def test_evaluate_sets_uses_the_eval_sampling_params(make_ctx):
    engine = ScriptedEngine({"a1": "1", "b2": "7"})
    cfg = config()
    ctx = make_ctx(engine, cfg)
    params = sampling_params(cfg.rollout, max_new_tokens=1, temperature=0.0)
    metrics = asyncio.run(evaluate_sets(ctx, {"math": prompts("a1", "b2")}, EvalSettings(2, params)))
    assert metrics["eval/math/avg_at_2"] == 0.5 and metrics["eval/math/pass_at_2"] == 0.5
    assert {p["temperature"] for _, p in engine.requests} == {0.0}
    assert {p["max_new_tokens"] for _, p in engine.requests} == {1}


def test_wrong_plugin_paths_are_named_before_anything_starts(tmp_path):
    from slimeflow.errors import StageInputError
    from slimeflow.stages.train.preflight import check_plugins

    cfg = config(rollout={"custom_generate_function_path": "no_such_module:generate"},
                 reward={"custom_rm_path": "slimeflow.rollout.rewards:no_such_reward"})
    with pytest.raises(StageInputError) as err:
        check_plugins(cfg)
    message = str(err.value)
    assert "--custom-generate-function-path 'no_such_module:generate': cannot import module" in message
    assert "--custom-rm-path" in message and "has no attribute 'no_such_reward'" in message


def test_an_engine_url_that_does_not_answer_is_a_clear_error_not_a_hang():
    import time

    from slimeflow.engine.client import EngineUnavailableError
    from slimeflow.engine.launch import free_port
    from slimeflow.stages.train.engines import EngineSet

    url = f"http://127.0.0.1:{free_port()}"
    started = time.perf_counter()
    with pytest.raises(EngineUnavailableError, match=url):
        EngineSet.start("/unused", {"worker_urls": [url], "weights_dir": "/tmp/w"}, num_engines=1)
    assert time.perf_counter() - started < 30
    with pytest.raises(ValueError, match="--sglang-weights-dir"):
        EngineSet.start("/unused", {"worker_urls": [url]}, num_engines=1)


class RecordingEngine:
    """An EngineClient stand-in for the coalescer: answers each prompt with its first id; prompts in `bad` get 400."""

    def __init__(self, bad=()):
        self.bad, self.requests = set(bad), []

    async def generate_batch(self, input_ids, sampling_params, *, return_logprob=True, rids=None):
        from slimeflow.engine.client import EngineRequestError

        self.requests.append((list(input_ids), rids))
        if any(ids[0] in self.bad for ids in input_ids):
            raise EngineRequestError(400, "prompt too long")
        return [{"first": ids[0], "seed": p["seed"]} for ids, p in zip(input_ids, sampling_params, strict=True)]


def test_batched_generates_issued_together_go_as_one_request_and_each_caller_gets_its_slice():
    from slimeflow.stages.train.engines import Coalescer

    engine = RecordingEngine()
    coalescer = Coalescer(engine)

    async def main():
        return await asyncio.gather(*(coalescer.generate_batch([[g, 0]] * 2, [{"seed": g}, {"seed": g + 10}],
                                                               rids=[f"{g}a", f"{g}b"]) for g in range(3)))

    answers = asyncio.run(main())
    assert len(engine.requests) == 1 and engine.requests[0][1] == ["0a", "0b", "1a", "1b", "2a", "2b"]
    assert answers == [[{"first": g, "seed": g}, {"first": g, "seed": g + 10}] for g in range(3)]


def test_a_rejected_merged_request_fails_only_the_bad_caller():
    from slimeflow.engine.client import EngineRequestError
    from slimeflow.stages.train.engines import Coalescer

    engine = RecordingEngine(bad={1})
    coalescer = Coalescer(engine)

    async def main():
        return await asyncio.gather(*(coalescer.generate_batch([[g]], [{"seed": g}]) for g in range(3)),
                                    return_exceptions=True)

    good, bad, other = asyncio.run(main())
    assert good == [{"first": 0, "seed": 0}] and other == [{"first": 2, "seed": 2}]
    assert isinstance(bad, EngineRequestError) and bad.status == 400
    assert len(engine.requests) == 4  # the merged request, then each part alone


def test_a_train_batch_crosses_ray_as_flat_tensors_and_comes_back_equal():
    import torch

    from slimeflow.rollout.types import PackedBatch, TrainBatch

    samples = [Sample(prompt="p", index=i, group_index=i // 2, tokens=list(range(3 + i)), response_length=1 + i % 2,
                      reward=float(i), rollout_log_probs=[-0.1] * (1 + i % 2), status=Status.COMPLETED,
                      loss_mask=[1] * (i % 2) + [0]) for i in range(4)]
    batch = TrainBatch.from_samples(samples)
    back = PackedBatch.pack(batch).unpack()
    for field in ("tokens", "loss_masks", "rollout_log_probs"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(batch, field), getattr(back, field), strict=True))
    assert back.response_lengths == batch.response_lengths and back.group_indices == batch.group_indices
    assert torch.equal(back.rewards, batch.rewards)
    for sample in samples:
        sample.rollout_log_probs = None
    assert PackedBatch.pack(TrainBatch.from_samples(samples)).unpack().rollout_log_probs is None
    assert len(PackedBatch.pack(TrainBatch.from_samples([])).unpack()) == 0
