"""The training stage's config: a tree of small groups whose field names are slime's flags in snake_case.

`--rollout-batch-size 32` sets `TrainConfig.batch.rollout_batch_size`; every leaf name is unique across the tree,
so a slime flag list maps onto it flag for flag (slimeflow.config.flags). Functions take the group they use.
It lives with the shared configs, not in the train stage, because the rollout library reads it too (the evaluate
stage builds one for its rollouts).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from slimeflow.config.base import ConfigModel, OptionalPositiveInt, PluginPath, PositiveInt
from slimeflow.config.megatron import MegatronConfig


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

    @model_validator(mode="after")
    def _batch_invariant(self) -> BatchConfig:
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        steps, gbs = self.num_steps_per_rollout, self.global_batch_size
        if steps is not None:
            if samples % steps:
                raise ValueError(
                    f"--num-steps-per-rollout {steps} does not divide rollout_batch_size x n_samples_per_prompt = "
                    f"{self.rollout_batch_size} x {self.n_samples_per_prompt} = {samples}; choose a divisor of {samples}"
                )
            derived = samples // steps
            if gbs is not None and gbs != derived:
                raise ValueError(
                    f"--global-batch-size {gbs} contradicts rollout_batch_size x n_samples_per_prompt / "
                    f"num_steps_per_rollout = {samples} / {steps} = {derived}; set one of the two, or make them agree"
                )
            gbs = derived
        elif gbs is None:
            steps, gbs = 1, samples
        elif samples % gbs:
            raise ValueError(
                f"rollout_batch_size x n_samples_per_prompt = {self.rollout_batch_size} x "
                f"{self.n_samples_per_prompt} = {samples} is not a multiple of --global-batch-size {gbs}"
            )
        else:
            steps = samples // gbs
        if self.num_rollout is None and self.num_epoch is None:
            raise ValueError("set --num-rollout (rollouts to run) or --num-epoch (epochs over the prompt data)")
        if self.num_rollout is not None and self.num_epoch is not None:
            raise ValueError(f"--num-rollout {self.num_rollout} and --num-epoch {self.num_epoch} both set the "
                             "loop's length; give one (--num-epoch N runs N x ceil(prompts / rollout_batch_size))")
        if not self.use_dynamic_batch_size and self.micro_batch_size > gbs:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} is larger than the global batch "
                             f"({gbs} samples per optimizer step); choose at most {gbs}")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget per micro-batch)")
        # Derived values are stored without re-running validation (validate_assignment would recurse).
        self.__dict__["num_steps_per_rollout"] = steps
        self.__dict__["global_batch_size"] = gbs
        return self


class DataConfig(ConfigModel):
    """Where prompts come from and how rows map onto samples."""

    prompt_data: str | None = None
    """Raw data (JSONL, JSON, CSV, parquet: preprocessed first) or prompt parquet, a path or URI; in a pipeline, the
    preprocess stage's output."""
    input_key: str = "input"
    """Column holding the prompt (a string or an OpenAI messages list)."""
    label_key: str | None = None
    """Column holding the label the reward compares against."""
    metadata_key: str = "metadata"
    """Column holding a dict or JSON string loaded into Sample.metadata."""
    tool_key: str | None = None
    """Column holding tool schemas for tool-aware chat templates."""
    apply_chat_template: bool = False
    """Render message lists with the tokenizer's chat template."""
    rollout_shuffle: bool = False
    """Shuffle prompts each epoch, seeded by (rollout_seed, epoch)."""
    rollout_seed: int = 42
    """Seed of the data order and of sampling."""
    rollout_max_prompt_len: OptionalPositiveInt = None
    """Drop prompts longer than this many tokens."""
    data_source_path: PluginPath = None
    """A data source class in place of slimeflow's (slime's contract: cls(args) with get_samples(num_samples) ->
    list of groups, add_samples(groups), save(rollout_id), load(rollout_id), __len__); --prompt-data is then its
    own business (args.prompt_data, as given) and --num-rollout is required."""

    @field_validator("data_source_path")
    @classmethod
    def _slimes_default_is_ours(cls, value: str | None) -> str | None:
        # slime's default class, named explicitly by some scripts, is what slimeflow's own data source does.
        return None if value in SLIME_DEFAULT_DATA_SOURCES else value


