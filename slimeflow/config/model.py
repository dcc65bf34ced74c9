"""The model stage's config: which base HF checkpoint the pipeline starts from."""

from __future__ import annotations

from slimeflow.config.base import ConfigModel


class ModelConfig(ConfigModel):
    """Resolve the base HF checkpoint, validate it and fingerprint every file."""

    hf_checkpoint: str
    """A local HF directory, a file:// or s3:// URI, a tiny-model spec such as 'tiny:qwen3?seed=1', or a GGUF file
    (a path or URI ending in .gguf, or a packaged one: 'gguf:smollm2-135m-instruct'), dequantized to float32."""
    cache_dir: str | None = None
    """Local directory a remote or generated checkpoint is materialised in (default: <workdir>/model)."""
