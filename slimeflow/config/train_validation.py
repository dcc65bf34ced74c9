"""What the train config's flags may be together, and the defaults that follow from other flags.

slimeflow/config/train.py declares the fields (torchtitan keeps job_config.py beside validation.py); every check
of a train flag lives here, in one of four places:
- a group's check reads that group alone and raises ValueError (`check_batch`, ...), called from its model validator;
- a check across groups goes in `check_train`, called from TrainConfig's model validator;
- a default that follows other flags (--offload-* from --colocate, ...) is derived before validation (`*_defaults`),
  so that it is validated as a given value is; the value stays out of model_fields_set (base.validate_derived);
- what the train stage checks when it starts, on the config alone (`*_problems`, lists of problems): flags whose
  check needs fields a pipeline fills in after parsing (--ref-load, ...), or that refuse a run, not a config (a
  run's layout: the evaluate stage builds a TrainConfig for its rollouts, without one). Checks that need files, this
  machine or installed packages stay with the stage (stages/train/stage.py, placement_plan.py,
  backends/megatron/preflight.py, model_args.check_model_args against the HF config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from slimeflow.config.base import peek

if TYPE_CHECKING:  # the models call these checks: at run time this module needs none of their classes
    from slimeflow.config.train import (
        AlgorithmConfig,
        BatchConfig,
        DebugConfig,
        LoggingConfig,
        OptimizerConfig,
        PlacementConfig,
        TrainConfig,
    )
    from slimeflow.config.train_rollout import RewardConfig

GRPO_FAMILY = ("grpo", "gspo", "cispo")
"""The estimators that normalise by the group's reward std."""


# ---- defaults that follow other flags -------------------------------------------------------------------------------

def batch_sizes(rollout_batch_size: int, n_samples_per_prompt: int, num_steps_per_rollout: int | None,
                global_batch_size: int | None) -> tuple[int, int]:
    """(num_steps_per_rollout, global_batch_size) from the one given (steps 1 when neither is): their product is
    rollout_batch_size x n_samples_per_prompt. ValueError when the given ones cannot make it so."""
    samples = rollout_batch_size * n_samples_per_prompt
    steps, gbs = num_steps_per_rollout, global_batch_size
    if steps is not None:
        if samples % steps:
            raise ValueError(
                f"--num-steps-per-rollout {steps} does not divide rollout_batch_size x n_samples_per_prompt = "
                f"{rollout_batch_size} x {n_samples_per_prompt} = {samples}; choose a divisor of {samples}"
            )
        derived = samples // steps
        if gbs is not None and gbs != derived:
            raise ValueError(
                f"--global-batch-size {gbs} contradicts rollout_batch_size x n_samples_per_prompt / "
                f"num_steps_per_rollout = {samples} / {steps} = {derived}; set one of the two, or make them agree"
            )
        return steps, derived
    if gbs is None:
        return 1, samples
    if samples % gbs:
        raise ValueError(
            f"rollout_batch_size x n_samples_per_prompt = {rollout_batch_size} x "
            f"{n_samples_per_prompt} = {samples} is not a multiple of --global-batch-size {gbs}"
        )
    return samples // gbs, gbs


def batch_defaults(model: type[BatchConfig], data: Any) -> dict[str, Any]:
    """--num-steps-per-rollout and --global-batch-size, the one from the other (check_batch refuses a bad pair)."""
    names = ("rollout_batch_size", "n_samples_per_prompt", "num_steps_per_rollout", "global_batch_size")
    values = peek(model, data, *names)
    if values is None or values[0] is None:
        return {}
    try:
        steps, gbs = batch_sizes(*values)
    except ValueError:
        return {}
    return {"num_steps_per_rollout": steps, "global_batch_size": gbs}


def algorithm_defaults(model: type[AlgorithmConfig], data: Any) -> dict[str, Any]:
    """--eps-clip-high defaults to --eps-clip (a symmetric clip)."""
    values = peek(model, data, "eps_clip", "eps_clip_high")
    return {"eps_clip_high": values[0]} if values is not None and values[1] is None else {}