SLIME_DEFAULT_DATA_SOURCES = ("slime.rollout.data_source.RolloutDataSourceWithBuffer",
                               "slime.rollout.data_source:RolloutDataSourceWithBuffer")


class RolloutConfig(ConfigModel):
    """Generation: sampling parameters, custom generate functions and sampling strategies."""

    rollout_max_response_len: PositiveInt = 1024
    """Maximum new tokens per response."""
    rollout_temperature: float = Field(1.0, gt=0)
    """Sampling temperature (must be > 0: RL needs the sampling distribution)."""
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass, in (0, 1]."""
    rollout_top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables it."""
    rollout_stop: list[str] | None = None
    """Stop strings."""
    rollout_stop_token_ids: list[int] | None = None
    """Stop token ids."""
    custom_generate_function_path: PluginPath = None
    """async generate(args, sample, sampling_params) -> Sample, for multi-turn and agentic rollouts."""
    rollout_function_path: PluginPath = None
    """Replace the whole rollout function: generate_rollout(args, rollout_id, data_source, evaluation=False) ->
    RolloutFnTrainOutput | list[list[Sample]] (slime's contract; the dynamic-sampling flags are then its own)."""
    over_sampling_batch_size: OptionalPositiveInt = None
    """Prompts requested per over-sampling round (>= rollout_batch_size; defaults to it)."""
    dynamic_sampling_filter_path: PluginPath = None
    """Keep a group only if this filter passes, e.g. check_reward_nonzero_std."""
    partial_rollout: bool = False
    """Keep aborted half-generated samples in the buffer and continue them next rollout."""
    mask_offpolicy_in_partial_rollout: bool = False
    """Mask the tokens of a partial sample that an older policy generated."""
    buffer_filter_path: PluginPath = None
    """How groups are taken from the buffer (default pop_first: FIFO)."""
    rollout_sample_hook_path: list[str] | None = None
    """hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None, on each generated sample before
    its reward, in the order given (slime's contract)."""
    rollout_sample_filter_path: PluginPath = None
    """filter(args, groups) -> None, setting `remove_sample` on samples that must not train (their loss mask
    becomes 0; they still count in advantage normalisation), as slime."""
    rollout_all_samples_process_path: PluginPath = None
    """process(args, all_samples, data_source) on every finished group of the rollout, kept or filtered out
    (slime's contract; data_source is slime's API over the rollout's buffer)."""
    custom_rollout_log_function_path: PluginPath = None
    """log(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool; True skips the default
    rollout metrics (slime's contract)."""


