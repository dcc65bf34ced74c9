"""What is wrong with a train run that the config alone shows, checked before Prefect, Ray or an engine starts (the
CLI asks, through stages.preflight) and again when the stage starts: the plug-ins (import and call signature), the
saved rollouts a --debug-train-only run replays (their contents, by the restricted unpickler), the paths the config
names and the checkpoint a run would start from (complete, its files the sizes they were saved at).

This module stays light (no Ray, no torch until a plug-in is checked): the CLI imports it to fail in seconds.
"""

from __future__ import annotations

from slimeflow.checkpoint.hf_source import is_source_spec
from slimeflow.checkpoint.integrity import quick_problems
from slimeflow.config.train import TrainConfig
from slimeflow.errors import CheckpointError, PluginError, StageInputError
from slimeflow.io.storage import is_local, local_path
from slimeflow.rollout.plugins import load_plugin
from slimeflow.stages.train.debug_data import content_problem, rollout_path
from slimeflow.train.backends.checkpoint import resolve_start


def replay_problems(config: TrainConfig) -> list[str]:
    """--debug-train-only: the saved rollouts to train on are there, and hold only plain data (prompts are not read,
    but --num-epoch counts them)."""
    template = config.debug.load_debug_rollout_data
    if config.batch.num_rollout is None:
        return [] if config.data.prompt_data is not None else [
            "--num-epoch with --debug-train-only needs --prompt-data to count the rollouts of an epoch; give "
            "--num-rollout N (the number of saved rollouts to train on) instead"]
    first = config.checkpoint.start_rollout_id or 0
    missing = [str(rollout_path(template, k)) for k in range(first, config.batch.num_rollout)
               if not rollout_path(template, k).is_file()]
    if not missing:
        return [p for k in range(first, config.batch.num_rollout) if (p := content_problem(template, k))]
    return [f"--load-debug-rollout-data {template}: {len(missing)} of the files of rollouts {first}.."
            f"{config.batch.num_rollout - 1} are missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            "write them with a run given --save-debug-rollout-data, or lower --num-rollout"]


def preflight(config: TrainConfig) -> list[str]:
    """What is wrong with the run, found from the config alone, before Prefect, Ray or an engine starts (the CLI
    asks): the plug-ins (import and signature), the saved rollouts a --debug-train-only run replays (their
    contents), the paths the config names itself and the checkpoint it would start from. Inputs an earlier stage of a pipeline makes are not set yet;
    rollout_setup checks them when the stage starts."""
    problems = plugin_problems_of(config)
    if config.debug.load_debug_rollout_data is not None:  # (it implies --debug-train-only)
        problems += replay_problems(config)
    hf = config.checkpoint.hf_checkpoint
    if hf is not None and not is_source_spec(hf) and not (local_path(hf) / "config.json").is_file():
        problems.append(f"--hf-checkpoint {hf} has no config.json")
    problems += checkpoint_problems(config)
    prompts = config.data.prompt_data if config.data.data_source_path is None else None  # else the class reads it
    sets = {"--prompt-data": prompts,
            **{f"--eval-prompt-data {name}": uri for name, uri in config.eval.eval_prompt_data.items()}}
    problems += [f"{flag} {uri} does not exist" for flag, uri in sets.items()
                 if uri is not None and is_local(uri) and not local_path(uri).exists()]
    return problems


PLUGIN_FLAGS = {
    ("rollout", "custom_generate_function_path"): "custom-generate-function-path",
    ("rollout", "rollout_function_path"): "rollout-function-path",
    ("rollout", "dynamic_sampling_filter_path"): "dynamic-sampling-filter-path",
    ("rollout", "buffer_filter_path"): "buffer-filter-path",
    ("reward", "custom_rm_path"): "custom-rm-path",
    ("algorithm", "custom_loss_function_path"): "custom-loss-function-path",
    ("algorithm", "custom_advantage_function_path"): "custom-advantage-function-path",
    ("rollout", "rollout_sample_filter_path"): "rollout-sample-filter-path",
    ("rollout", "custom_rollout_log_function_path"): "custom-rollout-log-function-path",
    ("algorithm", "custom_reward_post_process_path"): "custom-reward-post-process-path",
    ("rollout", "rollout_all_samples_process_path"): "rollout-all-samples-process-path",
    ("eval", "custom_eval_rollout_log_function_path"): "custom-eval-rollout-log-function-path",
    ("eval", "eval_function_path"): "eval-function-path",
    ("algorithm", "custom_convert_samples_to_train_data_path"): "custom-convert-samples-to-train-data-path",
    ("train_hooks", "custom_megatron_init_path"): "custom-megatron-init-path",
    ("train_hooks", "custom_model_provider_path"): "custom-model-provider-path",
    ("train_hooks", "custom_megatron_before_log_prob_hook_path"): "custom-megatron-before-log-prob-hook-path",
    ("train_hooks", "custom_megatron_before_train_step_hook_path"): "custom-megatron-before-train-step-hook-path",
    ("train_hooks", "rollout_data_postprocess_path"): "rollout-data-postprocess-path",
    ("weight_sync", "custom_update_weight_post_write_path"): "custom-update-weight-post-write-path",
    ("algorithm", "custom_pg_loss_reducer_function_path"): "custom-pg-loss-reducer-function-path",
    ("data", "data_source_path"): "data-source-path",
}


def plugin_problems(flag: str, path: str | None, group_rm: bool) -> list[str]:
    """Why the plug-in at `path` cannot be loaded or called as --`flag` is (empty when it can, or path is None)."""
    if path is None:
        return []
    problem: str | None
    try:
        plugin = load_plugin(path, flag)
    except PluginError as err:
        problem = str(err)
    else:
        from slimeflow.rollout.slime_plugins import (
            call_problem,  # here, for a plug-in that loads: it imports torch (3.4 s of a 6-9 s check at load 6)
        )

        problem = call_problem(flag, plugin, group_rm=group_rm)
    return [problem if problem.startswith("--") else f"--{flag} {path!r}: {problem}"] if problem else []


def plugin_problems_of(config: TrainConfig) -> list[str]:
    """Why each plug-in path of the config cannot be loaded or called the way the run will call it."""
    problems = []
    for (group, field), flag in PLUGIN_FLAGS.items():
        problems.extend(plugin_problems(flag, getattr(getattr(config, group), field), config.reward.group_rm))
    for path in config.rollout.rollout_sample_hook_path or []:
        problems.extend(plugin_problems("rollout-sample-hook-path", path, False))
    return problems


def check_plugins(config: TrainConfig) -> None:
    """Every plug-in path loads and can be called the way the run will call it, before Ray or an engine starts;
    all the wrong ones are named at once."""
    problems = plugin_problems_of(config)
    if problems:
        raise StageInputError("the train stage's plug-ins", problems, "Fix the paths (package.module:function).")


def checkpoint_problems(config: TrainConfig) -> list[str]:
    """The checkpoint the run would start from (slime's rule: --load's latest, else --ref-load's), where both are
    local: complete, and its files there at the sizes .metadata or its checksums record (contents are hashed when
    it is loaded)."""
    load, ref = config.checkpoint.load, config.checkpoint.ref_load
    if any(uri is not None and not is_local(uri) for uri in (load, ref)):
        return []  # an object store's: read where the stage starts
    try:
        start = resolve_start(load, ref)
    except CheckpointError as err:
        return [f"--ref-load {ref}: {err}"]
    if start.ref is None:
        return []
    flag = "--load" if start.source == "load" else "--ref-load"
    return [f"{flag} {load if flag == '--load' else ref}: {problem}"
            for problem in quick_problems(local_path(start.ref.uri))]
