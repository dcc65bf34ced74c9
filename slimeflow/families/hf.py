"""Loading an HF directory's config and causal LM through transformers, with the model_types it lacks read as the
family they belong to: Kimi-K2's config.json says `kimi_k2` (and ships remote code for it), but it is DeepSeek-V3
(`DeepseekV3ForCausalLM`, the seeds say so), which transformers has. The converter goes by `architectures` and
needs none of this; the engine and the training backend load models through these functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM

MODEL_TYPE_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}
"""model_type in config.json -> the transformers model_type that computes it."""


def load_config(path: str | Path, **kwargs: Any):
    """The transformers config of an HF directory (an aliased model_type read as its family's)."""
    fields = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    alias = MODEL_TYPE_ALIASES.get(fields.get("model_type"))
    if alias is None:
        return AutoConfig.from_pretrained(path, **kwargs)
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "auto_map")}
    return AutoConfig.for_model(alias, **fields)


def load_causal_lm(path: str | Path, **kwargs: Any):
    """AutoModelForCausalLM.from_pretrained with `load_config`'s config; keyword arguments go to from_pretrained."""
    config = load_config(path, local_files_only=kwargs.get("local_files_only", False))
    return AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