class RewardConfig(ConfigModel):
    """How responses are scored."""

    rm_type: str | None = None
    """Built-in reward: math, deepscaler, dapo, f1, gpqa, random (as slime's rm_hub), prefix_match (ours); a `boxed_`
    prefix is accepted; metadata['rm_type'] overrides. ifbench is refused (see rule_rewards.IFBENCH_REFUSED)."""
    custom_rm_path: PluginPath = None
    """async reward(args, sample) -> float, or a group function with group_rm."""
    rm_url: str | None = None
    """Remote reward server (HTTP)."""
    group_rm: bool = False
    """Reward a whole group at once."""
    reward_key: str | None = None
    """The entry of a dict a reward function or server returns that is the reward (as slime; without it a dict's
    'reward', else its 'score')."""
    eval_reward_key: str | None = None
    """--reward-key for evaluation (default: --reward-key)."""

    @model_validator(mode="after")
    def _refuse_unbuilt(self) -> RewardConfig:
        from slimeflow.rollout.rule_rewards import refuse_unbuilt  # rule_rewards is heavier than a config

        refuse_unbuilt(self.rm_type)
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

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.kl_coef and self.kl_loss_coef:
            raise ValueError(
                f"--kl-coef {self.kl_coef} and --kl-loss-coef {self.kl_loss_coef} are both non-zero; "
                "slime allows only one: the KL goes into the reward (kl_coef) or into the loss (kl_loss_coef)"
            )
        if self.use_rollout_logprobs and self.use_tis:
            raise ValueError("--use-rollout-logprobs and --use-tis together: with the engine's log-probs as the old "
                             "policy's there is nothing left to correct (slime refuses it too); give one")
        if self.tis_clip_low > self.tis_clip:
            raise ValueError(f"--tis-clip-low {self.tis_clip_low} is above --tis-clip {self.tis_clip}; "
                             "the TIS weight is clipped to [tis_clip_low, tis_clip]")
        if self.use_opd and self.opd_type is None:
            raise ValueError("--use-opd needs --opd-type: sglang (the samples' teacher_log_probs, from a teacher "
                             "server) or megatron (a teacher model from --opd-teacher-load, run by the trainer)")
        if self.use_opd and self.opd_type == "megatron" and self.opd_teacher_load is None:
            raise ValueError("--opd-type megatron needs --opd-teacher-load: the teacher's torch_dist checkpoint")
        if self.opd_teacher_load is not None and not (self.use_opd and self.opd_type == "megatron"):
            raise ValueError(f"--opd-teacher-load {self.opd_teacher_load} is read only with --use-opd --opd-type "
                             "megatron (with sglang the teacher's log-probs come with the samples): remove it or add "
                             "those")
        if self.loss_type == "custom_loss" and self.custom_loss_function_path is None:
            raise ValueError("--loss-type custom_loss needs --custom-loss-function-path module:function")
        if self.eps_clip_high is None:
            self.__dict__["eps_clip_high"] = self.eps_clip
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
    def _check_warmup(self) -> OptimizerConfig:
        """Megatron-LM's rule: the warm-up is given in steps or as a fraction, not both."""
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            raise ValueError(f"--lr-warmup-fraction {self.lr_warmup_fraction} with --lr-warmup-iters "
                             f"{self.lr_warmup_iters}: give the warm-up one way; drop one of them")
        return self


class CheckpointConfig(ConfigModel):
    """Where the model comes from and where checkpoints go (slime's CKPT_ARGS)."""

    hf_checkpoint: str | None = None
    """HF model directory: tokenizer and config source (and the weights for the torch backend)."""
    ref_load: str | None = None
    """torch_dist checkpoint of the reference model."""
    load: str | None = None
    """Actor checkpoint root; falls back to ref_load when empty or holding no valid checkpoint."""
    save: str | None = None
    """Checkpoint root the actor saves to."""
    save_interval: OptionalPositiveInt = None
    """Save every this many rollouts."""
    start_rollout_id: int | None = Field(None, ge=0)
    """Override the rollout id to start from (default: from the loaded checkpoint)."""


