"""slime's --data-source-path, --custom-pg-loss-reducer-function-path and --custom-config-path, each with plug-ins
written against slime's signatures (tests/data/slime_plugins/slime_style_data_source.py): a data source class feeding
the rollout and resuming from a checkpoint, a pg-loss reducer in the policy loss, and a YAML of plug-in settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_rollout
from paths import DATA
from test_loop import FakePlacement, Recorder, Reports
from test_rollout import ScriptedEngine, config, run
from test_tis_mismatch import ROLLOUT, approx, hand_batch

from slimeflow import slime_compat
from slimeflow.config.pipeline import load_stage_config
from slimeflow.config.train import AlgorithmConfig, TrainConfig
from slimeflow.errors import ConfigError
from slimeflow.rollout.data_source import BufferedDataSource, DataSource
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.slime_data_source import PluginDataSource
from slimeflow.rollout.slime_plugins import slime_args
from slimeflow.slime_compat.utils.types import Sample as SlimeSample
from slimeflow.stages.train import loop
from slimeflow.stages.train.preflight import plugin_problems
from slimeflow.stages.train.rollouts import Rollouts
from slimeflow.train.loss import LossNormalizer, compute_loss, load_custom_pg_loss_reducer

PLUGINS = DATA / "slime_plugins"
SOURCE = "slime_style_data_source.ListDataSource"
make_ctx = test_rollout.make_ctx  # the fixture: make(engine, config, version) -> a RolloutContext


@pytest.fixture(autouse=True)
def slime_plugins_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    slime_compat.install()


def custom_config(tmp_path: Path, text: str = "data_source_prompts: [a1, b2, c3]\n") -> str:
    path = tmp_path / "custom.yaml"
    path.write_text(text)
    return str(path)


def _with_custom(tmp_path: Path, **train) -> TrainConfig:
    """A train config (test_rollout's) whose data source is ListDataSource over the prompts of a
    --custom-config-path key, checkpointing under `tmp_path`."""
    base = config(**train).model_dump(exclude_unset=True)
    base["data"] = {**base.get("data", {}), "data_source_path": SOURCE}
    base["checkpoint"] = {"save": str(tmp_path), "load": str(tmp_path)}
    base["custom_config_path"] = custom_config(tmp_path)
    return TrainConfig.model_validate(base)


def plugin_source(cfg) -> PluginDataSource:
    return PluginDataSource(load_plugin(SOURCE, "data-source-path"), slime_args(cfg), cfg.batch.n_samples_per_prompt)


def test_a_slime_data_source_feeds_the_rollout_and_takes_back_its_aborted_groups(tmp_path, make_ctx):
    cfg = _with_custom(tmp_path, rollout={"over_sampling_batch_size": 3, "partial_rollout": True})
    data = plugin_source(cfg)
    engine = ScriptedEngine({"a1": "1", "b2": "2", "c3": "3"}, hang={"c3"})
    first = run(make_ctx(engine, cfg), data, rollout_id=0)
    assert [g[0].prompt for g in first.groups] == ["a1", "b2"] and len(data) == 3
    (aborted,) = data.source.buffer  # slime Samples, in the class's own buffer (its add_samples)
    assert [s.response for s in aborted] == ["…", "…"] and aborted[0].metadata["start_rollout_id"] == 0
    assert type(aborted[0]) is SlimeSample  # slime's Sample, which is slimeflow's own (one class)
    engine.hang.clear()
    second = run(make_ctx(engine, _with_custom(tmp_path, rollout={"partial_rollout": True})), data, rollout_id=1)
    assert [g[0].prompt for g in second.groups] == ["c3", "a1"]  # the buffered group first, then the class's next
    assert second.groups[0][0].response == "…3" and second.groups[1][0].reward == 1.0  # scored as ours


def test_a_resumed_run_continues_the_slime_data_source(tmp_path):
    cfg = _with_custom(tmp_path)
    manager = Rollouts.__new__(Rollouts)  # its data state only: no engine
    manager.data, manager.in_flight = plugin_source(cfg), {}
    manager.data.get_groups(2)
    manager.data.add_groups([manager.data.get_groups(1)[0]], rollout_id=3)  # c3 aborted in rollout 3
    state = manager.state_dict(trained=3)  # the checkpoint of rollout 3: the class's save(3)
    assert state == {"data_source_rollout_id": 3} and (tmp_path / "rollout" / "list_source_3.json").is_file()

    restored = Rollouts.__new__(Rollouts)
    restored.data, restored.in_flight = plugin_source(cfg), {}
    restored.load_state_dict(state)  # the class's load(3), as slime's load(start_rollout_id - 1)
    expected = [[(s.group_index, s.prompt) for s in g] for g in manager.data.get_groups(3)]
    assert [[(s.group_index, s.prompt) for s in g] for g in restored.data.get_groups(3)] == expected
    assert [g[0][1] for g in expected] == ["c3", "a1", "b2"]
    # Over a checkpoint without slimeflow's state (slime's own), the class's load(start_rollout_id - 1), as slime.
    from_slime_checkpoint = plugin_source(cfg)
    from_slime_checkpoint.start(4)
    assert [g[0].prompt for g in from_slime_checkpoint.get_groups(3)] == [g[0][1] for g in expected]
    # A checkpoint of the other kind of data source is refused either way, with the way out.
    with pytest.raises(ValueError, match="resume with the same --data-source-path"):
        BufferedDataSource(DataSource([{"prompt": "x"}])).load_state_dict(state)
    with pytest.raises(ValueError, match="slimeflow's own data-source state"):
        restored.data.load_state_dict({"source": {}, "buffer": []})


def test_the_loop_saves_the_data_source_with_the_checkpoints_rollout_id():
    class States(Recorder):
        def state_dict(self, trained=None):
            self.calls.append(("state", trained))
            return {}

    recorder = States()
    loop.train(FakePlacement(recorder), 4, Reports())
    assert [c for c in recorder.calls if c[0] == "state"] == [("state", 1), ("state", 3)]


def test_a_data_source_that_breaks_slimes_contract_is_named(tmp_path):
    assert plugin_problems("data-source-path", SOURCE, False) == []
    [problem] = plugin_problems("data-source-path", "slime_style_data_source.NoSave", False)
    assert "lacks load, save (abstract)" in problem
    [problem] = plugin_problems("data-source-path", "slime_style_data_source.dr_grpo", False)
    assert "is not a class; slime instantiates the data source as cls(args)" in problem
    data = plugin_source(_with_custom(tmp_path))
    data.source.args.n_samples_per_prompt = 1  # the class now hands out groups of 1; the run asks for 2
    with pytest.raises(ValueError, match="a group of 1 samples; each group holds --n-samples-per-prompt 2"):
        data.get_groups(1)


def pg_loss(reducer: str | None, masks_from_tis=None, **algorithm):
    config = AlgorithmConfig(eps_clip_high=0.28, custom_pg_loss_reducer_function_path=reducer, **algorithm)
    inputs = hand_batch(total_lengths=[5, 7], **({"rollout_log_probs": ROLLOUT} if masks_from_tis else {}))
    out = compute_loss(config, inputs, LossNormalizer.for_batch(inputs.loss_masks), tis_function=masks_from_tis,
                       pg_loss_reducer=load_custom_pg_loss_reducer(config))
    return out


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_a_reducer_that_reproduces_slimes_default_gives_the_default_loss(per_token):
    default = pg_loss(None, calculate_per_token_loss=per_token)
    custom = pg_loss("slime_style_data_source.sum_of_sample_mean", calculate_per_token_loss=per_token)
    approx(custom.loss, default.loss.item())
    assert custom.metrics.keys() == default.metrics.keys()


def test_a_dr_grpo_reducer_changes_pg_loss_only():
    # per-token PPO losses (hand_batch): s0 [-1.28, -0.5], s1 [2, 1.6, 4]; Dr.GRPO divides each sum by 4
    default, out = pg_loss(None), pg_loss("slime_style_data_source.dr_grpo")
    approx(out.metrics["pg_loss"], ((-1.28 - 0.5) / 4 + (2 + 1.6 + 4) / 4) / 2)
    approx(out.loss, out.metrics["pg_loss"].item())
    for key in ("pg_clipfrac", "ppo_kl"):  # the other metrics keep slime's default reduction
        approx(out.metrics[key], default.metrics[key].item())


def test_the_reducer_gets_the_masks_a_tis_function_returns():
    from test_tis_mismatch import reject_above_two

    out = pg_loss("slime_style_data_source.sum_of_sample_mean", masks_from_tis=reject_above_two, use_tis=True)
    # s0's second token (ratio 3) is rejected: the reducer's own mean over the one token left, as slime's
    approx(out.metrics["pg_loss"], (-1.28 / 1 + (2 + 1.6 + 4) / 3) / 2)


TRAIN = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1"]


def test_a_custom_config_sets_plugin_args_and_overrides_the_flags_it_names(tmp_path):
    path = custom_config(tmp_path, "tis_mode: truncate\nmax_turns: 3\nuse_tis: true\ntis_clip: 2.5\n"
                                   "sglang_mem_fraction_static: 0.5\n")
    cfg = load_stage_config("train", None, [*TRAIN, "--custom-config-path", path, "--tis-clip", "3"])
    assert cfg.algorithm.use_tis and cfg.algorithm.tis_clip == 2.5  # the file wins over the command line, as slime
    assert cfg.sglang.args == {"mem_fraction_static": 0.5} and cfg.custom_args == {"tis_mode": "truncate",
                                                                                  "max_turns": 3}
    args = slime_args(cfg)
    assert (args.tis_mode, args.max_turns, args.tis_clip, args.custom_config_path) == ("truncate", 3, 2.5, path)


def test_editing_a_custom_configs_plugin_settings_changes_the_train_stages_cache_key(tmp_path):
    """The plug-in settings are not config fields; a pipeline rerun must still train again when they change."""
    from slimeflow.io.manifest import config_hash

    path = custom_config(tmp_path, "max_turns: 3\n")
    before = config_hash(load_stage_config("train", None, [*TRAIN, "--custom-config-path", path]))
    assert before == config_hash(load_stage_config("train", None, [*TRAIN, "--custom-config-path", path]))
    Path(path).write_text("max_turns: 4\n")
    assert config_hash(load_stage_config("train", None, [*TRAIN, "--custom-config-path", path])) != before


@pytest.mark.parametrize("text, message", [
    (None, "no such file; give the YAML file"),
    ("use_critic: true\n", "use_critic: slime's flag --use-critic, which slimeflow does not take (PPO with a critic"),
    ("- a\n- b\n", "must be a mapping"),
])
def test_a_custom_config_slimeflow_cannot_take_is_refused_at_parse(tmp_path, text, message):
    path = str(tmp_path / "missing.yaml") if text is None else custom_config(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_stage_config("train", None, [*TRAIN, "--custom-config-path", path])
    assert message in str(err.value)


def test_slimes_default_class_means_slimeflows_data_source_and_its_base_class_loads():
    cfg = load_stage_config("train", None, [*TRAIN, "--data-source-path",
                                            "slime.rollout.data_source.RolloutDataSourceWithBuffer"])
    assert cfg.data.data_source_path is None  # what slimeflow's own data source does
    # the read-only base class (for subclasses) is slimeflow's data source behind slime's API
    assert plugin_problems("data-source-path", "slime.rollout.data_source.RolloutDataSource", False) == []


def test_the_rollout_manager_builds_the_class_and_leaves_prompt_data_to_it(tmp_path):
    from slimeflow.io.storage import Storage
    from slimeflow.rollout.raw_data import prepare_data
    from slimeflow.stages.train.rollout_manager import RolloutSetup
    from slimeflow.stages.train.rollouts import _data_source

    raw = tmp_path / "prompts.jsonl"
    raw.write_text('{"input": "x"}\n')  # raw data: slimeflow would preprocess it for its own data source
    cfg = _with_custom(tmp_path, data={"prompt_data": str(raw)})
    prepared, sets = prepare_data(cfg, Storage(), tmp_path / "work")
    assert prepared.data.prompt_data == str(raw) and sets == {}
    data = _data_source(prepared, RolloutSetup(hf_checkpoint="unused", prompt_data=str(raw), eval_prompt_data={}))
    assert isinstance(data, PluginDataSource) and data.source.args.prompt_data == str(raw)
    assert [g[0].prompt for g in data.get_groups(2)] == ["a1", "b2"]


def test_a_custom_data_source_needs_num_rollout_but_no_prompt_data(tmp_path):
    from slimeflow.errors import StageInputError
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext
    from slimeflow.stages.train.stage import rollout_setup

    argv = ["--rollout-batch-size", "2", "--num-epoch", "1", "--data-source-path", SOURCE]
    with pytest.raises(StageInputError) as err:
        rollout_setup(load_stage_config("train", None, argv), StageContext(Storage(), tmp_path, str(tmp_path)))
    assert f"--num-epoch with --data-source-path {SOURCE}" in str(err.value) and "give --num-rollout" in str(err.value)
    assert "--prompt-data is not set" not in str(err.value)


def test_a_rollout_function_gets_the_data_source_object_itself(tmp_path, make_ctx):
    from slimeflow.rollout.slime_rollout_functions import run_rollout_function
    from slimeflow.slime_compat.rollout.sglang_rollout import GenerateState

    cfg = _with_custom(tmp_path, rollout={"rollout_function_path": "slime_style_rollout.generate_rollout",
                                          "custom_generate_function_path": "slime_style_hooks:record_evaluation"})
    data = plugin_source(cfg)
    GenerateState.clear_instances()
    try:
        result = run_rollout_function(load_plugin(cfg.rollout.rollout_function_path, "rollout-function-path"),
                                      make_ctx(ScriptedEngine({}), cfg), data, 4)
    finally:
        GenerateState.clear_instances()
    assert [[s.prompt for s in g] for g in result.groups] == [["a1", "a1"], ["b2", "b2"]]
    assert [g[0].prompt for g in data.source.buffer] == ["c3"]  # the function's add_samples, on the class (as slime)


def scaled_by_custom_key(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                         response_lengths):
    """A TIS function in slime's form reading its setting from args, as slime's mis.py reads mis.yaml's."""
    return pg_loss * args.tis_scale, loss_masks, {}


def test_a_custom_tis_function_reads_the_custom_configs_keys_from_args(tmp_path):
    from slimeflow.train.loss import load_custom_tis

    cfg = load_stage_config("train", None, [
        *TRAIN, "--custom-config-path", custom_config(tmp_path, "tis_scale: 0.5\nuse_tis: true\n"),
        "--custom-tis-function-path", "test_slime_path_hooks:scaled_by_custom_key"])
    tis = load_custom_tis(cfg.algorithm, slime_args(cfg))  # as the backends load it
    inputs = hand_batch(total_lengths=[5, 7], rollout_log_probs=ROLLOUT)
    out = compute_loss(cfg.algorithm, inputs, LossNormalizer.for_batch(inputs.loss_masks), tis_function=tis)
    plain = compute_loss(cfg.algorithm.model_copy(update={"use_tis": False}), inputs,
                         LossNormalizer.for_batch(inputs.loss_masks))
    approx(out.metrics["pg_loss"], 0.5 * plain.metrics["pg_loss"].item())
