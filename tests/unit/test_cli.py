"""The `slimeflow` command: help under slime's names, config translation, clear errors (a real run:
tests/integration/test_cli_runs.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from paths import DATA

from slimeflow.cli import held_out_change, main

SEEDS = DATA / "seed_scripts"


def test_overview_lists_every_stage(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for stage in ("model", "convert", "preprocess", "train", "evaluate", "export"):
        assert f"  {stage} " in out
    assert "[not available yet]" not in out  # every stage has landed


def test_stage_help_lists_flags_under_slime_names(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--rollout-batch-size", "--n-samples-per-prompt", "--advantage-estimator", "--eps-clip-high",
                 "--kl-loss-type", "--hf-checkpoint", "--ref-load", "--save-interval", "--eval-prompt-data",
                 "--use-dynamic-batch-size", "--ray-address", "--mlflow-tracking-uri"):
        assert flag in out, flag
    assert "{grpo,gspo,cispo,ppo,reinforce_plus_plus,reinforce_plus_plus_baseline}" in out
    assert main(["preprocess", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--input-key" in out and "--apply-chat-template" in out and "--output" in out


def test_print_config_translates_a_slime_script_into_yaml(capsys):
    flags = (SEEDS / "skill-en-grpo-quickstart.sh").read_text().replace("\\", " ").split("\n")[1:]
    argv = " ".join(flags).split()
    assert main(["train", *argv, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    batch = printed["train"]["batch"]
    assert (batch["rollout_batch_size"], batch["global_batch_size"], batch["num_steps_per_rollout"]) == (32, 256, 1)
    assert printed["train"]["algorithm"]["kl_loss_coef"] == 0.001
    # The printed YAML is itself a valid config: translate once, then edit the file.
    from slimeflow.config.pipeline import load_stage_config

    assert load_stage_config("train", printed["train"]).batch.num_rollout == 3000


def test_print_config_notes_what_slimes_megatron_backend_sets_itself(capsys):
    """slime's Megatron backend forces bf16 and the distributed optimizer, so its scripts pass neither: translating
    one for the Megatron backend says which are missing and how to get slime's numerics."""
    base = ["train", "--hf-checkpoint", "tiny:qwen3", "--prompt-data", "p.parquet", "--rollout-batch-size", "2",
            "--num-rollout", "1", "--train-backend", "megatron", "--print-config"]
    assert main([*base, "--bf16"]) == 0
    note = capsys.readouterr().err
    assert "note: slime's Megatron backend always trains with the distributed optimizer" in note
    assert "add --use-distributed-optimizer for slime's numerics" in note and "--bf16 " not in note
    assert main([*base, "--bf16", "--use-distributed-optimizer"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert main([*base[:-3], "--print-config"]) == 0  # the torch backend: nothing to note
    assert "note:" not in capsys.readouterr().err


def test_bad_flags_exit_2_with_every_problem_named(capsys):
    assert main(["model", "--hf-checkpoint", "tiny:llama", "--use-critic", "--nmae", "x"]) == 2
    err = capsys.readouterr().err
    assert "--use-critic: not supported yet" in err and "--nmae: unknown flag; did you mean --name?" in err


def test_a_finished_run_says_how_each_held_out_set_changed():
    manifest = {"facts": {
        "eval_first": {"eval/times/avg_at_1": 0.140625, "eval/times/prompts": 64.0, "eval/math/avg_at_1": 0.5},
        "eval_last": {"eval/times/avg_at_1": 0.84375, "eval/times/prompts": 64.0, "eval/times/truncated_rate": 0.05}}}
    # A set evaluated first but not last (a failed last eval) has no change to tell.
    assert held_out_change(manifest) == ["eval/times/avg_at_1: 0.141 -> 0.844 (64 prompts)"]
    assert held_out_change({"facts": {"eval_first": {}, "eval_last": {}}}) == []
    assert held_out_change({}) == []


def test_run_needs_a_config_file(capsys):
    assert main(["run"]) == 2
    assert "give a pipeline YAML file" in capsys.readouterr().err


def test_bad_yaml_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    assert main(["run", str(bad)]) == 2
    assert f"{bad}: not valid YAML" in capsys.readouterr().err


def test_the_console_script_is_installed():
    out = subprocess.run([Path(sys.executable).with_name("slimeflow"), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip()


def test_a_custom_config_that_overrides_flags_says_so_once_each(tmp_path, caplog):
    custom = tmp_path / "custom.yaml"
    custom.write_text("lr: 5.0\nrollout_batch_size: 999\nn_samples_per_prompt: 2\nmy_plugin_setting: 3\n")
    assert main(["train", "--lr", "1e-3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                 "--num-rollout", "1", "--custom-config-path", str(custom), "--print-config"]) == 0
    said = [r.getMessage() for r in caplog.records if "overrides the flag" in r.getMessage()]
    assert said == [f"train: --custom-config-path {custom}: lr overrides the flag: 0.001 -> 5.0",
                    f"train: --custom-config-path {custom}: rollout_batch_size overrides the flag: 4 -> 999"]
