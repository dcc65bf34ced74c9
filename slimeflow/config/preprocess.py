"""The preprocess stage's config: raw rows -> prompt parquet, with slime's data-key flags."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from slimeflow.config.base import ConfigModel, OptionalPositiveInt, PositiveInt


class PreprocessConfig(ConfigModel):
    """Raw datasets (JSONL, JSON, Parquet, CSV; files, directories, globs; local or s3://) -> prompt parquet."""

    input: list[str] = Field(default_factory=list)
    """Training data: paths or URIs (files, directories or globs); repeatable."""
    eval_input: dict[str, str] = Field(default_factory=dict)
    """Named eval sets: --eval-input NAME PATH [NAME PATH ...]."""
    output: str | None = None
    """URI the parquet datasets, manifest.json and the quarantine are written under (default: <output>/preprocess)."""
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
    keep_columns: list[str] | None = None
    """Pack only these extra columns into metadata (default: every column that is not a key column)."""
    drop_columns: list[str] = Field(default_factory=list)
    """Extra columns left out of metadata (counted in the manifest)."""
    missing_label: Literal["quarantine", "keep"] = "quarantine"
    """A row without a label (when --label-key is set): quarantine it, or keep it with a null label."""
    dedup: bool = True
    """Filter exact-duplicate prompts (by a content hash of the final prompt), keeping the first."""
    shuffle: bool = False
    """Shuffle each output dataset deterministically by --data-seed."""
    eval_split_fraction: float | None = Field(None, gt=0, lt=1)
    """Move about this fraction of the training rows to a held-out eval set (chosen by a keyed hash of row_id)."""
    eval_split_name: str = "heldout"
    """Name of the held-out eval set made by --eval-split-fraction."""
    data_seed: int = 42
    """Seed of the shuffle and of the train/eval split."""
    row_group_size: PositiveInt = 8192
    """Rows per parquet row group (also the unit of random access of the reader)."""
    read_batch_size: PositiveInt = 8192
    """Rows per batch flowing through the stage (reading, tokenising, writing)."""

    @model_validator(mode="after")
    def _check(self) -> PreprocessConfig:
        names = ["train", *self.eval_input] + ([self.eval_split_name] if self.eval_split_fraction else [])
        clashes = sorted({n for n in names if names.count(n) > 1})
        if clashes:
            raise ValueError(f"dataset names must be distinct, got {clashes} more than once: 'train' is the "
                             "--input set; rename the --eval-input set or --eval-split-name")
        if self.keep_columns is not None and set(self.keep_columns) & set(self.drop_columns):
            raise ValueError(f"--keep-columns and --drop-columns both name {sorted(set(self.keep_columns) & set(self.drop_columns))}")
        return self

    def needs_tokenizer(self) -> bool:
        """A chat template or a length filter needs the tokenizer of --hf-checkpoint."""
        return self.apply_chat_template or self.rollout_max_prompt_len is not None
