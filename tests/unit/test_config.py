"""Config: the seeds' slime flag lists parse into our models; the batch invariant; errors name flag and value."""

from __future__ import annotations

import shlex

import pytest
from paths import DATA, ROOT

from slimeflow.config.flags import FlagIndex, leaves
from slimeflow.config.pipeline import STAGE_CONFIGS, PipelineConfig, load_pipeline_config, load_stage_config
from slimeflow.config.train import TrainConfig
from slimeflow.errors import ConfigError

SEEDS = DATA / "seed_scripts"


def seed_flags(name: str) -> list[str]:
    """The flags of a transcribed run script: comments and line continuations removed, quotes honoured."""
    text = "\n".join(line.split("#", 1)[0] for line in (SEEDS / name).read_text().splitlines())
    return shlex.split(text.replace("\\\n", " "))


def test_grpo_quickstart_from_the_english_skill_doc():
    config = load_stage_config("train", None, seed_flags("skill-en-grpo-quickstart.sh"))
    assert config.batch.rollout_batch_size == 32
    assert config.batch.n_samples_per_prompt == 8
    assert config.batch.global_batch_size == 256
    assert config.batch.num_steps_per_rollout == 1  # derived: 32 x 8 = 256 x 1
    assert config.batch.num_rollout == 3000
    assert config.algorithm.advantage_estimator == "grpo"
    assert config.algorithm.use_kl_loss is True and config.algorithm.kl_loss_coef == 0.001
    assert config.placement.actor_num_gpus_per_node == 4 and config.placement.rollout_num_gpus == 4
    assert config.data.prompt_data == "/path/to/data.jsonl"


def test_workflow1_flags():
    config = load_stage_config("train", None, seed_flags("skill-en-workflow1.sh"))
    assert config.data.input_key == "prompt" and config.data.label_key == "label"
    assert config.data.apply_chat_template is True
    assert config.checkpoint.save_interval == 100 and config.eval.eval_interval == 50


def test_the_chinese_quickstart_run_script_parses_flag_for_flag():
    config = load_stage_config("train", None, seed_flags("quickstart-zh-glm4-9b.sh"))
    assert config.checkpoint.ref_load == "/root/GLM-Z1-9B-0414_torch_dist"
    assert config.checkpoint.load == config.checkpoint.save == "/root/GLM-Z1-9B-0414_slime/"
    assert config.batch.global_batch_size == 128 and config.batch.num_steps_per_rollout == 1
    assert config.reward.rm_type == "deepscaler"
    assert config.eval.eval_prompt_data == {"aime": "/root/aime-2024/aime-2024.jsonl"}
    assert config.eval.eval_top_p == 0.7 and config.eval.eval_max_response_len == 16384
    assert config.megatron.tensor_model_parallel_size == 2 and config.megatron.sequence_parallel is True
    assert config.megatron.recompute_granularity == "full"
    assert config.batch.use_dynamic_batch_size and config.batch.max_tokens_per_gpu == 4608
    assert config.algorithm.kl_loss_type == "low_var_kl" and config.algorithm.eps_clip_high == 0.28
    assert config.optimizer.adam_beta2 == 0.98 and config.optimizer.weight_decay == 0.1
    assert config.sglang.args == {"mem_fraction_static": "0.8"}
    assert config.rollout.over_sampling_batch_size == 64 and config.rollout.partial_rollout is True
    assert config.rollout.dynamic_sampling_filter_path.endswith("check_reward_nonzero_std")
    # --colocate: rollout uses the training devices, as slime overrides --rollout-num-gpus.
    assert config.placement.colocate and config.placement.rollout_num_gpus == 8


def test_megatron_model_args():
    config = load_stage_config("train", None, seed_flags("qwen3-4b-model-args.sh"))
    megatron = config.megatron
    assert (megatron.num_layers, megatron.hidden_size, megatron.ffn_hidden_size) == (36, 2560, 9728)
    assert megatron.num_query_groups == 8 and megatron.kv_channels == 128 and megatron.qk_layernorm
    assert megatron.rotary_base == 1_000_000 and megatron.norm_epsilon == 1e-6 and megatron.vocab_size == 151936