class EvalConfig(ConfigModel):
    """Evaluation during training."""

    eval_interval: OptionalPositiveInt = None
    """Evaluate every this many rollouts."""
    eval_prompt_data: dict[str, str] = Field(default_factory=dict)
    """Named eval sets: --eval-prompt-data NAME PATH [NAME PATH ...] (raw data or prompt parquet, as --prompt-data)."""
    n_samples_per_eval_prompt: PositiveInt = 1
    """Responses per eval prompt (pass@k, avg@n)."""
    eval_max_response_len: OptionalPositiveInt = None
    """Maximum new tokens in eval (default: rollout_max_response_len)."""
    eval_temperature: float | None = Field(None, ge=0)
    """Eval temperature (default: rollout_temperature)."""
    eval_top_p: float | None = Field(None, gt=0, le=1)
    """Eval top-p (default: rollout_top_p)."""
    eval_top_k: int | None = Field(None, ge=-1)
    """Eval top-k (default: rollout_top_k)."""
    skip_eval_before_train: bool = False
    """Do not evaluate before the first rollout."""
    eval_function_path: PluginPath = None
    """eval_generate_rollout(args, rollout_id, data_source, evaluation=True) -> RolloutFnEvalOutput, replacing the
    evaluation of --eval-prompt-data (slime's contract; args.eval_prompt_data is slime's [name, path, ...] list)."""
    custom_eval_rollout_log_function_path: PluginPath = None
    """log(rollout_id, args, data, extra_metrics) -> bool, data = {set: {rewards, truncated, samples}}; True skips
    the default eval metrics (slime's contract)."""


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

    @model_validator(mode="after")
    def _colocate(self) -> PlacementConfig:
        # As slime: --offload is both; --colocate turns on whichever is not given; otherwise both are off.
        for name in ("offload_train", "offload_rollout"):
            value = True if self.offload else getattr(self, name)
            self.__dict__[name] = self.colocate if value is None else value
        if self.colocate:
            # As slime: colocated rollout uses exactly the training devices.
            self.__dict__["rollout_num_gpus"] = self.actor_num_nodes * self.actor_num_gpus_per_node
        devices, per_engine = self.rollout_num_gpus, self.rollout_num_gpus_per_engine
        if devices is not None and devices % per_engine:
            source = " (the training devices, with --colocate)" if self.colocate else ""
            raise ValueError(f"--rollout-num-gpus {devices}{source} is not a multiple of --rollout-num-gpus-per-engine "
                             f"{per_engine}: {devices % per_engine} device(s) would serve no engine; make it a "
                             "multiple")
        return self


class WeightSyncConfig(ConfigModel):
    """How and how often the trainer's weights reach the engines (engines.WeightSync)."""

    update_weights_interval: PositiveInt = 1
    """Push the weights every this many rollouts; the rollouts between pushes are generated by the last pushed
    weights (and checked against that version)."""
    update_weight_buffer_size: PositiveInt = 512 * 1024**2
    """Bytes per weight-update bucket (a larger tensor goes alone)."""
    update_weight_transport: Literal["nccl", "disk"] | None = None
    """nccl: broadcast in a process group of trainer rank 0 and the engines (gloo on CPU); disk: through
    --sglang-weights-dir. Default: HTTP tensors to embedded engines (a /dev/shm segment with --colocate), SGLang's
    /update_weights_from_tensor body of IPC handles to colocated SGLang servers (as slime), disk for external ones."""
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


class SglangConfig(ConfigModel):
    """Every `--sglang-X value` flag, keyed by X, and every `--router-X value` flag, keyed by X. slimeflow reads
    those in READ itself; the other `--sglang-*` flags are SGLang server arguments, passed to the SGLang servers
    slimeflow launches (engine/sglang_launch.py), and `--router-*` flags go to the sglang-router it starts."""

    READ: ClassVar[frozenset[str]] = frozenset({"worker_urls", "weights_dir", "api_key", "router_ip", "router_port",
                                                "router_request_timeout_secs", "server_concurrency"})

    args: dict[str, Any] = Field(default_factory=dict)
    """SGLang arguments, keyed by name without the sglang_ prefix."""
    router: dict[str, Any] = Field(default_factory=dict)
    """sglang-router arguments, keyed by name without the router_ prefix."""

    def server_args(self) -> dict[str, Any]:
        """The SGLang server arguments given (what slimeflow passes to the SGLang servers it launches)."""
        return {key: value for key, value in self.args.items() if key not in self.READ}

    def unread(self, launches_sglang: bool) -> list[str]:
        """The --sglang-* flags given that no server would get, with the reason, one line each: all server
        arguments when the engines are not SGLang servers launched here, else those slimeflow sets itself."""
        from slimeflow.engine.sglang_launch import SET_BY_SLIMEFLOW

        problems = [f"--sglang-{key.replace('_', '-')}: not taken ({SET_BY_SLIMEFLOW[key]}); remove it"
                    for key in sorted(self.server_args()) if key in SET_BY_SLIMEFLOW]
        if not launches_sglang:
            problems += [f"--sglang-{key.replace('_', '-')}: an SGLang server argument, but no SGLang server is "
                         "launched here (the engines are servers started elsewhere, or the embedded engine, which "
                         "takes none, where SGLang is not installed); install SGLang on a GPU cluster, or start "
                         "your SGLang servers with it and pass --rollout-external-engine-addrs"
                         for key in sorted(self.server_args()) if key not in SET_BY_SLIMEFLOW]
        return problems


