"""The convert stage's config: slime's converter flags (tools/convert_hf_to_torch_dist.py and back)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from slimeflow.config.base import ConfigModel, PositiveInt
from slimeflow.config.megatron import MegatronConfig


class ConvertConfig(ConfigModel):
    """HF <-> Megatron torch_dist conversion."""

    direction: Literal["hf-to-torch-dist", "torch-dist-to-hf"] = "hf-to-torch-dist"
    """Which way to convert."""
    hf_checkpoint: str | None = None
    """HF model directory, URI or tiny-model spec to convert (hf-to-torch-dist; in a pipeline, the model stage's)."""
    save: str | None = None
    """Checkpoint root the torch_dist checkpoint is written to, as release/ (default: <workdir>/torch_dist)."""
    input_dir: str | None = None
    """torch_dist checkpoint: a root (latest), release/ or iter_XXXXXXX/ (torch-dist-to-hf)."""
    output_dir: str | None = None
    """Directory the HF safetensors are written to (torch-dist-to-hf)."""
    origin_hf_dir: str | None = None
    """HF directory whose config and tokenizer are copied next to the converted weights (torch-dist-to-hf)."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """slime's MODEL_ARGS (scripts/models/*.sh), checked against the HF config before any work; --vocab-size is the
    true vocabulary that torch-dist-to-hf strips Megatron's padding to (default: origin_hf_dir's config), and
    --make-vocab-size-divisible-by x --tensor-model-parallel-size the padding hf-to-torch-dist writes."""
    overwrite: bool = False
    """Replace a checkpoint that already exists at the target."""
    processes: PositiveInt = 1
    """Cooperating conversion processes (hf-to-torch-dist); each loads and writes only its share of the layers."""
    launcher: Literal["local", "ray"] = "local"
    """How the processes start (hf-to-torch-dist): local subprocesses, or Ray tasks on the run's Ray cluster
    (a local Ray when none is set); with Ray on several nodes, --save must be on storage they all share."""

    @model_validator(mode="after")
    def _endpoints(self) -> ConvertConfig:
        # hf-to-torch-dist: the pipeline supplies hf_checkpoint (the model stage's output) and save has a default.
        needed = (
            {}
            if self.direction == "hf-to-torch-dist"
            else {"input_dir": "--input-dir", "output_dir": "--output-dir", "origin_hf_dir": "--origin-hf-dir"}
        )
        missing = [flag for name, flag in needed.items() if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{self.direction} needs {', '.join(missing)}")
        return self
