"""The train config's rollout-side groups: where prompts come from, generation, rewards, evaluation and the SGLang
pass-through (the groups the rollout library reads; slimeflow.config.train composes them into TrainConfig)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from slimeflow.config import train_validation as checks
from slimeflow.config.base import ConfigModel, OptionalPositiveInt, PluginPath, PositiveInt
from slimeflow.engine.sglang_launch import SET_BY_SLIMEFLOW


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
    loss_mask_type: Literal["qwen", "qwen3", "qwen3_5", "distill_qwen"] = "qwen"
    """The chat-template style of an SFT conversation's loss mask (slimeflow.rollout.loss_masks), read by a rollout
    function that tokenizes conversations (slime's SFT: slime.rollout.sft_rollout.generate_rollout)."""
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
SLIME_DEFAULT_ROLLOUT_FUNCTIONS = ("slime.rollout.sglang_rollout.generate_rollout",
                                   "slime.rollout.sglang_rollout:generate_rollout")
"""slime's default --rollout-function-path and --eval-function-path: slimeflow's own rollout and evaluation."""


def _slimes_default_rollout_is_ours(value: str | None) -> str | None:
    # Named explicitly by some scripts: slime's default rollout and evaluation are what slimeflow's own do.
    return None if value in SLIME_DEFAULT_ROLLOUT_FUNCTIONS else value


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

    @field_validator("rollout_function_path")
    @classmethod
    def _slimes_default_is_ours(cls, value: str | None) -> str | None:
        return _slimes_default_rollout_is_ours(value)


class RewardConfig(ConfigModel):
    """How responses are scored."""

    rm_type: str | None = None
    """Built-in reward: math, deepscaler, dapo, f1, gpqa, random (as slime's rm_hub), prefix_match (ours); a `boxed_`
    prefix is accepted; metadata['rm_type'] overrides. ifbench is refused (see train_validation.IFBENCH_REFUSED)."""
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
    def _check(self) -> RewardConfig:
        checks.check_reward(self)
        return self


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

    @field_validator("eval_function_path")
    @classmethod
    def _slimes_default_is_ours(cls, value: str | None) -> str | None:
        return _slimes_default_rollout_is_ours(value)


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
        problems = [f"--sglang-{key.replace('_', '-')}: not taken ({SET_BY_SLIMEFLOW[key]}); remove it"
                    for key in sorted(self.server_args()) if key in SET_BY_SLIMEFLOW]
        if not launches_sglang:
            problems += [f"--sglang-{key.replace('_', '-')}: an SGLang server argument, but no SGLang server is "
                         "launched here (the engines are servers started elsewhere, or the embedded engine, which "
                         "takes none, where SGLang is not installed); install SGLang on a GPU cluster, or start "
                         "your SGLang servers with it and pass --rollout-external-engine-addrs"
                         for key in sorted(self.server_args()) if key not in SET_BY_SLIMEFLOW]
        return problems