def offload_defaults(offload: bool, offload_train: bool | None, offload_rollout: bool | None,
                     colocate: bool) -> tuple[bool, bool]:
    """As slime: --offload is both; --colocate turns on whichever is not given; otherwise both are off."""
    return tuple(True if offload else colocate if value is None else value  # type: ignore[return-value]
                 for value in (offload_train, offload_rollout))


def placement_defaults(model: type[PlacementConfig], data: Any) -> dict[str, Any]:
    """--offload-train/--offload-rollout follow --offload and --colocate; colocated rollout uses exactly the
    training devices (as slime: --rollout-num-gpus is then theirs)."""
    values = peek(model, data, "offload", "offload_train", "offload_rollout", "colocate", "actor_num_nodes",
                  "actor_num_gpus_per_node")
    if values is None:
        return {}
    offload, train, rollout, colocate, nodes, per_node = values
    train, rollout = offload_defaults(offload, train, rollout, colocate)
    return {"offload_train": train, "offload_rollout": rollout,
            **({"rollout_num_gpus": nodes * per_node} if colocate else {})}


def debug_defaults(model: type[DebugConfig], data: Any) -> dict[str, Any]:
    """--load-debug-rollout-data implies --debug-train-only, as in slime: loaded rollouts need no engine (with
    --debug-rollout-only check_debug refuses the pair, naming what the user gave)."""
    values = peek(model, data, "load_debug_rollout_data", "debug_rollout_only")
    if values is None or values[0] is None or values[1]:
        return {}
    return {"debug_train_only": True}


def train_defaults(model: type[TrainConfig], data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The defaults of one group that follow another group's flags: {group: {field: value}}.

    - No offload in a debug mode, as slime for --debug-rollout-only (no trainer: nothing to make room for);
      --debug-train-only has no engine (--offload, which would turn both on again, is then off as well).
    - --async and --use-fault-tolerance give the engine a process of its own unless --engine-in-process is given
      (overlap: the engine and the rollout loop need not share one GIL; a lone engine is restarted as a process).
    - std normalisation is off for a one-sample group of the GRPO family, as slime: its std is undefined.
    """
    def read(group: str, *names: str) -> tuple[Any, ...] | None:
        return peek(model.model_fields[group].annotation, data.get(group), *names)

    out: dict[str, dict[str, Any]] = {}
    placement = data.get("placement")
    debug = read("debug", "debug_rollout_only", "debug_train_only", "load_debug_rollout_data")
    resolved = read("placement", "offload", "offload_train", "offload_rollout", "colocate", "async_")
    fault_tolerant = read("fault_tolerance", "use_fault_tolerance")
    # (with --async a debug mode is refused, naming the offload flags too: left as given)
    if debug is not None and resolved is not None and not resolved[4] and (debug[0] or debug[1] or debug[2] is not None):
        train, _ = offload_defaults(*resolved[:4])
        out["placement"] = {"offload": False, "offload_train": train and not debug[0], "offload_rollout": False}
    if resolved is not None and fault_tolerant is not None and (resolved[4] or fault_tolerant[0]):
        if not _in_input(placement, "engine_in_process"):
            out.setdefault("placement", {})["engine_in_process"] = False
    samples = read("batch", "n_samples_per_prompt")
    estimator = read("algorithm", "advantage_estimator")
    if samples == (1,) and estimator is not None and estimator[0] in GRPO_FAMILY:
        out["algorithm"] = {"disable_grpo_std_normalization": True}
    return out


def _in_input(raw: Any, name: str) -> bool:
    """Whether a group's raw input names field `name` (as its model_fields_set would)."""
    return name in raw.model_fields_set if isinstance(raw, BaseModel) else isinstance(raw, Mapping) and name in raw


# ---- each group's checks: its own fields ---------------------------------------------------------------------------

def check_batch(batch: BatchConfig) -> None:
    """The batch invariant (rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout),
    the loop's length and the micro-batch."""
    _, gbs = batch_sizes(batch.rollout_batch_size, batch.n_samples_per_prompt, batch.num_steps_per_rollout,
                         batch.global_batch_size)
    if batch.num_rollout is None and batch.num_epoch is None:
        raise ValueError("set --num-rollout (rollouts to run) or --num-epoch (epochs over the prompt data)")
    if batch.num_rollout is not None and batch.num_epoch is not None:
        raise ValueError(f"--num-rollout {batch.num_rollout} and --num-epoch {batch.num_epoch} both set the "
                         "loop's length; give one (--num-epoch N runs N x ceil(prompts / rollout_batch_size))")
    if not batch.use_dynamic_batch_size and batch.micro_batch_size > gbs:
        raise ValueError(f"--micro-batch-size {batch.micro_batch_size} is larger than the global batch "
                         f"({gbs} samples per optimizer step); choose at most {gbs}")
    if batch.use_dynamic_batch_size and batch.max_tokens_per_gpu is None:
        raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget per micro-batch)")