def test_unsupported_flags_are_each_named_with_the_reason():
    with pytest.raises(ConfigError) as caught:
        load_stage_config("train", None, seed_flags("older-docs-unsupported.sh"))
    problems = caught.value.problems
    assert len(problems) == 4, problems
    text = str(caught.value)
    assert "--update-weights-interval" not in text  # taken: the synchronous loop pushes every N rollouts
    assert "--max-turns: unknown flag" in text
    assert "--prompt-key: use --input-key" in text
    assert "--rollout-generate-func-path: use --custom-generate-function-path" in text
    assert "--reward-fn-path: use --custom-rm-path" in text


def test_a_misspelt_flag_gets_a_suggestion():
    with pytest.raises(ConfigError, match=r"--rollout-batch-sise: unknown flag; did you mean --rollout-batch-size\?"):
        load_stage_config("train", None, ["--rollout-batch-sise", "4", "--num-rollout", "1"])


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        # Derived from num_steps_per_rollout, as slime does.
        (["--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--num-steps-per-rollout", "4"], (32, 4)),
        # Derived from global_batch_size.
        (["--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "64"], (64, 2)),
        # Neither: one on-policy step per rollout.
        (["--rollout-batch-size", "16", "--n-samples-per-prompt", "8"], (128, 1)),
        # Both, consistent.
        (["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
          "--num-steps-per-rollout", "2"], (4, 2)),
    ],
)
def test_batch_invariant_is_derived(flags, expect):
    batch = load_stage_config("train", None, [*flags, "--num-rollout", "1"]).batch
    assert (batch.global_batch_size, batch.num_steps_per_rollout) == expect
    assert batch.rollout_batch_size * batch.n_samples_per_prompt == batch.global_batch_size * batch.num_steps_per_rollout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--global-batch-size", "100"], "256 is not a multiple of --global-batch-size 100"),
        (["--global-batch-size", "128", "--num-steps-per-rollout", "1"], "--global-batch-size 128 contradicts"),
        (["--num-steps-per-rollout", "3"], "--num-steps-per-rollout 3 does not divide"),
        # slime's floor division would accept 256 // 5 = 51 and then fail differently; we say why up front.
        (["--num-steps-per-rollout", "5"], "choose a divisor of 256"),
    ],
)
def test_batch_invariant_is_enforced(flags, message):
    base = ["--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--num-rollout", "1"]
    with pytest.raises(ConfigError, match=message):
        load_stage_config("train", None, base + flags)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--advantage-estimator", "grpo2"], r"--advantage-estimator grpo2: Input should be 'grpo', 'gspo'"),
        (["--rollout-batch-size", "many"], r"--rollout-batch-size many: Input should be a valid integer"),
        (["--rollout-batch-size", "0"], r"--rollout-batch-size 0: must be a positive integer"),
        (["--rollout-temperature", "0"], r"--rollout-temperature 0: Input should be greater than 0"),
        (["--eps-clip-c", "0.5"], r"--eps-clip-c 0.5: Input should be greater than 1"),
        (["--custom-rm-path", "not a path"], r"--custom-rm-path 'not a path': 'not a path' is not a plug-in path"),
        (["--kl-coef", "0.1", "--kl-loss-coef", "0.1"], "slime allows only one"),
        (["--over-sampling-batch-size", "2"], "--over-sampling-batch-size 2 is smaller than --rollout-batch-size 4"),
        (["--eval-prompt-data", "aime"], "--eval-prompt-data takes NAME PATH pairs, got 1 values"),
        (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
    ],
)
def test_bad_values_name_the_flag_the_value_and_what_is_allowed(flags, message):
    with pytest.raises(ConfigError, match=message):
        base = ["--num-rollout", "1"] + ([] if "--rollout-batch-size" in flags else ["--rollout-batch-size", "4"])
        load_stage_config("train", None, [*base, *flags])


def test_missing_required_flag():
    with pytest.raises(ConfigError, match="--rollout-batch-size is required"):
        load_stage_config("train", {"num_rollout": 1})
    with pytest.raises(ConfigError, match="set --num-rollout"):
        load_stage_config("train", None, ["--rollout-batch-size", "4"])


