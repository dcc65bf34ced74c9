"""The model stage's config: which base HF checkpoint the pipeline starts from."""

from __future__ import annotations

from slimeflow.config.base import ConfigModel


class ModelConfig(ConfigModel):
    """Resolve the base HF checkpoint, validate it and fingerprint every file."""

    hf_checkpoint: str
    """A local HF directory, a file:// or s3:// URI, or a tiny-model spec such as 'tiny:qwen3?seed=1'."""
    cache_dir: str | None = None
    """Local directory a remote or generated checkpoint is materialised in (default: <workdir>/model)."""