def check_reward(reward: RewardConfig) -> None:
    refuse_unbuilt(reward.rm_type)


IFBENCH_REFUSED = (
    "rm_type 'ifbench' is not built in: slime's scorer runs allenai/IFBench's instruction checkers "
    "(evaluation_lib), which it clones from GitHub at import; they are not a PyPI package (only their dependencies "
    "are) and need spaCy and NLTK data downloads. Score IFBench with --custom-rm-path and IFBench installed")


def refuse_unbuilt(rm_type: str | None, flag: str = "--rm-type") -> None:
    """Raise, naming `flag` and the reason, for an rm_type slime has that is not built here (ifbench)."""
    if rm_type and rm_type.strip().removeprefix("boxed_") == "ifbench":
        raise ValueError(f"{flag} {rm_type}: {IFBENCH_REFUSED}")


def check_algorithm(algorithm: AlgorithmConfig) -> None:
    a = algorithm
    if a.kl_coef and a.kl_loss_coef:
        raise ValueError(
            f"--kl-coef {a.kl_coef} and --kl-loss-coef {a.kl_loss_coef} are both non-zero; "
            "slime allows only one: the KL goes into the reward (kl_coef) or into the loss (kl_loss_coef)"
        )
    if a.use_rollout_logprobs and a.use_tis:
        raise ValueError("--use-rollout-logprobs and --use-tis together: with the engine's log-probs as the old "
                         "policy's there is nothing left to correct (slime refuses it too); give one")
    if a.tis_clip_low > a.tis_clip:
        raise ValueError(f"--tis-clip-low {a.tis_clip_low} is above --tis-clip {a.tis_clip}; "
                         "the TIS weight is clipped to [tis_clip_low, tis_clip]")
    if a.use_opd and a.opd_type is None:
        raise ValueError("--use-opd needs --opd-type: sglang (the samples' teacher_log_probs, from a teacher "
                         "server) or megatron (a teacher model from --opd-teacher-load, run by the trainer)")
    if a.use_opd and a.opd_type == "megatron" and a.opd_teacher_load is None:
        raise ValueError("--opd-type megatron needs --opd-teacher-load: the teacher's torch_dist checkpoint")
    if a.opd_teacher_load is not None and not (a.use_opd and a.opd_type == "megatron"):
        raise ValueError(f"--opd-teacher-load {a.opd_teacher_load} is read only with --use-opd --opd-type "
                         "megatron (with sglang the teacher's log-probs come with the samples): remove it or add "
                         "those")
    if a.loss_type == "custom_loss" and a.custom_loss_function_path is None:
        raise ValueError("--loss-type custom_loss needs --custom-loss-function-path module:function")
    if a.disable_compute_advantages_and_returns:
        needs = [flag for flag, given in (("--loss-type policy_loss", a.loss_type == "policy_loss"),
                                          ("--use-kl-loss", a.use_kl_loss), ("--kl-coef", a.kl_coef > 0),
                                          ("--use-opd", a.use_opd)) if given]
        if needs:
            raise ValueError(f"--disable-compute-advantages-and-returns with {', '.join(needs)}: these read the "
                             "advantages or the reference/teacher log-probs it skips; use --loss-type sft_loss (or a "
                             "custom loss that needs none of them), or drop the flag")


def check_optimizer(optimizer: OptimizerConfig) -> None:
    """Megatron-LM's rule: the warm-up is given in steps or as a fraction, not both."""
    if optimizer.lr_warmup_fraction is not None and optimizer.lr_warmup_iters:
        raise ValueError(f"--lr-warmup-fraction {optimizer.lr_warmup_fraction} with --lr-warmup-iters "
                         f"{optimizer.lr_warmup_iters}: give the warm-up one way; drop one of them")


