"""The evaluate stage's config: a checkpoint on named eval sets."""

from __future__ import annotations

from pydantic import Field, field_validator

from slimeflow.config.base import ConfigModel, OptionalPositiveInt, PositiveInt
from slimeflow.config.train_validation import refuse_unbuilt


class EvaluateConfig(ConfigModel):
    """Evaluate a checkpoint on named eval sets (avg reward, pass@k over n samples)."""

    load: str | None = None
    """Checkpoint to evaluate: a torch_dist root (latest), release/ or iter_XXXXXXX/ (unset: the HF weights)."""
    hf_checkpoint: str | None = None
    """HF directory of the tokenizer and config."""
    eval_prompt_data: dict[str, str] = Field(default_factory=dict)
    """Named eval sets: --eval-prompt-data NAME PATH [NAME PATH ...]."""
    n_samples_per_eval_prompt: PositiveInt = 1
    """Responses per prompt."""
    eval_max_response_len: OptionalPositiveInt = None
    """Maximum new tokens."""
    eval_temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy)."""
    eval_top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    eval_top_k: int = Field(-1, ge=-1)
    """Top-k; -1 disables it."""
    rm_type: str | None = None
    """Built-in reward used to score responses (metadata['rm_type'] overrides)."""
    custom_rm_path: str | None = None
    """async reward(args, sample) -> float, as in training."""
    eval_reward_key: str | None = None
    """The entry of a dict the reward function or server returns that is the reward (as slime's flag)."""
    apply_chat_template: bool = False
    """Render message-list prompts with the tokenizer's chat template."""
    input_key: str = "input"
    """Raw eval sets: the column holding the prompt (our prompt parquet needs no keys)."""
    label_key: str | None = None
    """Raw eval sets: the column holding the label."""
    metadata_key: str = "metadata"
    """Raw eval sets: the column holding the metadata (a dict or a JSON string)."""
    tool_key: str | None = None
    """Raw eval sets: the column holding tool schemas."""
    rollout_seed: int = 42
    """Seed of the sampling (each response's seed derives from it)."""
    engine_in_process: bool = True
    """Serve the engine from a thread of the stage's process, as the train stage serves one engine (no second
    interpreter importing torch and transformers: 2-3 CPU seconds of start-up); false: a process of its own."""

    @field_validator("rm_type")
    @classmethod
    def _refuse_unbuilt(cls, rm_type: str | None) -> str | None:
        refuse_unbuilt(rm_type)
        return rm_type
