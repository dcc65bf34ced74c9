"""The export stage's config: a checkpoint -> HF safetensors in object storage."""

from __future__ import annotations

from slimeflow.config.base import ConfigModel


class ExportConfig(ConfigModel):
    """Export a torch_dist checkpoint to HF safetensors (sharded, with config and tokenizer) and upload it."""

    input_dir: str | None = None
    """torch_dist checkpoint: a root (latest), release/ or iter_XXXXXXX/."""
    output_dir: str | None = None
    """Destination URI of the HF model (local path or s3://)."""
    origin_hf_dir: str | None = None
    """HF directory whose config and tokenizer are copied."""
    max_shard_size: str = "5GB"
    """Largest safetensors shard."""
