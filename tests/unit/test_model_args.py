"""slime's Megatron flags under the torch backend: MODEL_ARGS checked against the HF config, parallelism refused."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from paths import DATA
from train_helpers import flag_config as train_config

from slimeflow.config.model_args import check_model_args
from slimeflow.config.pipeline import load_stage_config
from slimeflow.errors import StageInputError
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.stages.train.stage import rollout_setup

SEEDS = DATA / "seed_scripts"

# Qwen3-4B's config.json (the fields MODEL_ARGS describe), as published with the model.
QWEN3_4B = {
    "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 2560, "intermediate_size": 9728,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_dropout": 0.0,
}


def model_args() -> list[str]:
    """slime's qwen3-4B.sh MODEL_ARGS (the seed transcript, without the batch flags at its end)."""
    lines = [line.split("#", 1)[0] for line in (SEEDS / "qwen3-4b-model-args.sh").read_text().splitlines()]
    return shlex.split("\n".join(lines))[:-4]


def test_slimes_qwen3_4b_model_args_match_the_models_config():
    config = train_config(*model_args())
    assert check_model_args(config.megatron, QWEN3_4B, "torch") == []


def test_a_model_arg_that_contradicts_the_config_is_refused_with_both_values():
    args = [a if a != "1000000" else "10000" for a in model_args()]  # --rotary-base 10000
    problems = check_model_args(train_config(*args).megatron, QWEN3_4B, "torch")
    assert problems == ["--rotary-base 10000.0 does not match the HF config (rope_theta: 1000000 means 1000000); "
                        "correct the flag or drop it"]
    wrong_groups = check_model_args(train_config("--num-query-groups", "4").megatron, QWEN3_4B, "torch")
    assert "--num-query-groups 4 does not match the HF config (num_key_value_heads: 8" in wrong_groups[0]


def test_transformers_5_rope_parameters_are_read():
    hf = {k: v for k, v in QWEN3_4B.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 1e6}}
    assert check_model_args(train_config("--rotary-base", "1000000").megatron, hf, "torch") == []


def test_untied_output_flag_is_checked_against_tie_word_embeddings():
    problems = check_model_args(train_config("--untie-embeddings-and-output-weights").megatron, QWEN3_4B, "torch")
    assert len(problems) == 1 and "tie_word_embeddings: True" in problems[0]


def test_layer_flags_are_checked_against_the_configs_switches():
    qwen3 = {**QWEN3_4B, "architectures": ["Qwen3ForCausalLM"]}
    assert check_model_args(train_config("--qk-layernorm", "--disable-bias-linear").megatron, qwen3, "torch") == []
    assert check_model_args(train_config("--add-qkv-bias").megatron, qwen3, "torch") == [
        "--add-qkv-bias True does not match the HF config (attention_bias: absent means False); correct the flag or "
        "drop it"]
    glm = {**QWEN3_4B, "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "use_qk_norm": False}
    problems = check_model_args(train_config("--qk-layernorm", "--add-qkv-bias").megatron, glm, "torch")
    assert problems == ["--qk-layernorm True does not match the HF config (use_qk_norm: False means False); correct "
                        "the flag or drop it"]
    llama = {**QWEN3_4B, "architectures": ["LlamaForCausalLM"], "attention_bias": True, "mlp_bias": True}
    problems = check_model_args(train_config("--disable-bias-linear").megatron, llama, "torch")
    assert len(problems) == 1 and problems[0].startswith("--disable-bias-linear True does not match the HF config")


def test_no_model_args_check_nothing():
    assert check_model_args(train_config().megatron, {}, "torch") == []


BUILT_BY_MEGATRON = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
                     "--recompute-granularity", "--use-distributed-optimizer", "--expert-model-parallel-size"}


@pytest.mark.parametrize("flags", [["--tensor-model-parallel-size", "8"], ["--pipeline-model-parallel-size", "4"],
                                   ["--context-parallel-size", "2"], ["--sequence-parallel"],
                                   ["--recompute-granularity", "selective"], ["--use-distributed-optimizer"],
                                   ["--expert-model-parallel-size", "2"]])
