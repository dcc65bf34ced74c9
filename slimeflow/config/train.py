"""The training stage's config: a tree of small groups whose field names are slime's flags in snake_case.

`--rollout-batch-size 32` sets `TrainConfig.batch.rollout_batch_size`; every leaf name is unique across the tree,
so a slime flag list maps onto it flag for flag (slimeflow.config.flags). Functions take the group they use.
It lives with the shared configs, not in the train stage, because the rollout library reads it too (the evaluate
stage builds one for its rollouts). The rollout-side groups are declared in train_rollout.py; what the flags may be
together, and the defaults that follow from other flags, are in train_validation.py (each group's model validator
calls its check there, TrainConfig's calls check_train).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, ModelWrapValidatorHandler, PrivateAttr, model_validator

from slimeflow.config import train_validation as checks
from slimeflow.config.base import ConfigModel, OptionalPositiveInt, PluginPath, PositiveInt, validate_derived
from slimeflow.config.custom_config import custom_config_record, read_custom_config
from slimeflow.config.flags import FlagIndex, merge
from slimeflow.config.megatron import MegatronConfig
from slimeflow.config.megatron_roles import actor_overrides
from slimeflow.config.train_rollout import DataConfig, EvalConfig, RewardConfig, RolloutConfig, SglangConfig
from slimeflow.errors import ConfigError

__all__ = [
    "AlgorithmConfig", "BatchConfig", "CheckpointConfig", "DataConfig", "DebugConfig", "EvalConfig",
    "FaultToleranceConfig", "LoggingConfig", "OptimizerConfig", "PlacementConfig", "RewardConfig", "RolloutConfig",
    "SglangConfig", "TrainConfig", "TrainHooksConfig", "WeightSyncConfig", "staleness_bound",
]


class BatchConfig(ConfigModel):
    """Batch accounting: rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout."""

    rollout_batch_size: PositiveInt
    """Prompts per rollout (required, as in slime)."""
    n_samples_per_prompt: PositiveInt = 1
    """Responses generated per prompt (the GRPO group size)."""
    global_batch_size: OptionalPositiveInt = None
    """Samples per optimizer step; derived from num_steps_per_rollout when that is given."""
    num_steps_per_rollout: OptionalPositiveInt = None
    """Optimizer steps per rollout; default 1 (on-policy) when global_batch_size is not given either."""
    num_rollout: OptionalPositiveInt = None
    """Rollouts to run (the loop's length)."""
    num_epoch: OptionalPositiveInt = None
    """Epochs over the prompt data; used only when num_rollout is not set."""
    micro_batch_size: PositiveInt = 1
    """Samples per micro-batch; ignored with use_dynamic_batch_size."""
    use_dynamic_batch_size: bool = False
    """Pack samples into micro-batches of up to max_tokens_per_gpu tokens."""
    max_tokens_per_gpu: OptionalPositiveInt = None
    """Token budget of one packed micro-batch (a longer sample gets a micro-batch of its own)."""
    balance_data: bool = False
    """Balance tokens across data-parallel ranks."""

    @model_validator(mode="wrap")
    @classmethod
    def _defaults(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        return validate_derived(handler, data, checks.batch_defaults(cls, data))

    @model_validator(mode="after")
    def _check(self) -> BatchConfig:
        checks.check_batch(self)
        return self


class AlgorithmConfig(ConfigModel):
    """Advantage estimation and the policy loss."""

    advantage_estimator: Literal[
        "grpo", "gspo", "cispo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"
    ] = "grpo"
    """Advantage estimator."""
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = "policy_loss"
    """Policy-gradient loss, supervised loss, or custom_loss_function_path."""
    eps_clip: float = Field(0.2, ge=0)
    """Lower clip range of the ratio: 1 - eps_clip."""
    eps_clip_high: float | None = Field(None, ge=0)
    """Upper clip range of the ratio: 1 + eps_clip_high (defaults to eps_clip)."""
    eps_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant (> 1) for negative advantages."""
    use_kl_loss: bool = False
    """Load the reference model and compute the KL against it."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL loss (0: KL is only reported)."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    """KL estimator."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty folded into the reward (REINFORCE++, PPO)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    calculate_per_token_loss: bool = False
    """Average over all tokens of the batch instead of per sample."""
    max_staleness: OptionalPositiveInt = None
    """With --async: the most policy versions a trained token may lag the trainer (default: the loop's own bound,
    --update-weights-interval + --async-buffer-size - 1, one more with --partial-rollout unless the continued samples'
    earlier tokens are masked); a config whose loop could exceed it is refused, a buffered partial sample that would
    exceed it is generated again from its prompt, and a sample over it stops the run."""
    use_tis: bool = False
    """Truncated importance sampling between the rollout engine's and the trainer's probabilities."""
    tis_clip: float = Field(2.0, gt=0)
    """Upper clip of the TIS weight."""
    tis_clip_low: float = Field(0.0, ge=0)
    """Lower clip of the TIS weight (slime's default 0: no lower clip)."""
    use_rollout_logprobs: bool = False
    """The rollout engine's log-probs are the old policy's (PPO ratio, KL shaping); the trainer does not recompute
    them (unless --get-mismatch-metrics)."""
    get_mismatch_metrics: bool = False
    """Report trainer/engine mismatch metrics (tis, tis_clipfrac, tis_abs, ois) without --use-tis; the loss is
    only reweighted with --use-tis (slime refuses this flag without --custom-tis-function-path)."""
    disable_grpo_std_normalization: bool = False
    """Subtract the group mean only."""
    disable_compute_advantages_and_returns: bool = False
    """Compute no advantages, nor the old, reference or teacher log-probs they read (slime's SFT scripts): for
    --loss-type sft_loss or a custom loss that needs none of them."""
    normalize_advantages: bool = False
    """Whiten advantages over the batch."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount (REINFORCE++, PPO)."""
    lambd: float = Field(1.0, ge=0, le=1)
    """GAE lambda (PPO)."""
    custom_loss_function_path: PluginPath = None
    """A custom loss (with loss_type custom_loss)."""
    custom_advantage_function_path: PluginPath = None
    """A custom advantage estimator."""
    custom_convert_samples_to_train_data_path: PluginPath = None
    """convert(args, samples) -> dict (tokens, response_lengths, rewards, loss_masks[, rollout_log_probs]), the
    train data in slime's form; its rewards are taken as they are (slime's contract)."""
    custom_tis_function_path: PluginPath = None
    """slime's TIS contract, fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
    response_lengths) -> (pg_loss reweighted, loss masks (tokens rejected: 0), metrics), called in the policy loss
    with --use-tis or --get-mismatch-metrics instead of the vanilla TIS (`args`: slime's args of the run, every flag
    and --custom-config-path's keys, as slime's mis.py reads them)."""
    custom_pg_loss_reducer_function_path: PluginPath = None
    """slime's get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) ->
    reduce(pg_loss) -> the micro-batch's sum (default: each sample's masked mean, summed), in place of the default
    reduction of pg_loss (e.g. Dr.GRPO's constant divisor); the loss is that sum over the global batch's sample (or
    token) count, and the other metrics keep the default, as slime."""
    custom_reward_post_process_path: PluginPath = None
    """post_process(args, samples) -> (raw_rewards, rewards), on the rollout's samples (slime's contract); the
    estimators then take `rewards` as they are (no group normalisation, as in slime)."""
    use_opd: bool = False
    """On-policy distillation (slime's OPD): every response token's advantage gets -opd_kl_coef x (log pi_old -
    log pi_teacher), the reverse KL to a teacher, on top of any estimator (before --normalize-advantages)."""
    opd_type: Literal["sglang", "megatron"] | None = None
    """Where the teacher's log-probs come from: "sglang", the samples' teacher_log_probs (set by a reward
    post-process from a teacher server, as slime's on_policy_distillation plug-in does); "megatron", a teacher model
    loaded from --opd-teacher-load and run by the trainer (the torch backend)."""
    opd_kl_coef: float = Field(1.0, ge=0)
    """Weight of the reverse KL to the teacher in the advantages."""
    opd_teacher_load: str | None = None
    """The teacher's torch_dist checkpoint (a root, iter_XXXXXXX/ or release/), for --opd-type megatron; the
    teacher has the policy's architecture (HF config of --hf-checkpoint)."""

    @property
    def needs_reference(self) -> bool:
        """The KL loss or a KL-penalised reward needs the reference model's log-probs."""
        return self.use_kl_loss or self.kl_coef > 0

    @property
    def needs_teacher(self) -> bool:
        """On-policy distillation with the teacher run by the trainer (--opd-type megatron)."""
        return self.use_opd and self.opd_type == "megatron"

    @model_validator(mode="wrap")
    @classmethod
    def _defaults(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        return validate_derived(handler, data, checks.algorithm_defaults(cls, data))

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        checks.check_algorithm(self)
        return self


class OptimizerConfig(ConfigModel):
    """The optimizer and its schedule."""

    optimizer: Literal["adam"] = "adam"
    """Optimizer (AdamW)."""
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(0.0, ge=0)
    """Floor of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up."""
    lr_warmup_iters: int = Field(0, ge=0)
    """Linear warm-up steps."""
    lr_warmup_fraction: float | None = Field(None, ge=0, lt=1)
    """Linear warm-up as a fraction of the decay steps (Megatron-LM's; instead of --lr-warmup-iters)."""
    lr_decay_iters: OptionalPositiveInt = None
    """Steps over which the learning rate decays (default: the whole run)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """Adam beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """Adam beta2."""
    adam_eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    clip_grad: float = Field(1.0, ge=0)
    """Gradient-norm clip (0 disables it)."""
    bf16: bool = False
    """Train in bfloat16 (fp32 otherwise)."""

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        checks.check_optimizer(self)
        return self


class CheckpointConfig(ConfigModel):
    """Where the model comes from and where checkpoints go (slime's CKPT_ARGS)."""

    hf_checkpoint: str | None = None
    """HF model directory: tokenizer and config source (and the weights for the torch backend). Alone, the train
    stage also takes what the model stage does (a tiny spec, a GGUF file, an s3:// URI) and resolves it the same way."""
    ref_load: str | None = None
    """torch_dist checkpoint of the reference model."""
    load: str | None = None
    """Actor checkpoint root; falls back to ref_load when empty or holding no valid checkpoint."""
    save: str | None = None
    """Checkpoint root the actor saves to."""
    save_interval: OptionalPositiveInt = None
    """Save every this many rollouts."""
    async_save: bool = False
    """Write, hash, fsync and commit each checkpoint in a background thread while training goes on: the save blocks
    only while it copies what it writes (the torch backend: weights and optimizer state into host buffers, the
    checkpoint's size in host memory; the Megatron backend: every rank's shards written, the hashing and commit in
    the background). The tracker still moves only once the checkpoint is on disk; the next save, the end of the run
    and its stop wait for the commit, and a failed commit is raised there."""
    start_rollout_id: int | None = Field(None, ge=0)
    """Override the rollout id to start from (default: from the loaded checkpoint)."""


class PlacementConfig(ConfigModel):
    """Devices for training and rollout, and which training backend runs."""

    train_backend: Literal["torch", "megatron"] = "torch"
    """torch (transformers + AdamW; CPU or GPU) or megatron (megatron-core)."""
    actor_num_nodes: PositiveInt = 1
    """Training nodes."""
    actor_num_gpus_per_node: PositiveInt = 1
    """Training devices per node (data-parallel ranks on CPU)."""
    rollout_num_gpus: OptionalPositiveInt = None
    """Devices for rollout engines (ignored with colocate)."""
    rollout_num_gpus_per_engine: PositiveInt = 1
    """Devices per engine (SGLang tp_size)."""
    colocate: bool = False
    """Share devices between training and rollout (turns --offload-train and --offload-rollout on, as slime)."""
    offload: bool = False
    """--offload-train and --offload-rollout together."""
    offload_train: bool | None = None
    """Move the trainer's weights, gradients and optimizer state off its devices while the engines generate (to host
    memory on a GPU, to a file in the run's scratch on a CPU). Default: on with --colocate."""
    offload_rollout: bool | None = None
    """The engines release their weights and KV cache while the trainer trains (SGLang's memory saver) and take
    the new weights back before the next rollout. Default: on with --colocate."""
    num_gpus_per_node: PositiveInt = 8
    """GPUs of each node (logical GPUs on a CPU cluster): an engine's GPUs are on one node."""
    rollout_external_engine_addrs: list[str] | None = None
    """SGLang servers started elsewhere (host:port or http://host:port), used instead of launching engines."""
    async_: bool = False
    """slime's train_async.py loop: rollout k+1 is generated while the trainer trains on rollout k (needs
    the engines on devices of their own: refused with --colocate); on a CPU the engine then defaults to a process of
    its own."""
    async_buffer_size: PositiveInt = 1
    """With --async: rollouts generated ahead of the one being trained (1: slime's train_async.py, rollout k+1 while
    training on k; N: k+1..k+N, so the samples may lag the trainer by up to N + --update-weights-interval - 1
    versions)."""
    engine_in_process: bool = True
    """One embedded engine is served from a thread of the RolloutManager's process (no process of its own, which
    saves its interpreter's imports: 2-3 CPU seconds of start-up); false gives it its own process, for a rollout
    function that keeps Python busy while the engine decodes (they would share one GIL). Two or more embedded
    engines always run as processes."""

    @model_validator(mode="wrap")
    @classmethod
    def _defaults(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        return validate_derived(handler, data, checks.placement_defaults(cls, data))

    @model_validator(mode="after")
    def _check(self) -> PlacementConfig:
        checks.check_placement(self)
        return self


class WeightSyncConfig(ConfigModel):
    """How and how often the trainer's weights reach the engines (engines.WeightSync)."""

    update_weights_interval: PositiveInt = 1
    """Push the weights every this many rollouts; the rollouts between pushes are generated by the last pushed
    weights (and checked against that version)."""
    update_weight_buffer_size: PositiveInt = 512 * 1024**2
    """Bytes per weight-update bucket (a larger tensor goes alone)."""
    update_weight_transport: Literal["nccl", "disk", "http", "shared_memory"] | None = None
    """nccl: broadcast in a process group of trainer rank 0 and the engines (gloo on CPU); disk: through
    --sglang-weights-dir; http (embedded engines): safetensors bodies to /update_weights_from_tensor; shared_memory
    (embedded engines on trainer rank 0's host): a /dev/shm segment they serve from. Default: shared_memory for
    embedded engines on trainer rank 0's Ray node (colocated or not; http when /dev/shm has no room), http for
    embedded engines elsewhere, SGLang's /update_weights_from_tensor body of IPC handles to colocated SGLang servers
    (as slime), disk for external ones. The trainer logs its choice and why."""
    custom_update_weight_post_write_path: PluginPath = None
    """hook(args, version_dir, rollout_engines), slime's post-write hook of the disk weight sync: called after a
    version's files are written to --sglang-weights-dir, before the engines load them (e.g. to publish the files on an
    object-store-backed filesystem). rollout_engines: the engines' URLs (slime's are Ray actor handles). Rank 0 writes
    the gathered weights, so it runs there once per push. Needs the disk transport (external servers)."""


class TrainHooksConfig(ConfigModel):
    """slime's hooks into its Megatron actor (slimeflow/train/train_hooks.py), called at the same points of a training
    step, with slime's `args` (every train flag by its slime name, and the checkpoint's Megatron args)."""

    custom_megatron_init_path: PluginPath = None
    """custom_init(args), once per rank after megatron's parallel state is set up, before the model is built
    (--train-backend megatron)."""
    custom_megatron_before_log_prob_hook_path: PluginPath = None
    """hook(args, model, store_prefix) before each log-prob pass: model is the list of model chunks it scores with;
    store_prefix "" (the policy), "ref_" (the reference model), "teacher_" (the OPD teacher) (--train-backend
    megatron)."""
    custom_megatron_before_train_step_hook_path: PluginPath = None
    """hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) before each optimizer step's
    forward/backward, gradients zeroed (--train-backend megatron)."""
    custom_model_provider_path: PluginPath = None
    """provider(pre_process, post_process[, vp_stage]) -> GPTModel, called for every model chunk (policy, reference,
    teacher) instead of the family spec's builder; its weights are then loaded from the checkpoint. megatron-core has
    no megatron.training.get_args(): a provider that takes an `args` keyword gets slime's args there
    (--train-backend megatron)."""
    rollout_data_postprocess_path: PluginPath = None
    """postprocess(args, rollout_id, rollout_data), after the log-probs and advantages, before training: rollout_data
    holds this rank's samples in slime's keys (tokens, response_lengths, total_lengths, loss_masks, rewards,
    advantages, returns, log_probs, ref_log_probs, rollout_log_probs, teacher_log_probs); what it writes to
    advantages, log_probs, ref_log_probs and loss_masks is trained on (both backends)."""

    MEGATRON_ONLY: ClassVar[tuple[str, ...]] = ("custom_megatron_init_path", "custom_megatron_before_log_prob_hook_path",
                                                "custom_megatron_before_train_step_hook_path",
                                                "custom_model_provider_path")


class FaultToleranceConfig(ConfigModel):
    """Engine health checks while the RolloutManager generates or evaluates (fault_tolerance.HealthMonitor): each
    engine's /health_generate every `rollout_health_check_interval` s, after `rollout_health_check_first_wait` s. An
    engine that does not answer within `rollout_health_check_timeout` s is dead or hung: with --use-fault-tolerance it
    is restarted in place with the current weights and its requests re-issued; without, it is killed and the
    rollout ends with an error naming it."""

    use_fault_tolerance: bool = False
    """Restart a dead or hung engine this run started instead of ending the run; it gets the weights the trainer
    last pushed (trainer rank 0 keeps a host copy of them), or a live embedded peer's copy."""
    rollout_health_check_interval: float = Field(30.0, gt=0)
    """Seconds between two health checks of an engine."""
    rollout_health_check_timeout: float = Field(30.0, gt=0)
    """Seconds an engine has to answer /health_generate before it counts as dead or hung."""
    rollout_health_check_first_wait: float = Field(0.0, ge=0)
    """Seconds after a rollout starts before the first health check."""


class DebugConfig(ConfigModel):
    """slime's debug modes: rollouts without a trainer, or training on saved rollouts without an engine."""

    debug_rollout_only: bool = False
    """Generate and score rollouts but create no trainer: no training, checkpoints or weight updates (the engines
    keep --hf-checkpoint's weights); for testing rollout and reward plug-ins."""
    debug_train_only: bool = False
    """Train without an engine on the rollouts of --load-debug-rollout-data, or on those --rollout-function-path
    makes from the data without one (slime's SFT: slime.rollout.sft_rollout.generate_rollout); evaluation is
    skipped."""
    save_debug_rollout_data: str | None = None
    """Write each rollout's samples to this path, `{rollout_id}` replaced by the rollout id (e.g.
    /tmp/debug/rollout_{rollout_id}.pt): torch.save of plain lists and numbers, read back with weights_only."""
    load_debug_rollout_data: str | None = None
    """Train on the samples saved at this path (`{rollout_id}` as above) instead of generating them; implies
    --debug-train-only, as in slime."""

    @model_validator(mode="wrap")
    @classmethod
    def _defaults(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        return validate_derived(handler, data, checks.debug_defaults(cls, data))

    @model_validator(mode="after")
    def _check(self) -> DebugConfig:
        checks.check_debug(self)
        return self


class LoggingConfig(ConfigModel):
    """Metric sinks beside MLflow, as slime has them: Weights & Biases and TensorBoard, the same metric names."""

    use_wandb: bool = False
    """Also log every rollout's and evaluation's metrics to Weights & Biases (needs `pip install slimeflow[tracking]`)."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode (default: the WANDB_MODE environment variable, else online); offline needs no network."""
    wandb_dir: str | None = None
    """Directory for W&B's files (default: <workdir>/train/wandb)."""
    wandb_key: str | None = None
    """W&B API key to log in with (online mode)."""
    wandb_host: str | None = None
    """W&B server to log in to (online mode)."""
    wandb_team: str | None = None
    """W&B entity (team)."""
    wandb_project: str | None = None
    """W&B project."""
    wandb_group: str | None = None
    """W&B group; the run is named after it."""
    disable_wandb_random_suffix: bool = False
    """Name the run exactly --wandb-group (by default, as slime, a random 8-character suffix is added)."""
    wandb_run_id: str | None = None
    """Resume this W&B run id instead of starting a new run."""
    use_tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars (needs `pip install slimeflow[tracking]`)."""
    tb_project_name: str | None = None
    """TensorBoard logs go to $TENSORBOARD_DIR, else <workdir>/train/tensorboard_log/<project>/<experiment>."""
    tb_experiment_name: str | None = None
    """TensorBoard experiment (default: the start time, YYYYmmdd_HHMMSS, as slime)."""

    @model_validator(mode="after")
    def _check(self) -> LoggingConfig:
        checks.check_logging(self)
        return self


class TrainConfig(ConfigModel):
    """The train stage: slime's train.py flags, grouped."""

    seed: int = 1234
    """Seed of model initialisation and training randomness."""
    megatron_config_path: str | None = None
    """slime's per-role Megatron YAML (megatron: [{role: actor, overrides: {flag: value}}]); the actor's overrides
    replace the command line's values (slimeflow.config.megatron_roles)."""
    custom_config_path: str | None = None
    """A YAML file of settings for plug-ins, as slime's: each key becomes an attribute of the `args` they get; a key
    that is one of these flags sets it, over the command line (slime's precedence)."""
    batch: BatchConfig
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    train_hooks: TrainHooksConfig = Field(default_factory=TrainHooksConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    sglang: SglangConfig = Field(default_factory=SglangConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    _custom_config: dict[str, Any] = PrivateAttr(default_factory=dict)
    _custom_overrides: dict[str, tuple[Any, Any]] = PrivateAttr(default_factory=dict)

    @property
    def custom_overrides(self) -> dict[str, tuple[Any, Any]]:
        """The flags --custom-config-path's file changed, by key: (old, new), as this config was first validated
        from its flags (a copy validated again from this one's values sees no change)."""
        return dict(self._custom_overrides)

    @property
    def custom_args(self) -> dict[str, Any]:
        """The plug-in settings of --custom-config-path (its keys that are not flags): attributes of slime's args."""
        return dict(self._custom_config.get("settings", {}))

    @property
    def custom_config(self) -> dict[str, Any]:
        """What --custom-config-path's file set (custom_config.custom_config_record), {} without one: recorded in the
        train manifest and the MLflow params. Read once, when the config is validated."""
        return dict(self._custom_config)

    @model_validator(mode="wrap")
    @classmethod
    def _inputs(cls, data: Any, handler: ModelWrapValidatorHandler[TrainConfig]) -> TrainConfig:
        """The flags --megatron-config-path's and --custom-config-path's files set, then the defaults that follow
        flags of other groups (train_validation.train_defaults)."""
        if not isinstance(data, dict):
            return handler(data)
        given = _megatron_roles(cls, data)
        data, flags = _custom_config_flags(cls, given)
        config = validate_derived(handler, data, {}, checks.train_defaults(cls, data))
        if flags:
            from slimeflow.config.custom_config import overridden

            config._custom_overrides = overridden(given, flags, cls)
        return config

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.custom_config_path:
            self._custom_config = custom_config_record(self.custom_config_path, type(self))
        checks.check_train(self)
        return self


def _megatron_roles(cls: type[TrainConfig], data: dict[str, Any]) -> dict[str, Any]:
    """--megatron-config-path: its actor overrides win over the other values, as in slime."""
    if not data.get("megatron_config_path"):
        return data
    try:
        return merge(data, actor_overrides(str(data["megatron_config_path"]), FlagIndex(cls)))
    except ConfigError as err:  # one problem per line, each naming the file
        raise ValueError("\n  ".join(err.problems)) from None


def _custom_config_flags(cls: type[TrainConfig], data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`data` with the flags that --custom-config-path's file sets over those given (slime sets its keys after
    parsing); those flags, as a tree)."""
    if not data.get("custom_config_path"):
        return data, {}
    flags, _ = read_custom_config(data["custom_config_path"], cls)
    plain = {key: value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
             for key, value in data.items()}
    return merge(plain, flags), flags


def staleness_bound(config: TrainConfig) -> int | None:
    """The most policy versions a trained token may lag the trainer (None: not bounded, the synchronous loop).

    --max-staleness, else the loop's own lag; with --partial-rollout (and the continued samples' earlier tokens not
    masked by --mask-offpolicy-in-partial-rollout) one more, so that a sample aborted in one rollout and continued in
    the next still trains. A buffered partial sample that would exceed it is generated again from its prompt."""
    if not config.placement.async_:
        return None
    if config.algorithm.max_staleness is not None:
        return config.algorithm.max_staleness
    rollout = config.rollout
    return checks.loop_staleness(config) + int(rollout.partial_rollout and not rollout.mask_offpolicy_in_partial_rollout)