def check_placement(placement: PlacementConfig) -> None:
    devices, per_engine = placement.rollout_num_gpus, placement.rollout_num_gpus_per_engine
    if devices is not None and devices % per_engine:
        source = " (the training devices, with --colocate)" if placement.colocate else ""
        raise ValueError(f"--rollout-num-gpus {devices}{source} is not a multiple of --rollout-num-gpus-per-engine "
                         f"{per_engine}: {devices % per_engine} device(s) would serve no engine; make it a "
                         "multiple")


def check_debug(debug: DebugConfig) -> None:
    problems = [p for flag, path in (("--save-debug-rollout-data", debug.save_debug_rollout_data),
                                     ("--load-debug-rollout-data", debug.load_debug_rollout_data))
                if path is not None for p in _path_template_problems(flag, path)]
    if debug.save_debug_rollout_data is not None and "{rollout_id}" not in debug.save_debug_rollout_data:
        problems.append(f"--save-debug-rollout-data {debug.save_debug_rollout_data} has no {{rollout_id}}: every "
                        "rollout would overwrite one file; put {rollout_id} in it, e.g. "
                        "/tmp/debug/rollout_{rollout_id}.pt")
    if debug.debug_rollout_only and (debug.debug_train_only or debug.load_debug_rollout_data is not None):
        given = "--debug-train-only" if debug.debug_train_only else "--load-debug-rollout-data (which implies it)"
        problems.append(f"--debug-rollout-only and {given} are both set: the one runs no trainer, the other no "
                        "engine; choose one (as slime refuses the pair)")
    if problems:
        raise ValueError("; ".join(problems))


def _path_template_problems(flag: str, path: str) -> list[str]:
    """A debug-data path is local and takes only the {rollout_id} placeholder (slime formats it so)."""
    if "://" in path:
        return [f"{flag} {path}: give a local path (or a shared file system's); URIs are not read or written here"]
    try:
        path.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as err:
        return [f"{flag} {path}: its only placeholder may be {{rollout_id}} ({type(err).__name__}: {err}); write a "
                "literal brace as {{ or }}"]
    return []


def check_logging(logging: LoggingConfig) -> None:
    if logging.use_wandb and logging.wandb_mode != "disabled" and not (logging.wandb_project and logging.wandb_group):
        raise ValueError("--use-wandb needs --wandb-project and --wandb-group (the run is named after the group)")


# ---- across groups: TrainConfig's model validator ------------------------------------------------------------------

def check_train(config: TrainConfig) -> None:
    """Every check that reads more than one group."""
    over = config.rollout.over_sampling_batch_size
    if over is not None and over < config.batch.rollout_batch_size:
        raise ValueError(
            f"--over-sampling-batch-size {over} is smaller than --rollout-batch-size "
            f"{config.batch.rollout_batch_size}; it must be >= rollout_batch_size (or left unset)"
        )
    ranks = config.placement.actor_num_nodes * config.placement.actor_num_gpus_per_node
    share = config.batch.global_batch_size // ranks  # the batch's defaults have set global_batch_size
    if ranks > 1 and not config.batch.use_dynamic_batch_size and config.batch.micro_batch_size > share:
        raise ValueError(
            f"--micro-batch-size {config.batch.micro_batch_size} is larger than a data-parallel rank's share of the "
            f"global batch ({config.batch.global_batch_size} samples over {ranks} ranks = {share}); choose at most "
            f"{max(share, 1)}")
    check_async(config)
    check_fault_tolerance(config)
    check_train_hooks(config)
    check_train_only(config)
    check_loss_mask_type(config)


def check_loss_mask_type(config: TrainConfig) -> None:
    """--loss-mask-type is read by a rollout function that tokenizes conversations (slime's SFT rollout); slimeflow's
    own rollout generates responses and reads none."""
    if config.data.loss_mask_type != "qwen" and config.rollout.rollout_function_path is None:
        raise ValueError(f"--loss-mask-type {config.data.loss_mask_type} is read by a rollout function that "
                         "tokenizes conversations (--rollout-function-path slime.rollout.sft_rollout.generate_rollout); "
                         "slimeflow's own rollout masks no chat template: give that function, or drop the flag")