def test_megatron_parallelism_is_refused_under_the_torch_backend(flags):
    problems = check_model_args(train_config(*flags).megatron, QWEN3_4B, "torch")
    assert len(problems) == 1 and problems[0].startswith(flags[0]) and "--train-backend megatron" in problems[0]
    under_megatron = check_model_args(train_config(*flags).megatron, QWEN3_4B, "megatron")
    if flags[0] in BUILT_BY_MEGATRON:
        assert under_megatron == []  # what the Megatron backend builds
    else:  # refused by name, with the reason
        assert len(under_megatron) == 1 and under_megatron[0].startswith(flags[0])
        assert "the Megatron backend does not build it yet" in under_megatron[0]


def test_full_recomputation_is_taken_with_its_method_and_unit():
    flags = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]
    megatron = train_config(*flags).megatron
    assert (megatron.recompute_granularity, megatron.recompute_method, megatron.recompute_num_layers) == \
        ("full", "block", 2)
    assert check_model_args(megatron, QWEN3_4B, "megatron") == []
    assert len(check_model_args(megatron, QWEN3_4B, "torch")) == 3


@pytest.mark.parametrize(("flags", "message"), [
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "and --recompute-num-layers N"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "--recompute-num-layers without --recompute-granularity full: they choose which layers full recomputation "
     "recomputes; selective recomputation recomputes the core attention of every layer"),
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"],
     "--recompute-method and --recompute-num-layers without --recompute-granularity full"),
])
def test_recompute_flags_that_megatron_would_reject_or_ignore_are_refused_at_parse(flags, message):
    from slimeflow.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("-", "\\-")):
        train_config(*flags)


def test_context_parallelism_says_why_it_cannot_run_on_a_cpu():
    problems = check_model_args(train_config("--context-parallel-size", "2").megatron, QWEN3_4B, "megatron")
    assert len(problems) == 1 and "local attention asserts context parallel size 1" in problems[0]


