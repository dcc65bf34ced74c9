"""--partial-rollout under --async: a continued sample's earlier tokens count in the staleness with the version that
generated them (or leave the loss with --mask-offpolicy-in-partial-rollout, as in the synchronous loop), a buffered
group that would exceed the bound starts again from its prompt, and the rollout manager's checkpoint state carries
every rollout generated and not yet trained."""

from __future__ import annotations

import test_rollout
from test_rollout import ScriptedEngine, config, prompts, run

from slimeflow.config.train import TrainConfig, staleness_bound
from slimeflow.rollout.data_source import START_ROLLOUT_ID, BufferedDataSource, DataSource
from slimeflow.rollout.rollout import OLDEST_WEIGHT_VERSION
from slimeflow.rollout.types import Sample, Status
from slimeflow.stages.train.rollouts import InFlight, Rollouts, weight_versions

make_ctx = test_rollout.make_ctx  # the fixture: make(engine, config, version) -> a RolloutContext


def partial_after_rollout_0(make_ctx, **rollout):
    """A data source whose buffer holds group c3, aborted in rollout 0 (weights "0") after one token, and its engine
    (which no longer hangs: the group finishes when continued)."""
    engine = ScriptedEngine({"a1": "1", "b2": "2", "c3": "3"}, hang={"c3"})
    data = BufferedDataSource(DataSource(prompts("a1", "b2", "c3", "d4"), n_samples_per_prompt=2))
    first = config(rollout={"over_sampling_batch_size": 3, "partial_rollout": True, **rollout})
    run(make_ctx(engine, first, version="0"), data, rollout_id=0)
    assert len(data) == 1 and data.buffer[0][0].metadata["weight_version"] == "0"
    engine.hang.clear()
    return engine, data


def test_a_continued_sample_counts_with_the_version_of_its_first_tokens(make_ctx):
    engine, data = partial_after_rollout_0(make_ctx)
    engine.version = "1"
    result = run(make_ctx(engine, config(rollout={"partial_rollout": True}), version="1"), data, rollout_id=1)
    continued = result.groups[0][0]
    assert continued.response == "…3" and continued.loss_mask is None  # both tokens train
    assert continued.metadata["weight_version"] == "1" and continued.metadata[OLDEST_WEIGHT_VERSION] == "0"
    assert weight_versions(result.samples) == {"rollout/weight_version_min": 0.0, "rollout/weight_version_max": 1.0}


def test_masked_earlier_tokens_do_not_count_and_every_earlier_token_is_masked_as_in_slime(make_ctx):
    engine, data = partial_after_rollout_0(make_ctx, mask_offpolicy_in_partial_rollout=True)
    # A group continued once already (its second token came from weights "1"), aborted again: both are off-policy.
    twice = [Sample(group_index=9, index=18 + i, prompt="c3", label="3", tokens=[ord(c) for c in "c3…x"],
                    response="…x", response_length=2, loss_mask=[0, 1], rollout_log_probs=[-0.5, -0.5],
                    metadata={"weight_version": "1", START_ROLLOUT_ID: 0}) for i in range(2)]
    data.add_groups([twice], rollout_id=1)
    engine.version = "2"
    cfg = config(rollout={"partial_rollout": True, "mask_offpolicy_in_partial_rollout": True})
    result = run(make_ctx(engine, cfg, version="2"), data, rollout_id=2)
    by_group = {g[0].group_index: g[0] for g in result.groups}
    assert by_group[2].loss_mask == [0, 1] and by_group[9].loss_mask == [0, 0, 1]
    assert OLDEST_WEIGHT_VERSION not in by_group[2].metadata
    assert weight_versions(result.samples)["rollout/weight_version_min"] == 2.0


def test_a_buffered_group_over_the_staleness_bound_starts_again_from_its_prompt(make_ctx):
    engine, data = partial_after_rollout_0(make_ctx)
    engine.version = "2"
    ctx = make_ctx(engine, config(rollout={"partial_rollout": True}), version="2")
    ctx.max_staleness = 1  # rollout 2 would train tokens of weights 0: two versions old
    result = run(ctx, data, rollout_id=2)
    again = next(g for g in result.groups if g[0].prompt == "c3")[0]
    assert again.response == "3" and again.rollout_log_probs == [-0.5] and START_ROLLOUT_ID not in again.metadata
    assert OLDEST_WEIGHT_VERSION not in again.metadata and again.metadata["weight_version"] == "2"
    assert result.metrics["rollout/partial_restarted_groups"] == 1
    assert weight_versions(result.samples)["rollout/weight_version_min"] == 2.0