def check_train_only(config: TrainConfig) -> None:
    """--debug-train-only trains on rollouts that need no engine: saved ones, or a rollout function's that makes
    them from the data alone (slime's SFT scripts)."""
    debug = config.debug
    if (debug.debug_train_only and debug.load_debug_rollout_data is None
            and config.rollout.rollout_function_path is None):
        raise ValueError("--debug-train-only needs the rollouts to train on without an engine: "
                         "--load-debug-rollout-data PATH (written by a run with --save-debug-rollout-data PATH), or "
                         "--rollout-function-path F, a function that makes them from --prompt-data without an engine "
                         "(slime's SFT: slime.rollout.sft_rollout.generate_rollout); give one, or drop "
                         "--debug-train-only")


def check_train_hooks(config: TrainConfig) -> None:
    """slime's Megatron-actor hooks need the Megatron backend (the torch backend has no megatron model, optimizer or
    schedule to hand them); the post-write hook needs a disk weight sync."""
    hooks = config.train_hooks
    problems = []
    if config.placement.train_backend == "torch":
        problems += [f"--{name.replace('_', '-')} is a hook into slime's Megatron actor (it is handed megatron's model "
                     "chunks, optimizer or parallel state): use --train-backend megatron" for name in
                     hooks.MEGATRON_ONLY if getattr(hooks, name) is not None]
    external = config.placement.rollout_external_engine_addrs or config.sglang.args.get("worker_urls")
    disk = config.weight_sync.update_weight_transport == "disk" or (
        external and config.weight_sync.update_weight_transport is None)
    if config.weight_sync.custom_update_weight_post_write_path is not None and not disk:
        problems.append("--custom-update-weight-post-write-path runs after a disk weight sync writes its files; this "
                        "run pushes weights to embedded engines over HTTP or nccl: use it with external SGLang servers "
                        "(--sglang-worker-urls, --sglang-weights-dir)")
    if problems:
        raise ValueError("; ".join(problems))


def check_fault_tolerance(config: TrainConfig) -> None:
    """--use-fault-tolerance restarts engines this run started and gives the restarted one the trainer's weights
    (fault_tolerance.restore_weights): what it cannot restart is refused with the reason."""
    if not config.fault_tolerance.use_fault_tolerance:
        return
    placement = config.placement
    refused = {
        "--rollout-external-engine-addrs / --sglang-worker-urls": (
            bool(placement.rollout_external_engine_addrs or config.sglang.args.get("worker_urls")),
            "servers started elsewhere cannot be restarted by this run"),
        "--offload-rollout (colocated)": (
            placement.offload_rollout,
            "the engines release their memory while the trainer trains, so a health check then would find them "
            "unable to generate; run fault-tolerant engines disaggregated"),
        "--engine-in-process": (
            placement.engine_in_process and "engine_in_process" in placement.model_fields_set,
            "an engine serving from a thread of the rollout manager cannot be killed and restarted; leave it out "
            "(fault-tolerant engines run as processes)"),
    }
    problems = [f"--use-fault-tolerance with {flag}: {reason}" for flag, (given, reason) in refused.items() if given]
    if problems:
        raise ValueError("; ".join(problems))


