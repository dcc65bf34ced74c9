"""slime's plug-in contracts, unchanged: the `slime` compatibility namespace (import hook, Sample, post,
GenerateState, DynamicFilterOutput) and each hook called as slime calls it, with plug-ins written against slime's
signatures (tests/data/slime_plugins/). The train-path run is tests/integration/test_slime_plugins_e2e.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import sys
import threading

import pytest
import torch
from paths import DATA
from test_rollout import CharTokenizer, ScriptedEngine, config, prompts, right_on_even_samples_only, run

from slimeflow import slime_compat
from slimeflow.rollout.data_source import BufferedDataSource, DataSource
from slimeflow.rollout.evaluation import EvalSettings, evaluate_sets
from slimeflow.rollout.rewards import RewardScorer
from slimeflow.rollout.rollout import RolloutContext
from slimeflow.rollout.slime_plugins import buffer_filter, slime_args
from slimeflow.rollout.types import Status

PLUGINS = DATA / "slime_plugins"


@pytest.fixture(autouse=True)
def slime_plugins_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))


@pytest.fixture
def make_ctx():
    """make(engine, config) -> a RolloutContext over a scripted engine (its reward scorers closed afterwards)."""
    scorers = []

    def make(engine, cfg):
        scorers.append(RewardScorer(cfg.reward))
        return RolloutContext(cfg, CharTokenizer(), engine, scorers[-1], concurrency=8)

    yield make
    for scorer in scorers:
        scorer.close()


def test_slime_imports_resolve_to_the_compat_modules_when_slime_is_absent():
    slime_compat.install()
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput
    from slime.rollout.sglang_rollout import GenerateState, generate
    from slime.utils.http_utils import post
    from slime.utils.types import Sample

    import slimeflow.slime_compat.utils.types as ours

    assert Sample is ours.Sample and Sample.Status.COMPLETED is Status.COMPLETED
    assert DynamicFilterOutput(keep=False).keep is False and callable(post) and callable(generate)
    assert GenerateState.__module__ == "slimeflow.slime_compat.rollout.sglang_rollout"
    # After the path finder, so a real slime on the path wins (a finder appended later, e.g. six's, may follow).
    from importlib.machinery import PathFinder

    aliases = [i for i, finder in enumerate(sys.meta_path) if type(finder).__name__ == "_SlimeAlias"]
    assert len(aliases) == 1 and aliases[0] > sys.meta_path.index(PathFinder)
    with pytest.raises(ImportError, match="slime.utils.arguments.*provides only"):
        import slime.utils.arguments  # noqa: F401


def test_a_real_slime_on_the_path_takes_precedence(tmp_path, monkeypatch):
    fake = tmp_path / "slime" / "utils"
    fake.mkdir(parents=True)
    (tmp_path / "slime" / "__init__.py").write_text("REAL = True\n")
    (fake / "__init__.py").write_text("")
    (fake / "types.py").write_text("class Sample:\n    origin = 'real slime'\n")
    saved = {name: mod for name, mod in sys.modules.items() if name == "slime" or name.startswith("slime.")}
    for name in saved:
        del sys.modules[name]
    monkeypatch.syspath_prepend(str(tmp_path))
    slime_compat.install()
    try:
        from slime.utils.types import Sample

        assert Sample.origin == "real slime" and sys.modules["slime"].REAL
    finally:
        for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_sample_methods_behave_as_slimes():
    from slimeflow.slime_compat.utils.types import Sample

    sample = Sample(prompt="p", tokens=[1, 2], reward={"acc": 1.0, "format": 0.5})
    sample.append_response_tokens(tokens=torch.tensor([3, 4]), log_probs=[-0.1, -0.2], text="ab",
                                  meta_info={"finish_reason": {"type": "length"}, "weight_version": "7",
                                             "cached_tokens": 1, "prompt_tokens": 2})
    sample.append_response_tokens(tokens=[5, 6, 7], trainable=False, text="<tool>")
    assert sample.tokens == [1, 2, 3, 4, 5, 6, 7] and sample.response == "ab<tool>" and sample.response_length == 5
    assert sample.loss_mask == [1, 1, 0, 0, 0] and sample.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, 0.0]
    assert sample.status is Sample.Status.TRUNCATED and sample.weight_versions == ["7"]
    assert sample.effective_response_length == 2 and sample.prefix_cache_info.prefix_cache_hit_rate == 0.5
    assert sample.get_reward_value(slime_args(config(reward={"reward_key": "format"}))) == 0.5
    with pytest.raises(ValueError, match="require rollout log probabilities"):
        sample.append_response_tokens(tokens=[8])
    with pytest.raises(ValueError, match="should not pass rollout log probabilities"):
        sample.append_response_tokens(tokens=[8], log_probs=[0.0], trainable=False)
    data = sample.to_dict()
    assert data["status"] == "truncated" and data["prefix_cache_info"] == {"cached_tokens": 1,
                                                                           "total_prompt_tokens": 2}
    again = Sample.from_dict({**data, "extra_key": 3})
    assert again == sample and again.extra_key == 3


class FlakyServer(http.server.BaseHTTPRequestHandler):
    """Answers 503 to the first `failures` POSTs, then echoes the JSON body; /text answers plain text."""

    failures = 0
    calls = 0

    def do_POST(self):  # noqa: N802 (http.server's name)
        type(self).calls += 1
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).calls <= type(self).failures:
            self.send_response(503)
            self.end_headers()
            return
        payload = b"plain" if self.path == "/text" else json.dumps({"echo": json.loads(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FlakyServer)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_post_retries_as_slime_then_raises(flaky_server, monkeypatch):
    from slimeflow.slime_compat.utils import http_utils

    monkeypatch.setattr(http_utils, "RETRY_DELAY_S", 0.01)
    FlakyServer.calls, FlakyServer.failures = 0, 2
    assert asyncio.run(http_utils.post(f"{flaky_server}/generate", {"x": 1})) == {"echo": {"x": 1}}
    assert FlakyServer.calls == 3
    assert asyncio.run(http_utils.post(f"{flaky_server}/text", {})) == "plain"
    FlakyServer.calls, FlakyServer.failures = 0, 5
    with pytest.raises(Exception, match="503"):
        asyncio.run(http_utils.post(f"{flaky_server}/generate", {}, max_retries=2))
    assert FlakyServer.calls == 2


def test_args_carry_slimes_names_and_generate_state_is_a_singleton():
    from slimeflow.slime_compat.rollout.sglang_rollout import GenerateState

    cfg = config(rollout={"partial_rollout": True, "rollout_temperature": 0.5})
    args = slime_args(cfg, router_url="http://127.0.0.1:30001", num_engines=2, concurrency=16, tokenizer="tok",
                      _slimeflow_tokenizer="tok")
    assert (args.sglang_router_ip, args.sglang_router_port) == ("127.0.0.1", 30001)
    assert args.partial_rollout is True and args.sglang_server_concurrency == 8 and args.rollout_batch_size == 2
    assert args.rollout_skip_special_tokens is False and args.rollout_max_context_len is None
    assert args.n_samples_per_prompt == 2 and args.rm_type == "prefix_match" and args.group_rm is False
    GenerateState.clear_instances()
    try:
        state = GenerateState(args)
        assert GenerateState(slime_args(config())) is state and state.tokenizer == "tok"
        assert state.sampling_params["temperature"] == 0.5 and state.semaphore._value == 16
    finally:
        GenerateState.clear_instances()


def test_a_dynamic_filter_output_keep_false_drops_the_group(make_ctx):
    engine = ScriptedEngine({"a1": "1", "b2": "2", "c3": "3"})
    cfg = config(rollout={"dynamic_sampling_filter_path": "slime_style_hooks:drop_prompt_b",
                          "over_sampling_batch_size": 3})
    result = run(make_ctx(engine, cfg), BufferedDataSource(DataSource(prompts("a1", "b2", "c3"))))
    assert [g[0].prompt for g in result.groups] == ["a1", "c3"]
    assert result.metrics["rollout/sampler_dropped/prompt_b"] == 1.0


def test_slimes_check_reward_nonzero_std_by_its_slime_path(make_ctx):
    path = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
    engine = ScriptedEngine({"a1": "1", "b2": "2", "c3": "9"})  # c3 is always wrong: zero std, all 0
    cfg = config(rollout={"dynamic_sampling_filter_path": path, "over_sampling_batch_size": 3},
                 batch={"rollout_batch_size": 1})
    right_on_even_samples_only(engine, "b2")
    result = run(make_ctx(engine, cfg), BufferedDataSource(DataSource(prompts("a1", "b2", "c3"),
                                                                      n_samples_per_prompt=2)))
    assert [g[0].prompt for g in result.groups] == ["b2"]
    assert result.metrics["rollout/sampler_dropped/zero_std_1.0"] == 1.0
    assert result.metrics["rollout/sampler_dropped/zero_std_0.0"] == 1.0


def test_keep_when_insufficient_keeps_a_rejected_group_rather_than_sampling_again(make_ctx):
    path = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
    engine = ScriptedEngine({"a1": "1", "b2": "2"})
    cfg = config(rollout={"dynamic_sampling_filter_path": path})
    result = run(make_ctx(engine, cfg), BufferedDataSource(DataSource(prompts("a1", "b2"), n_samples_per_prompt=2)))
    assert [g[0].prompt for g in result.groups] == ["a1", "b2"] and result.metrics["rollout/sampler_requested"] == 2


@pytest.mark.parametrize("path,reward_key,expected", [
    ("slime_style_hooks:parity_reward", None, [[1.0, 1.0], [0.0, 0.0]]),  # last tokens '1' (49) and '0' (48)
    ("slime_style_hooks:dict_reward", "acc", [[1.0, 1.0], [0.0, 0.0]]),  # b1 answers '0', its label is '1'
    ("slime_style_hooks:dict_reward", "format", [[0.5, 0.5], [0.5, 0.5]]),
])
def test_custom_reward_per_sample_as_slime_calls_it(make_ctx, path, reward_key, expected):
    cfg = config(reward={"rm_type": None, "custom_rm_path": path, "reward_key": reward_key})
    result = run(make_ctx(ScriptedEngine({"a1": "1", "b2": "2"}), cfg),
                 BufferedDataSource(DataSource(prompts("a1", "b1"), n_samples_per_prompt=2)))
    assert [[s.reward for s in g] for g in result.groups] == expected


def test_custom_reward_batched_form_with_group_rm(make_ctx):
    cfg = config(reward={"rm_type": None, "custom_rm_path": "slime_style_hooks:group_length_reward",
                         "group_rm": True}, rollout={"rollout_max_response_len": 8})
    engine = ScriptedEngine({"a1": "1"})
    result = run(make_ctx(engine, cfg), BufferedDataSource(DataSource(prompts("a1", "a2"), n_samples_per_prompt=2)))
    assert [[s.reward for s in g] for g in result.groups] == [[0.0, 1.0], [0.0, 1.0]]


def test_buffer_filter_with_slimes_pop_first_signature():
    source = DataSource(prompts("a1", "b2", "c3", "d4"), n_samples_per_prompt=2)
    data = BufferedDataSource(source, buffer_filter(__import__("slime_style_hooks").pop_last, slime_args(config())))
    data.buffer = source.get_groups(3)
    taken = data.get_groups(2)
    assert [g[0].prompt for g in taken] == ["c3", "b2"] and [g[0].prompt for g in data.buffer] == ["a1"]
    assert all(type(s).__module__ == "slimeflow.rollout.types" for g in taken for s in g)
    slime_compat.install()
    from slime.rollout.data_source import pop_first

    data = BufferedDataSource(source, buffer_filter(pop_first, slime_args(config())))
    data.buffer = source.get_groups(2)
    assert [g[0].prompt for g in data.get_groups(1)] == ["d4"] and len(data.buffer) == 1


def test_a_generate_function_gets_evaluation_in_eval(make_ctx):
    import slime_style_hooks

    slime_style_hooks.EVALUATION_FLAGS.clear()
    cfg = config(rollout={"custom_generate_function_path": "slime_style_hooks:record_evaluation"})
    ctx = make_ctx(ScriptedEngine({}), cfg)
    run(ctx, BufferedDataSource(DataSource(prompts("a1"), n_samples_per_prompt=2)))
    params = {"max_new_tokens": 2, "temperature": 0.0}
    metrics = asyncio.run(evaluate_sets(ctx, {"set": prompts("x1")}, EvalSettings(1, params)))
    assert slime_style_hooks.EVALUATION_FLAGS == [False] * 4 + [True] and metrics["eval/set/avg_at_1"] == 1.0


def test_the_startup_check_calls_nothing_it_cannot_call():
    from slimeflow.errors import StageInputError
    from slimeflow.stages.train.preflight import check_plugins

    fine = config(rollout={"dynamic_sampling_filter_path":
                           "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
                           "buffer_filter_path": "slime.rollout.data_source.pop_first",
                           "custom_generate_function_path": "slime_style_multi_turn:generate_two_turns"},
                  reward={"custom_rm_path": "slime_style_hooks:parity_reward"})
    check_plugins(fine)
    check_plugins(config(rollout={"dynamic_sampling_filter_path": "slimeflow.rollout.filters:check_reward_nonzero_std"}))
    bad = config(rollout={"custom_generate_function_path": "slime_style_hooks:not_async_generate",
                          "buffer_filter_path": "slime_style_hooks:three_arguments"},
                 algorithm={"loss_type": "custom_loss", "custom_loss_function_path": "slime_style_hooks:slime_megatron_loss"})
    with pytest.raises(StageInputError) as err:
        check_plugins(bad)
    message = str(err.value)
    assert "--custom-generate-function-path 'slime_style_hooks:not_async_generate': " in message
    assert "is not an async function" in message
    assert "--buffer-filter-path 'slime_style_hooks:three_arguments': " in message and "takes 3 positional" in message
    assert "slime's Megatron loss form" in message


def test_sample_hooks_run_in_order_before_the_reward_with_rollout_id_and_evaluation(make_ctx):
    cfg = config(rollout={"rollout_sample_hook_path": ["slime_style_hooks:tag_sample",
                                                        "slime_style_hooks:answer_label"]})
    engine = ScriptedEngine({"a1": "0", "b2": "0"})  # wrong answers; the second hook answers the label
    ctx = make_ctx(engine, cfg)
    result = run(ctx, BufferedDataSource(DataSource(prompts("a1", "b2"), n_samples_per_prompt=2)), rollout_id=3)
    assert all(s.metadata["hooked"] == [3, False] and s.reward == 1.0 for s in result.samples)
    metrics = asyncio.run(evaluate_sets(ctx, {"set": prompts("x1")}, EvalSettings(1, {"max_new_tokens": 1})))
    assert metrics["eval/set/avg_at_1"] == 1.0


def test_rollout_sample_filter_zeroes_removed_samples_and_the_log_function_replaces_the_metrics(make_ctx):
    import slime_style_hooks

    slime_style_hooks.LOGGED.clear()
    cfg = config(rollout={"rollout_sample_filter_path": "slime_style_hooks:remove_odd_samples",
                          "custom_rollout_log_function_path": "slime_style_hooks:log_and_skip_default"})
    ctx = make_ctx(ScriptedEngine({"a1": "1", "b2": "2"}), cfg)
    result = run(ctx, BufferedDataSource(DataSource(prompts("a1", "b2"), n_samples_per_prompt=2)), rollout_id=5)
    assert [s.loss_mask for s in result.samples] == [None, [0], None, [0]]
    assert slime_style_hooks.LOGGED == [(5, 4, 1.0, True)] and result.metrics == {}


# slime's `*-path` flags (slime/utils/arguments.py at THUDM/slime 624b824a8), the ones slimeflow calls with
# slime's contract and the ones it refuses by name.
CALLED = ["--rollout-function-path", "--custom-generate-function-path", "--custom-rm-path",
          "--dynamic-sampling-filter-path", "--buffer-filter-path", "--rollout-sample-hook-path", "--rollout-sample-filter-path",
          "--custom-rollout-log-function-path", "--custom-reward-post-process-path",
          "--rollout-all-samples-process-path", "--custom-eval-rollout-log-function-path",
          "--custom-convert-samples-to-train-data-path", "--eval-function-path", "--custom-tis-function-path",
          "--rollout-data-postprocess-path", "--custom-pg-loss-reducer-function-path", "--data-source-path"]
CALLED_BY_MEGATRON = ["--custom-megatron-init-path", "--custom-megatron-before-log-prob-hook-path",
                      "--custom-megatron-before-train-step-hook-path", "--custom-model-provider-path"]
# Files, not plug-ins: --custom-config-path (tests/unit/test_slime_path_hooks.py), --megatron-config-path
# (tests/unit/test_megatron_roles.py); --custom-update-weight-post-write-path runs with the disk weight sync (below);
# --custom-loss-function-path and --custom-advantage-function-path take slimeflow's forms (elsewhere in this file).


def test_every_slime_path_flag_is_taken_or_refused_by_name():
    from slimeflow.config.pipeline import load_stage_config
    from slimeflow.errors import ConfigError

    base = ["--rollout-batch-size", "1", "--num-rollout", "1"]
    for flag in CALLED:
        config = load_stage_config("train", None, [*base, flag, "pkg.module:function"])
        assert config.model_dump_json().count("pkg.module:function") == 1, flag
    megatron = ["--train-backend", "megatron"]
    for flag in CALLED_BY_MEGATRON:
        config = load_stage_config("train", None, [*base, *megatron, flag, "pkg.module:function"])
        assert config.model_dump_json().count("pkg.module:function") == 1, flag
        with pytest.raises(ConfigError, match=f"{flag} is a hook into slime's Megatron actor"):
            load_stage_config("train", None, [*base, flag, "pkg.module:function"])  # --train-backend torch
    disk = ["--sglang-worker-urls", "http://127.0.0.1:1", "--sglang-weights-dir", "/tmp/w"]
    post_write = ["--custom-update-weight-post-write-path", "pkg.module:function"]
    config = load_stage_config("train", None, [*base, *disk, *post_write])
    assert config.weight_sync.custom_update_weight_post_write_path == "pkg.module:function"
    with pytest.raises(ConfigError, match="runs after a disk weight sync writes its files"):
        load_stage_config("train", None, [*base, *post_write])  # embedded engines: weights over HTTP
    # None of slime's 26 *-path flags is refused any more.
    from slimeflow.config.slime_flags import refusal_reason

    slime_paths = [f for f in (DATA / "slime_flags" / "arguments.args").read_text().split()
                   if f.endswith("-path")]
    assert len(slime_paths) == 26 and [f for f in slime_paths if refusal_reason(f)] == []


def test_slimes_megatron_advantage_form_is_refused_at_start_up():
    from slimeflow.errors import StageInputError
    from slimeflow.stages.train.preflight import check_plugins

    with pytest.raises(StageInputError, match="slime's Megatron form advantage"):
        check_plugins(config(algorithm={"custom_advantage_function_path": "slime_style_hooks:slime_megatron_advantage"}))


def test_a_rollout_function_in_slimes_form_runs_with_slimes_data_source(make_ctx):
    from slimeflow.rollout.plugins import load_plugin
    from slimeflow.rollout.slime_rollout_functions import run_rollout_function
    from slimeflow.slime_compat.rollout.sglang_rollout import GenerateState
    from slimeflow.stages.train.preflight import check_plugins

    cfg = config(rollout={"rollout_function_path": "slime_style_rollout.generate_rollout",
                          "custom_generate_function_path": "slime_style_hooks:record_evaluation"})
    check_plugins(cfg)
    data = BufferedDataSource(DataSource(prompts("a1", "b2", "c3", "d4"), n_samples_per_prompt=2))
    GenerateState.clear_instances()
    try:
        ctx = make_ctx(ScriptedEngine({}), cfg)
        result = run_rollout_function(load_plugin(cfg.rollout.rollout_function_path, "rollout-function-path"), ctx,
                                      data, 4)
    finally:
        GenerateState.clear_instances()
    assert [[s.prompt for s in g] for g in result.groups] == [["a1", "a1"], ["b2", "b2"]]
    assert [s.reward for s in result.samples] == [1.0, 1.0, 0.0, 0.0] and result.samples[0].response == "1"
    assert result.metrics["custom/groups"] == 2.0 and result.metrics["rollout/reward_mean"] == 0.5
    assert [g[0].prompt for g in data.buffer] == ["c3"]  # put back by the function, continued next rollout


def test_reward_post_process_replaces_group_normalisation(make_ctx):
    from slimeflow.train.advantages import AdvantageInputs, compute_advantages

    cfg = config(algorithm={"custom_reward_post_process_path": "slime_style_hooks:scale_rewards"})
    result = run(make_ctx(ScriptedEngine({"a1": "1", "b2": "0"}), cfg),
                 BufferedDataSource(DataSource(prompts("a1", "b2"), n_samples_per_prompt=2)))
    assert [s.reward for s in result.samples] == [9.0, 9.0, -1.0, -1.0]
    assert [s.metadata["raw_reward"] for s in result.samples] == [1.0, 1.0, 0.0, 0.0]
    assert result.metrics["rollout/reward_mean"] == 0.5  # the raw rewards
    inputs = AdvantageInputs(rewards=torch.tensor([9.0, 9.0, -1.0, -1.0]), loss_masks=[torch.ones(2)] * 4)
    advantages = compute_advantages(cfg.algorithm, inputs, 2).advantages
    assert [a.tolist() for a in advantages] == [[9.0, 9.0], [9.0, 9.0], [-1.0, -1.0], [-1.0, -1.0]]
    plain = compute_advantages(config().algorithm, inputs, 2).advantages  # zero-std groups: 0 without the hook
    assert all(a.abs().max() == 0 for a in plain)


def test_all_samples_process_sees_kept_and_filtered_groups(make_ctx):
    import slime_style_hooks

    slime_style_hooks.SEEN_ALL.clear()
    cfg = config(rollout={"dynamic_sampling_filter_path": "slime_style_hooks:drop_prompt_b",
                          "rollout_all_samples_process_path": "slime_style_hooks:see_all_samples",
                          "over_sampling_batch_size": 3})
    result = run(make_ctx(ScriptedEngine({"a1": "1", "b2": "2", "c3": "3"}), cfg),
                 BufferedDataSource(DataSource(prompts("a1", "b2", "c3"))))
    assert slime_style_hooks.SEEN_ALL == [(["a1", "b2", "c3"], 0)]
    assert [g[0].prompt for g in result.groups] == ["a1", "c3"]
    assert all(s.metadata["seen_by_process"] for s in result.samples)


def test_the_eval_log_function_gets_slimes_eval_data(make_ctx):
    import slime_style_hooks

    slime_style_hooks.EVAL_LOGGED.clear()
    cfg = config(eval={"custom_eval_rollout_log_function_path": "slime_style_hooks:log_eval"})
    ctx = make_ctx(ScriptedEngine({"x1": "1", "y2": "0"}), cfg)
    ctx.rollout_id = 7
    sets = {"set": prompts("x1", "y2")}
    metrics = asyncio.run(evaluate_sets(ctx, sets, EvalSettings(2, {"max_new_tokens": 1})))
    assert slime_style_hooks.EVAL_LOGGED == [(7, {"set": ([1.0, 1.0, 0.0, 0.0], [0, 0, 0, 0], 4)},
                                              ["eval/set/avg_at_2"])]
    assert metrics["eval/set/avg_at_2"] == 0.5  # False: the default metrics are kept


def test_convert_samples_to_train_data_builds_the_train_batch(make_ctx):
    from slimeflow.rollout.slime_rollout_hooks import train_batch
    from slimeflow.train.advantages import AdvantageInputs, compute_advantages

    cfg = config(algorithm={"custom_convert_samples_to_train_data_path": "slime_style_hooks:to_train_data"})
    result = run(make_ctx(ScriptedEngine({"a1": "1", "b2": "0"}), cfg),
                 BufferedDataSource(DataSource(prompts("a1", "b2"), n_samples_per_prompt=2)))
    batch = train_batch(cfg, slime_args(cfg), result.samples)
    assert batch.rewards.tolist() == [0.5, 0.5, -0.5, -0.5] and batch.response_lengths == [1, 1, 1, 1]
    assert [t.tolist() for t in batch.tokens[:1]] == [[ord("a"), ord("1"), ord("1")]] and batch.group_indices == [0, 0, 1, 1]
    inputs = AdvantageInputs(rewards=batch.rewards, loss_masks=batch.loss_masks)
    assert [a.item() for a in compute_advantages(cfg.algorithm, inputs, 2).advantages] == [0.5, 0.5, -0.5, -0.5]
    teacher = config(algorithm={"custom_convert_samples_to_train_data_path":
                                "slime_style_hooks:to_train_data_with_teacher"})
    assert [t.tolist() for t in train_batch(teacher, slime_args(teacher), result.samples).teacher_log_probs] == \
        [[-0.5]] * 4  # on-policy distillation's (--use-opd --opd-type sglang)
    values = config(algorithm={"custom_convert_samples_to_train_data_path": "slime_style_hooks:to_train_data_with_values"})
    with pytest.raises(ValueError, match=r"returned keys \['values'\] that slimeflow's trainer does not"):
        train_batch(values, slime_args(values), result.samples)


def test_an_args_attribute_slimeflow_lacks_says_why():
    args = slime_args(config())
    with pytest.raises(AttributeError, match=r"args.use_critic: slimeflow does not take slime's --use-critic \(PPO"):
        args.use_critic  # noqa: B018
    with pytest.raises(AttributeError, match="args.no_such_thing: slimeflow has no --no-such-thing flag"):
        args.no_such_thing  # noqa: B018
    assert getattr(args, "no_such_thing", None) is None  # slime's getattr(args, name, default) fallbacks still work


def test_an_eval_function_in_slimes_form_gives_slimes_eval_metrics(make_ctx):
    import slime_style_hooks

    from slimeflow.rollout.plugins import load_plugin
    from slimeflow.rollout.slime_rollout_functions import run_eval_function
    from slimeflow.stages.train.preflight import check_plugins

    slime_style_hooks.EVAL_LOGGED.clear()
    cfg = config(eval={"eval_function_path": "slime_style_rollout.eval_rollout",
                       "eval_prompt_data": {"aime": "/data/aime.jsonl"},
                       "custom_eval_rollout_log_function_path": "slime_style_hooks:log_eval"})
    check_plugins(cfg)
    ctx = make_ctx(ScriptedEngine({}), cfg)
    assert ctx.args.eval_prompt_data == ["aime", "/data/aime.jsonl"]
    metrics = run_eval_function(load_plugin(cfg.eval.eval_function_path, "eval-function-path"), ctx,
                                BufferedDataSource(DataSource(prompts("a1"))), 6)
    assert metrics == {"eval/aime": 0.5, "eval/aime/truncated_rate": 0.25, "custom/eval_rollout_id": 6.0}
    assert slime_style_hooks.EVAL_LOGGED == [(6, {"aime": ([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 1], 0)},
                                              ["custom/eval_rollout_id"])]


def test_dict_labels_reach_a_slime_reward_as_slime_gives_them(make_ctx):
    rows = [{"prompt": p, "label": {"ground_truth": {"target": ["1", "one"]}}} for p in ("a1", "b2")]
    cfg = config(reward={"rm_type": None, "custom_rm_path": "slime_style_hooks:ground_truth_reward"})
    result = run(make_ctx(ScriptedEngine({"a1": "1", "b2": "2"}), cfg),
                 BufferedDataSource(DataSource(rows, n_samples_per_prompt=2)))
    assert [[s.reward for s in g] for g in result.groups] == [[1.0, 1.0], [0.0, 0.0]]


def test_generate_and_rm_group_rewards_the_group_with_group_rm(make_ctx):
    from slimeflow.rollout.plugins import load_plugin
    from slimeflow.rollout.slime_rollout_functions import run_rollout_function
    from slimeflow.slime_compat.rollout.sglang_rollout import GenerateState

    cfg = config(rollout={"rollout_function_path": "slime_style_rollout.generate_rollout",
                          "custom_generate_function_path": "slime_style_hooks:record_evaluation"},
                 reward={"rm_type": None, "custom_rm_path": "slime_style_hooks:group_length_reward", "group_rm": True})
    GenerateState.clear_instances()
    try:
        result = run_rollout_function(load_plugin(cfg.rollout.rollout_function_path, "rollout-function-path"),
                                      make_ctx(ScriptedEngine({}), cfg),
                                      BufferedDataSource(DataSource(prompts("a1", "b2", "c3"), n_samples_per_prompt=2)), 0)
    finally:
        GenerateState.clear_instances()
    assert [[s.reward for s in g] for g in result.groups] == [[0.0, 1.0], [0.0, 1.0]]