class DebugConfig(ConfigModel):
    """slime's debug modes: rollouts without a trainer, or training on saved rollouts without an engine."""

    debug_rollout_only: bool = False
    """Generate and score rollouts but create no trainer: no training, checkpoints or weight updates (the engines
    keep --hf-checkpoint's weights); for testing rollout and reward plug-ins."""
    debug_train_only: bool = False
    """Train on the rollouts of --load-debug-rollout-data; no engine starts and evaluation is skipped."""
    save_debug_rollout_data: str | None = None
    """Write each rollout's samples to this path, `{rollout_id}` replaced by the rollout id (e.g.
    /tmp/debug/rollout_{rollout_id}.pt): torch.save of plain lists and numbers, read back with weights_only."""
    load_debug_rollout_data: str | None = None
    """Train on the samples saved at this path (`{rollout_id}` as above) instead of generating them; implies
    --debug-train-only, as in slime."""

    @model_validator(mode="after")
    def _check(self) -> DebugConfig:
        problems = [p for flag, path in (("--save-debug-rollout-data", self.save_debug_rollout_data),
                                         ("--load-debug-rollout-data", self.load_debug_rollout_data))
                    if path is not None for p in _path_template_problems(flag, path)]
        if self.save_debug_rollout_data is not None and "{rollout_id}" not in self.save_debug_rollout_data:
            problems.append(f"--save-debug-rollout-data {self.save_debug_rollout_data} has no {{rollout_id}}: every "
                            "rollout would overwrite one file; put {rollout_id} in it, e.g. "
                            "/tmp/debug/rollout_{rollout_id}.pt")
        if self.debug_rollout_only and (self.debug_train_only or self.load_debug_rollout_data is not None):
            given = "--debug-train-only" if self.debug_train_only else "--load-debug-rollout-data (which implies it)"
            problems.append(f"--debug-rollout-only and {given} are both set: the one runs no trainer, the other no "
                            "engine; choose one (as slime refuses the pair)")
        elif self.debug_train_only and self.load_debug_rollout_data is None:
            problems.append("--debug-train-only needs --load-debug-rollout-data PATH (the rollouts to train on, "
                            "written by a run with --save-debug-rollout-data PATH); give it, or drop "
                            "--debug-train-only (slime's SFT scripts use it without saved rollouts, to train on "
                            "--prompt-data's conversations through slime's sft_rollout, which slimeflow does not "
                            "support yet)")
        if problems:
            raise ValueError("; ".join(problems))
        if self.load_debug_rollout_data is not None:
            self.__dict__["debug_train_only"] = True  # as slime: loaded rollouts need no engine
        return self


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
    def _named(self) -> LoggingConfig:
        if self.use_wandb and self.wandb_mode != "disabled" and not (self.wandb_project and self.wandb_group):
            raise ValueError("--use-wandb needs --wandb-project and --wandb-group (the run is named after the group)")
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
    _custom_args: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def custom_args(self) -> dict[str, Any]:
        """The plug-in settings of --custom-config-path (its keys that are not flags): attributes of slime's args."""
        return dict(self._custom_args)

    @model_validator(mode="before")
    @classmethod
    def _custom_config_flags(cls, data: Any) -> Any:
        """The flags that --custom-config-path's file sets, over those given (slime sets its keys after parsing)."""
        if not isinstance(data, dict) or not data.get("custom_config_path"):
            return data
        from slimeflow.config.custom_config import read_custom_config
        from slimeflow.config.flags import merge

        flags, _ = read_custom_config(data["custom_config_path"], cls)
        plain = {key: value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
                 for key, value in data.items()}
        return merge(plain, flags)

    @model_validator(mode="before")
    @classmethod
    def _megatron_roles(cls, data: Any) -> Any:
        """--megatron-config-path: its actor overrides win over the other values, as in slime."""
        if not isinstance(data, dict) or not data.get("megatron_config_path"):
            return data
        from slimeflow.config.flags import FlagIndex, merge
        from slimeflow.config.megatron_roles import actor_overrides
        from slimeflow.errors import ConfigError

        try:
            return merge(data, actor_overrides(str(data["megatron_config_path"]), FlagIndex(cls)))
        except ConfigError as err:  # one problem per line, each naming the file
            raise ValueError("\n  ".join(err.problems)) from None

    @model_validator(mode="after")
    def _cross_group(self) -> TrainConfig:
        if self.custom_config_path:
            from slimeflow.config.custom_config import read_custom_config

            self._custom_args = read_custom_config(self.custom_config_path, type(self))[1]
        over = self.rollout.over_sampling_batch_size
        if over is not None and over < self.batch.rollout_batch_size:
            raise ValueError(
                f"--over-sampling-batch-size {over} is smaller than --rollout-batch-size "
                f"{self.batch.rollout_batch_size}; it must be >= rollout_batch_size (or left unset)"
            )
        ranks = self.placement.actor_num_nodes * self.placement.actor_num_gpus_per_node
        share = self.batch.global_batch_size // ranks  # the batch invariant has set global_batch_size
        if ranks > 1 and not self.batch.use_dynamic_batch_size and self.batch.micro_batch_size > share:
            raise ValueError(
                f"--micro-batch-size {self.batch.micro_batch_size} is larger than a data-parallel rank's share of the "
                f"global batch ({self.batch.global_batch_size} samples over {ranks} ranks = {share}); choose at most "
                f"{max(share, 1)}")
        check_async(self)
        placement = self.placement
        if self.debug.debug_rollout_only or self.debug.debug_train_only:
            # As slime for --debug-rollout-only (no trainer: nothing to make room for); --debug-train-only has no engine.
            placement.__dict__["offload_rollout"] = False
            placement.__dict__["offload_train"] = placement.offload_train and not self.debug.debug_rollout_only
        check_fault_tolerance(self)
        check_train_hooks(self)
        if self.batch.n_samples_per_prompt == 1 and self.algorithm.advantage_estimator in ("grpo", "gspo", "cispo"):
            # As slime: the std of a one-sample group is undefined, so std normalisation is switched off.
            self.algorithm.__dict__["disable_grpo_std_normalization"] = True
        return self


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
    placement.__dict__["engine_in_process"] = False  # a lone engine gets a process of its own, to restart


def check_async(config: TrainConfig) -> None:
    """--async and its flags: what the asynchronous loop cannot do is refused with the reason (slime's where it has
    one). On a CPU an async run's engine gets a process of its own unless --engine-in-process is given."""
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
            "--debug-train-only": (config.debug.debug_train_only, "there is no engine: saved rollouts are replayed"),
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
    if placement.async_ and "engine_in_process" not in placement.model_fields_set:
        placement.__dict__["engine_in_process"] = False  # overlap: engine and rollout loop need not share one GIL


def loop_staleness(config: TrainConfig) -> int:
    """The most policy versions the async loop's own rollouts lag the trainer: rollout k is asked for while rollout
    k - N trains (N = --async-buffer-size), from the weights pushed last, at most interval - 1 rollouts earlier."""
    return config.placement.async_buffer_size + config.weight_sync.update_weights_interval - 1


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
    return loop_staleness(config) + int(rollout.partial_rollout and not rollout.mask_offpolicy_in_partial_rollout)
