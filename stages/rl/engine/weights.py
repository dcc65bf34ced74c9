"""Loading the served model and checking/applying weight updates (HF tensor names, as in the safetensors files)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from slimeflow.stages.rl.engine.sampling import BadRequestError

DTYPES = ("float32", "bfloat16")


@dataclass
class LoadedModel:
    """The model in eval mode on `device`, its tokenizer, its EOS ids and its position limit."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_positions: int
    device: torch.device


def load_model(model_path: str | Path, *, dtype: str = "float32", device: str | None = None) -> LoadedModel:
    """Load an HF causal-LM directory onto one GPU when present, else the CPU."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(target).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return LoadedModel(model=model, tokenizer=tokenizer, eos_token_ids=eos_ids(model),
                       max_positions=int(model.config.max_position_embeddings), device=target)


def eos_ids(model: PreTrainedModel) -> frozenset[int]:
    """Every id that ends generation: generation_config's eos_token_id and the config's, each an int or a list."""
    found: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            found.update([value] if isinstance(value, int) else value)
    return frozenset(found)


def check_update(model_tensors: dict[str, torch.Tensor], update: dict[str, torch.Tensor]) -> None:
    """Raise BadRequestError unless every tensor of `update` names a model tensor of the same shape."""
    if not update:
        raise BadRequestError("the weight update holds no tensors; send at least one HF-named tensor")
    unknown = sorted(set(update) - set(model_tensors))
    if unknown:
        raise BadRequestError(
            f"weight update names {len(unknown)} tensors the model does not have, e.g. {unknown[:5]}; "
            f"use the HF names of the served model, e.g. {sorted(model_tensors)[:3]}"
        )
    wrong = [(name, tuple(t.shape), tuple(model_tensors[name].shape))
             for name, t in update.items() if t.shape != model_tensors[name].shape]
    if wrong:
        described = ", ".join(f"{n}: got {got}, model has {want}" for n, got, want in wrong[:5])
        raise BadRequestError(f"weight update has {len(wrong)} tensors of the wrong shape ({described})")


def read_checkpoint(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in an HF directory; BadRequestError when there are none."""
    directory = Path(model_path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise BadRequestError(
            f"model_path {str(model_path)!r} is not a directory with *.safetensors files; "
            "pass an HF checkpoint directory saved with save_pretrained(safe_serialization=True)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def apply_update(model: PreTrainedModel, update: dict[str, torch.Tensor]) -> None:
    """Copy checked tensors into the model in place (cast to its dtype and device); tied tensors share storage."""
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in update.items():
            own[name].copy_(tensor.to(dtype=own[name].dtype, device=own[name].device))
