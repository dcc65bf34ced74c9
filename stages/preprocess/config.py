"""The preprocess stage's config: raw rows -> prompt parquet, with slime's data-key flags."""

from __future__ import annotations

from pydantic import Field, model_validator

from slimeflow.config.base import ConfigModel, OptionalPositiveInt


class PreprocessConfig(ConfigModel):
    """Raw datasets (JSONL, JSON, Parquet, CSV; files, directories, globs; local or s3://) -> prompt parquet."""

    input: list[str] = Field(default_factory=list)
    """Training data: paths or URIs (files, directories or globs); repeatable."""
    eval_input: dict[str, str] = Field(default_factory=dict)
    """Named eval sets: --eval-input NAME PATH [NAME PATH ...]."""
    output: str | None = None
    """URI the parquet datasets, manifest.json and the quarantine are written under."""
    input_key: str = "input"
    """Column holding the prompt (a string or an OpenAI messages list)."""
    label_key: str | None = None
    """Column holding the label."""
    metadata_key: str = "metadata"
    """Existing metadata column (a dict or a JSON string), merged with the packed extra columns."""
    tool_key: str | None = None
    """Column holding tool schemas."""
    apply_chat_template: bool = False
    """Render messages (and tools) with the tokenizer's chat template."""
    hf_checkpoint: str | None = None
    """HF directory of the tokenizer (chat template and prompt token counts)."""
    rollout_max_prompt_len: OptionalPositiveInt = None
    """Filter prompts longer than this many tokens."""
    strict: bool = False
    """Fail on the first bad row instead of quarantining it."""

    @model_validator(mode="after")
    def _check(self) -> PreprocessConfig:
        if self.apply_chat_template and self.hf_checkpoint is None:
            raise ValueError("--apply-chat-template needs --hf-checkpoint (the tokenizer whose template is applied)")
        return self