def check_async(config: TrainConfig) -> None:
    """--async and its flags: what the asynchronous loop cannot do is refused with the reason (slime's where it has
    one)."""
    placement, bound = config.placement, config.algorithm.max_staleness
    if not placement.async_:
        needs = {"--max-staleness": (bound, "the synchronous loop generates each rollout with the weights it last "
                                            "pushed, so its staleness is bounded by --update-weights-interval alone"),
                 "--async-buffer-size": (None if placement.async_buffer_size == 1 else placement.async_buffer_size,
                                         "only the asynchronous loop generates rollouts ahead of training")}
        problems = [f"{flag} {value} needs --async ({reason})" for flag, (value, reason) in needs.items()
                    if value is not None]
    else:
        refused = {
            "--colocate": (placement.colocate, "slime refuses it too ('Colocation is not supported for async "
                           "training'): colocated engines and trainer share the devices, so generation cannot overlap "
                           "training"),
            "--debug-rollout-only": (config.debug.debug_rollout_only, "there is no trainer to overlap generation with"),
            "--debug-train-only": (config.debug.debug_train_only, "there is no engine to overlap training with"),
            "--offload-train/--offload-rollout": ((placement.offload_train or placement.offload_rollout)
                                                  and not placement.colocate,  # else refused as --colocate
                                                  "the trainer and the engines compute at once, so neither can give its "
                                                  "memory to the other; leave offload to colocated runs"),
        }
        problems = [f"--async with {flag}: {reason}" for flag, (given, reason) in refused.items() if given]
        ahead = loop_staleness(config)
        if bound is not None and ahead > bound:
            problems.append(f"--update-weights-interval {config.weight_sync.update_weights_interval} with "
                            f"--async-buffer-size {placement.async_buffer_size} lets the async loop train on samples up "
                            f"to {ahead} policy versions old (interval + buffer size - 1), more than --max-staleness "
                            f"{bound}; lower either or raise --max-staleness")
    if problems:
        raise ValueError("; ".join(problems))


def loop_staleness(config: TrainConfig) -> int:
    """The most policy versions the async loop's own rollouts lag the trainer: rollout k is asked for while rollout
    k - N trains (N = --async-buffer-size), from the weights pushed last, at most interval - 1 rollouts earlier."""
    return config.placement.async_buffer_size + config.weight_sync.update_weights_interval - 1


# ---- start-up checks of the config alone, run by the train stage (lists of problems, notes) -------------------------

def slime_megatron_differences(config: TrainConfig | None) -> list[str]:
    """Where this run's Megatron backend departs from slime's with the same flags: slime's Megatron backend always
    trains bf16 (`args.bf16 = not args.fp16`) with the distributed optimizer (`args.use_distributed_optimizer =
    True`, slime/backends/megatron_utils/arguments.py), so its scripts pass neither; here both are flags (the CPU
    default, fp32 and the plain optimizer, is what the equivalence tests check)."""
    if config is None or config.placement.train_backend != "megatron":
        return []
    missing = [flag for flag, given in (("--bf16", config.optimizer.bf16),
                                        ("--use-distributed-optimizer", config.megatron.use_distributed_optimizer))
               if not given]
    if not missing:
        return []
    what = {"--bf16": "bf16 (bf16 weights, fp32 main parameters)",
            "--use-distributed-optimizer": "the distributed optimizer (optimizer state sharded over data-parallel ranks)"}
    return [f"slime's Megatron backend always trains with {' and '.join(what[flag] for flag in missing)}: slime sets "
            f"them itself, so its scripts do not pass {' '.join(missing)}; this run trains without them (add "
            f"{' '.join(missing)} for slime's numerics and memory)"]


def megatron_layout_problems(config: TrainConfig) -> list[str]:
    """--train-backend megatron: the reference model the KL needs, the rank count against TP x PP, and the parallel
    layouts the backend does not build (checked at start-up: --ref-load may come from a pipeline's convert stage)."""
    problems = []
    ckpt, placement, m = config.checkpoint, config.placement, config.megatron
    if config.algorithm.needs_reference and ckpt.ref_load is None:
        problems.append("--use-kl-loss / --kl-coef with --train-backend megatron need --ref-load (the reference "
                        "model's torch_dist checkpoint)")
    ranks = placement.actor_num_nodes * placement.actor_num_gpus_per_node
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
    if ranks % model_parallel:
        problems.append(f"{ranks} training ranks (--actor-num-nodes x --actor-num-gpus-per-node) are not a multiple "
                        f"of --tensor-model-parallel-size x --pipeline-model-parallel-size = {model_parallel}")
    return problems + _parallel_problems(config)