def test_the_default_bound_lets_a_partial_sample_be_continued_once():
    def bound(**flags):
        base = {"batch": {"rollout_batch_size": 1, "num_rollout": 2}, "placement": {"async_": True}}
        for group, values in flags.items():
            base.setdefault(group, {}).update(values)
        return staleness_bound(TrainConfig.model_validate(base))

    assert bound(weight_sync={"update_weights_interval": 2}, placement={"async_buffer_size": 3}) == 4
    assert bound(rollout={"partial_rollout": True}) == 2
    assert bound(rollout={"partial_rollout": True, "mask_offpolicy_in_partial_rollout": True}) == 1
    assert bound(rollout={"partial_rollout": True}, algorithm={"max_staleness": 1}) == 1
    assert staleness_bound(config(rollout={"partial_rollout": True})) is None  # the synchronous loop


def test_the_checkpoint_state_carries_the_rollouts_after_the_trained_one_and_the_partial_samples():
    manager = Rollouts.__new__(Rollouts)  # its state only: no engine
    manager.data = BufferedDataSource(DataSource(prompts("a1", "b2"), n_samples_per_prompt=1))
    partial = Sample(group_index=0, index=0, prompt="a1", response="…", response_length=1,
                     metadata={"weight_version": "3"})
    manager.data.add_groups([[partial]], rollout_id=4)
    manager.in_flight = {k: InFlight(k, [Sample(group_index=k, index=k, prompt="b2")], {"k": float(k)})
                         for k in (4, 5, 6)}
    state = manager.state_dict(trained=4)
    assert [r["rollout_id"] for r in state["in_flight"]] == [5, 6]
    assert state["buffer"][0][0]["response"] == "…" and state["buffer"][0][0]["metadata"][START_ROLLOUT_ID] == 4

    restored = Rollouts.__new__(Rollouts)
    restored.data = BufferedDataSource(DataSource(prompts("a1", "b2"), n_samples_per_prompt=1))
    restored.load_state_dict(state)
    assert sorted(restored.in_flight) == [5, 6] and restored.in_flight[6].metrics == {"k": 6.0}
    assert restored.data.buffer[0][0].response == "…"
    # A checkpoint written before --async-buffer-size held one rollout in flight, as a dict.
    restored.load_state_dict({**state, "in_flight": state["in_flight"][0]})
    assert sorted(restored.in_flight) == [5]


def test_a_buffered_sample_that_finished_as_the_stragglers_were_aborted_is_not_generated_again(make_ctx):
    engine = ScriptedEngine({"a1": "1", "b2": "2"})
    data = BufferedDataSource(DataSource(prompts("a1", "b2"), n_samples_per_prompt=1))
    done = Sample(group_index=7, index=7, prompt="b2", label="2", tokens=[ord(c) for c in "b22"], response="2",
                  response_length=1, rollout_log_probs=[-0.5], status=Status.COMPLETED,
                  metadata={"weight_version": "0"})
    data.add_groups([[done]], rollout_id=0)
    cfg = config(batch={"rollout_batch_size": 1, "n_samples_per_prompt": 1},
                 rollout={"partial_rollout": True, "mask_offpolicy_in_partial_rollout": True})
    result = run(make_ctx(engine, cfg, version="1"), data, rollout_id=1)
    assert result.groups == [[done]] and engine.requests == []
    assert done.response == "2" and done.loss_mask == [0] and done.reward == 1.0  # all its tokens off-policy


def test_groups_still_waiting_for_a_slot_when_the_stragglers_are_aborted_are_buffered_unsent(make_ctx):
    engine = ScriptedEngine({"a1": "1", "b2": "2", "c3": "3"}, hang={"b2"})
    data = BufferedDataSource(DataSource(prompts("a1", "b2", "c3"), n_samples_per_prompt=1))
    cfg = config(batch={"rollout_batch_size": 1, "n_samples_per_prompt": 1},
                 rollout={"over_sampling_batch_size": 3, "partial_rollout": True})
    ctx = make_ctx(engine, cfg)
    ctx.concurrency = 1  # one group at a time: b2 holds the slot until aborted, c3 waits for it
    result = run(ctx, data)
    assert [g[0].prompt for g in result.groups] == ["a1"] and not ctx.aborting
    assert [prompt for prompt, _ in engine.requests] == ["a1", "b2"]  # c3 never sent
    buffered = {g[0].prompt: g[0] for g in data.buffer}
    assert buffered["b2"].response == "…" and buffered["c3"].response == ""
    assert {s.status for s in buffered.values()} == {Status.ABORTED}