def test_yaml_nested_and_flat_keys_agree_and_flags_override(tmp_path):
    nested = {"batch": {"rollout_batch_size": 4, "num_rollout": 2}, "algorithm": {"eps_clip": 0.1}}
    flat = {"rollout-batch-size": 4, "num_rollout": 2, "eps_clip": 0.1}
    assert load_stage_config("train", nested) == load_stage_config("train", flat)
    overridden = load_stage_config("train", nested, ["--eps-clip", "0.3", "--rollout-batch-size", "8"])
    assert overridden.algorithm.eps_clip == 0.3 and overridden.batch.rollout_batch_size == 8
    assert overridden.algorithm.eps_clip_high == 0.3  # defaults to eps_clip


def test_unknown_yaml_key_is_named_with_its_location():
    with pytest.raises(ConfigError, match=r"train: algorithm.eps_clipp: unknown flag; did you mean --eps-clip"):
        load_pipeline_config({"train": {"rollout_batch_size": 1, "num_rollout": 1, "algorithm": {"eps_clipp": 1}}})


def test_leaf_names_are_unique_in_every_stage_and_every_flag_has_help():
    for name, model in STAGE_CONFIGS.items():
        index = FlagIndex(model)  # raises on a duplicate flag
        undocumented = [leaf.flag for leaf in leaves(model) if not leaf.help]
        assert not undocumented, f"{name}: flags without help: {undocumented}"
        assert index.by_flag


def test_pipeline_routes_flags_to_stages_and_asks_when_ambiguous():
    data = {"hf_checkpoint": "tiny:llama", "preprocess": {"input": ["a.jsonl"], "output": "out"},
            "train": {"rollout_batch_size": 2, "num_rollout": 1}}
    config = load_pipeline_config(data, ["--input-key", "question", "--train.save", "ckpt", "--rollout-batch-size", "4",
                                         "--name", "exp1"])
    assert config.preprocess.input_key == config.train.data.input_key == "question"  # shared meaning: both
    assert config.train.checkpoint.save == "ckpt" and config.train.batch.rollout_batch_size == 4
    assert config.name == "exp1" and config.workdir == "runs/exp1" and config.output == "runs/exp1"
    with pytest.raises(ConfigError, match=r"--save: stages convert, train each define it .* --convert.save or --train.save"):
        load_pipeline_config(data, ["--save", "x"])


def test_pipeline_sends_megatron_training_flags_to_train_and_model_args_to_both():
    """MODEL_ARGS and TP (the vocabulary padding) go to convert and train alike; the layout, optimizer and runtime
    flags only to train: the converter writes one checkpoint for every layout and refuses them (a pipeline run with
    `--use-distributed-optimizer` on the command line failed at its convert stage)."""
    data = {"hf_checkpoint": "tiny:llama", "convert": {}, "train": {"rollout_batch_size": 2, "num_rollout": 1}}
    config = load_pipeline_config(data, ["--num-layers", "2", "--tensor-model-parallel-size", "2",
                                         "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"])
    assert config.convert.megatron.num_layers == config.train.megatron.num_layers == 2
    assert config.convert.megatron.tensor_model_parallel_size == config.train.megatron.tensor_model_parallel_size == 2
    assert config.train.megatron.use_distributed_optimizer and config.train.megatron.pipeline_model_parallel_size == 2
    assert not config.convert.megatron.use_distributed_optimizer
    assert config.convert.megatron.pipeline_model_parallel_size == 1
    with pytest.raises(ConfigError, match="--use-distributed-optimizer: no configured stage takes it"):
        load_pipeline_config({"hf_checkpoint": "tiny:llama", "convert": {}}, ["--use-distributed-optimizer"])


def test_stage_subcommand_flags_win_over_pipeline_flags():
    config = load_stage_config("preprocess", None, ["--input", "a.jsonl", "b.jsonl", "--output", "s3://bucket/data"])
    assert config.output == "s3://bucket/data" and config.input == ["a.jsonl", "b.jsonl"]
    model = load_pipeline_config(None, ["--hf-checkpoint", "tiny:qwen2", "--output", "s3://b/run"], only_stage="model")
    assert model.stages == ["model"] and model.model.hf_checkpoint == "tiny:qwen2" and model.output == "s3://b/run"