def test_the_train_stage_refuses_tp8_before_anything_starts(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    config = train_config("--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "prompts"),
                          "--tensor-model-parallel-size", "8", "--num-layers", "28")
    with pytest.raises(StageInputError) as err:
        rollout_setup(config, StageContext(Storage(), tmp_path / "work", str(tmp_path / "work")))
    text = str(err.value)
    assert "--tensor-model-parallel-size 8: Megatron parallelism" in text
    assert "--num-layers 28 does not match the HF config (num_hidden_layers: 36" in text


SLIME_SCRIPTS = DATA / "slime_scripts"


def script_argv(name: str) -> list[str]:
    return [line for line in (SLIME_SCRIPTS / name).read_text().splitlines() if not line.startswith("# ")]


@pytest.mark.parametrize("script", sorted(p.name for p in SLIME_SCRIPTS.glob("*.args")))
def test_every_flag_of_slimes_run_scripts_is_taken_or_refused_with_a_reason(script):
    """No flag of slime's own run scripts is 'unknown': each is implemented or refused saying why."""
    from slimeflow.errors import ConfigError

    try:  # the scripts whose every flag is built parse whole (run-qwen3-4B.args, ...)
        load_stage_config("train", None, script_argv(script))
    except ConfigError as err:
        assert err.problems and not [p for p in err.problems if "unknown flag" in p]


def test_slimes_qwen3_4b_run_script_is_refused_only_for_what_needs_megatron():
    """slime's script parses whole (its precision and kernel flags are the Megatron backend's); the Megatron backend
    takes every flag, the torch backend refuses the Megatron ones by name."""
    config = load_stage_config("train", None, script_argv("run-qwen3-4B.args"))
    assert config.megatron.attention_backend == "flash" and config.megatron.accumulate_allreduce_grads_in_fp32
    assert check_model_args(config.megatron, QWEN3_4B, "megatron") == []
    problems = check_model_args(config.megatron, QWEN3_4B, "torch")
    assert [p.split(" ", 1)[0] for p in problems] == [
        "--tensor-model-parallel-size", "--sequence-parallel", "--recompute-granularity", "--recompute-method",
        "--recompute-num-layers", "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
        "--attention-backend"]  # its MODEL_ARGS match Qwen3-4B's config.json
    assert all("--train-backend megatron" in p for p in problems)


def test_a_config_that_went_through_json_checks_only_what_was_given():
    """Prefect parameters and the train stage's subprocess tests round-trip the config through JSON."""
    from slimeflow.config.train import TrainConfig

    config = TrainConfig.model_validate_json(train_config().model_dump_json())
    assert check_model_args(config.megatron, QWEN3_4B, "torch") == []
    config = TrainConfig.model_validate_json(train_config("--num-layers", "28").model_dump_json())
    assert len(check_model_args(config.megatron, QWEN3_4B, "torch")) == 1


def test_flags_that_nothing_reads_are_refused_not_accepted():
    """--save-hf and --eval-config did nothing: refused by name; so are SGLang server arguments, which no server
    slimeflow starts would get."""
    from slimeflow.errors import ConfigError

    for flags, reason in ((["--save-hf", "/x"], "slimeflow export"),
                          (["--eval-config", "e.yaml"], "use the --eval-")):
        with pytest.raises(ConfigError, match=reason):
            train_config(*flags)
    config = train_config("--sglang-mem-fraction-static", "0.7", "--sglang-worker-urls", "http://a:1", "http://b:2")
    assert config.sglang.unread(launches_sglang=False) == [
        "--sglang-mem-fraction-static: an SGLang server argument, but no SGLang server is launched here (the engines "
        "are servers started elsewhere, or the embedded engine, which takes none, where SGLang is not installed); "
        "install SGLang on a GPU cluster, or start your SGLang servers with it and pass "
        "--rollout-external-engine-addrs"]


def test_several_worker_urls_on_the_command_line_are_several_servers():
    from slimeflow.stages.train.engines import EngineSet

    config = train_config("--sglang-worker-urls", "http://a:1", "http://b:2", "--sglang-weights-dir", "/w")
    launch = EngineSet.launch("hf", config.sglang.args, 1)
    assert launch.external.worker_urls == ["http://a:1", "http://b:2"]  # (ready() would check their /health)


def test_ppo_without_a_critic_is_refused_before_anything_starts(tmp_path: Path):
    """It was accepted and failed at the first step ("needs the critic's values")."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    config = train_config("--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "prompts"),
                          "--advantage-estimator", "ppo")
    with pytest.raises(StageInputError, match=r"--advantage-estimator ppo needs a critic's values"):
        rollout_setup(config, StageContext(Storage(), tmp_path / "work", str(tmp_path / "work")))


def test_the_megatron_backend_refuses_a_run_it_cannot_start(tmp_path: Path):
    from slimeflow.io.checkpoints import commit
    from slimeflow.train.backends.megatron.preflight import megatron_backend_problems

    empty = ["--train-backend", "megatron", "--load", str(tmp_path / "empty")]
    problems = megatron_backend_problems(train_config(*empty, "--use-kl-loss", "--bf16", "--actor-num-gpus-per-node",
                                                      "3", "--tensor-model-parallel-size", "2"))
    assert len(problems) == 3, problems  # --bf16 is built
    assert "starts from a torch_dist checkpoint" in problems[0] and "need --ref-load" in problems[1]
    assert "3 training ranks" in problems[2] and "= 2" in problems[2]
    assert megatron_backend_problems(train_config(*empty, "--ref-load", str(tmp_path / "ref"),
                                                  "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size",
                                                  "2", "--pipeline-model-parallel-size", "2")) == []
    (tmp_path / "run" / "iter_0000003").mkdir(parents=True)  # a checkpoint to resume: no --ref-load needed
    for marker in (".metadata", "common.pt", "metadata.json"):
        (tmp_path / "run" / "iter_0000003" / marker).write_text("x")
    commit(Storage(), str(tmp_path / "run"), 3)
    assert megatron_backend_problems(train_config("--train-backend", "megatron", "--load", str(tmp_path / "run"))) == []