def _parallel_problems(config: TrainConfig) -> list[str]:
    """The virtual pipeline and expert parallel settings the Megatron backend cannot run."""
    m, problems = config.megatron, []
    ranks = config.placement.actor_num_nodes * config.placement.actor_num_gpus_per_node
    if m.num_layers_per_virtual_pipeline_stage is not None and m.pipeline_model_parallel_size == 1:
        problems.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 (it "
                        "interleaves pipeline stages); drop it or raise the pipeline size")
    if m.num_layers_per_virtual_pipeline_stage is not None and m.num_layers is not None and \
            m.num_layers % (m.pipeline_model_parallel_size * m.num_layers_per_virtual_pipeline_stage):
        problems.append(f"--num-layers-per-virtual-pipeline-stage {m.num_layers_per_virtual_pipeline_stage}: "
                        f"--num-layers {m.num_layers} does not split into --pipeline-model-parallel-size "
                        f"{m.pipeline_model_parallel_size} x stages of that many layers")
    tp, ep, etp = m.tensor_model_parallel_size, m.expert_model_parallel_size, m.expert_tensor_parallel_size
    if etp not in (None, 1, tp):
        problems.append(f"--expert-tensor-parallel-size {etp}: the Megatron backend splits experts over the "
                        f"tensor-parallel ranks as the rest of the model ({tp}, the default) or not at all (1); other "
                        f"sizes are not built (unverified against a one-process run): use 1 or {tp}")
    etp = tp if etp is None else etp
    if ep > 1 and ranks % (ep * etp * m.pipeline_model_parallel_size):
        problems.append(f"{ranks} training ranks are not a multiple of --expert-model-parallel-size {ep} x "
                        f"--expert-tensor-parallel-size {etp} x --pipeline-model-parallel-size "
                        f"{m.pipeline_model_parallel_size}")
    if tp > 1 and (ep > 1 or m.num_experts or m.multi_latent_attention) and not m.sequence_parallel:
        problems.append(f"an MoE model or multi-latent attention at --tensor-model-parallel-size {tp} trains with "
                        "--sequence-parallel only (megatron-core's MoE layer raises when it trains tensor-parallel "
                        "without it; MLA's RoPE key gets a partial gradient on each rank); add --sequence-parallel")
    if m.moe_token_dispatcher_type == "flex":
        problems.append("--moe-token-dispatcher-type flex: DeepEP / HybridEP dispatch (GPU kernels) is not built; "
                        "use allgather or alltoall")
    return problems


def unbuilt_problems(config: TrainConfig) -> list[str]:
    """What the flags ask for that this version does not build (refused when a run starts: the evaluate stage builds
    a TrainConfig for its rollouts, which never trains)."""
    if config.algorithm.advantage_estimator == "ppo":  # the library computes GAE from values no run produces yet
        return ["--advantage-estimator ppo needs a critic's values (slime's --use-critic), which this version "
                "does not train; use grpo, gspo, cispo, reinforce_plus_plus or reinforce_plus_plus_baseline"]
    return []


def data_source_problems(config: TrainConfig) -> list[str]:
    """--data-source-path: the loop's length must be given (slime counts len(data_source) // rollout_batch_size per
    epoch; the run does not construct the class before it starts)."""
    if config.batch.num_rollout is None:
        return [f"--num-epoch with --data-source-path {config.data.data_source_path}: the run does not "
                "count a custom data source's prompts before it starts; give --num-rollout instead"]
    return []


def external_engine_problems(config: TrainConfig) -> list[str]:
    """SGLang servers started elsewhere: named once, with a directory for the weights, and a router of the user's
    only in front of them."""
    placement, sglang, problems = config.placement, config.sglang, []
    external = placement.rollout_external_engine_addrs or sglang.args.get("worker_urls")
    if placement.rollout_external_engine_addrs and sglang.args.get("worker_urls"):
        problems.append("--rollout-external-engine-addrs and --sglang-worker-urls both name external servers; give "
                        "one (slime spells it --rollout-external-engine-addrs)")
    if external and not sglang.args.get("weights_dir") and not config.debug.debug_rollout_only:
        problems.append("external SGLang servers need --sglang-weights-dir DIR: a directory every server can read, "
                        "where the trainer writes the weights it pushes")
    given_router = sglang.args.get("router_ip") is not None or sglang.args.get("router_port") is not None
    if given_router and not external:
        problems.append("--sglang-router-ip/--sglang-router-port name a router of yours, but the engines are launched "
                        "here and registering them with an outside router is not supported yet; drop them (slimeflow "
                        "starts its own router) or start the servers yourself (--rollout-external-engine-addrs)")
    return problems