def test_stage_lists_are_checked_by_name():
    with pytest.raises(ConfigError, match="--stages \\['trian'\\]: unknown stage"):
        load_pipeline_config({"hf_checkpoint": "tiny:llama", "stages": ["model", "trian"]})
    with pytest.raises(ConfigError, match="--stages: evaluate selected but has no config section"):
        load_pipeline_config({"hf_checkpoint": "tiny:llama", "stages": ["model", "evaluate"]})
    config = load_pipeline_config({"hf_checkpoint": "tiny:llama", "train": {"rollout_batch_size": 1, "num_rollout": 1},
                                   "export": {}})
    assert config.stages == ["model", "train", "export"]


def test_infrastructure_from_config_else_environment():
    env = {"RAY_ADDRESS": "ray://head:10001", "MLFLOW_TRACKING_URI": "http://mlflow:5000",
           "AWS_ENDPOINT_URL": "http://minio:9000", "AWS_ACCESS_KEY_ID": "env-key", "AWS_SECRET_ACCESS_KEY": "s"}
    config = load_pipeline_config({"hf_checkpoint": "tiny:llama", "infra": {"ray_address": "ray://mine:1"}}, [], env)
    assert config.infra.ray_address == "ray://mine:1"  # config wins
    assert config.tracking_uri() == "http://mlflow:5000"
    s3 = config.infra.s3()
    assert s3.endpoint_url == "http://minio:9000"
    # The keys stay where they are: the config is a flow run's parameters (flows/credentials.py reads them at run time).
    assert s3.access_key_id is None and s3.secret_access_key is None
    assert "env-key" not in config.model_dump_json() and '"s"' not in config.model_dump_json()
    embedded = load_pipeline_config({"hf_checkpoint": "tiny:llama", "name": "x"}, [], {})
    assert embedded.infra.ray_address is None
    assert embedded.tracking_uri().startswith("sqlite:///") and embedded.tracking_uri().endswith("runs/x/mlflow.db")


@pytest.mark.parametrize("data, argv", [({"infra": {"s3_secret_access_key": "x"}}, []),
                                        ({}, ["--s3-access-key-id", "k"])])
def test_credentials_are_refused_as_config_with_where_they_go(data, argv):
    with pytest.raises(ConfigError, match="credentials are not config") as err:
        load_pipeline_config({"hf_checkpoint": "tiny:llama", **data}, argv)
    assert "AWS_SECRET_ACCESS_KEY" in str(err.value) and "--s3-credentials-block" in str(err.value)
    with pytest.raises(ValueError, match="s3_access_key_id: credentials are not config"):  # a Prefect parameter
        PipelineConfig.model_validate({"model": {"hf_checkpoint": "t"}, "infra": {"s3_access_key_id": "k"}})


def test_the_example_grpo_yaml_is_a_valid_train_config():
    from slimeflow.config.yaml_file import read_yaml

    data = read_yaml(ROOT / "examples" / "grpo-qwen3.yaml")
    config = load_stage_config("train", data["train"])
    assert isinstance(config, TrainConfig) and config.batch.global_batch_size == 256


def test_the_megatron_demo_is_the_demo_with_the_megatron_backend():
    from slimeflow.config.yaml_file import read_yaml

    examples = ROOT / "examples"
    torch_demo, megatron_demo = (load_pipeline_config(read_yaml(examples / name), [], {})
                                 for name in ("demo.yaml", "demo-megatron.yaml"))
    assert (torch_demo.train.placement.train_backend, megatron_demo.train.placement.train_backend) == \
        ("torch", "megatron")
    same = megatron_demo.train.model_copy(update={"placement": torch_demo.train.placement})
    assert same == torch_demo.train  # same task, data, batch and algorithm: only the backend differs


def test_dict_flags_add_to_the_yaml_by_name():
    data = {"rollout_batch_size": 1, "num_rollout": 1, "eval_prompt_data": {"aime": "a.jsonl", "gsm8k": "g.jsonl"},
            "sglang": {"mem_fraction_static": 0.7, "log_level": "INFO"}}
    config = load_stage_config("train", data, ["--eval-prompt-data", "aime", "a2.jsonl", "--sglang-log-level", "DEBUG"])
    assert config.eval.eval_prompt_data == {"aime": "a2.jsonl", "gsm8k": "g.jsonl"}
    assert config.sglang.args == {"mem_fraction_static": 0.7, "log_level": "DEBUG"}
