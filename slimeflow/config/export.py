"""The export stage's config: a checkpoint -> HF safetensors in object storage."""

from __future__ import annotations

import re

from pydantic import field_validator

from slimeflow.config.base import ConfigModel, OptionalPositiveInt

_SIZE = re.compile(r"^(\d+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912 (as HF's max_shard_size)."""
    match = _SIZE.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a size; write a number and a unit, e.g. 5GB, 500MB or 2GiB")
    return int(match.group(1)) * _UNITS[match.group(2)]


class ExportConfig(ConfigModel):
    """Export a torch_dist checkpoint to HF safetensors (sharded, with config and tokenizer) and upload it."""

    input_dir: str | None = None
    """torch_dist checkpoint: a root (latest), release/ or iter_XXXXXXX/ (in a pipeline: the train stage's)."""
    output_dir: str | None = None
    """Destination URI of the HF model, a local path or s3:// (default: <output>/export/hf)."""
    origin_hf_dir: str | None = None
    """HF directory whose config and tokenizer are copied (in a pipeline: the model stage's)."""
    vocab_size: OptionalPositiveInt = None
    """True vocabulary size, to strip Megatron's padding (default: origin_hf_dir's config)."""
    max_shard_size: str = "5GB"
    """Largest safetensors shard (HF's spelling: 5GB, 500MB, 2GiB)."""
    overwrite: bool = True
    """Replace an earlier export at output_dir (one this stage wrote: its .slimeflow-export.json lists its files).
    A target holding anything else is refused whatever this says; false refuses an earlier export too."""

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: str) -> str:
        parse_size(value)
        return value
