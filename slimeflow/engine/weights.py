"""Loading the served model and checking/applying weight updates.

Updates name tensors as the model's HF checkpoint files do (as SGLang's /update_weights_* take them), whatever the
family: `UpdateNames` turns them into the served model's in-memory names with transformers' own load-time conversion
(a MoE layer's experts, one tensor each in a checkpoint, are one fused tensor in memory), holding the pieces of a
fused tensor that a push sends across buckets until it is complete. The model's own names are accepted too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from slimeflow.engine.finite_copy import all_finite
from slimeflow.engine.sampling import BadRequestError
from slimeflow.families.checkpoint_names import (
    CheckpointLayout,
    IncompleteTensorError,
    UnknownPieceError,
    to_checkpoint,
)
from slimeflow.families.hf import load_causal_lm
from slimeflow.offload import trim_heap

DTYPES = ("float32", "bfloat16")


class ForbiddenError(Exception):
    """A request for what this engine does not allow (answered 403): a disk update from outside --weights-dir."""


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
    model = load_causal_lm(model_path, dtype=getattr(torch, dtype)).to(target).eval()
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
            "use the names of the served model's HF checkpoint files (or its in-memory names), e.g. "
            f"{sorted(model_tensors)[:3]}"
        )
    wrong = [(name, tuple(t.shape), tuple(model_tensors[name].shape))
             for name, t in update.items() if t.shape != model_tensors[name].shape]
    if wrong:
        described = ", ".join(f"{n}: got {got}, model has {want}" for n, got, want in wrong[:5])
        raise BadRequestError(f"weight update has {len(wrong)} tensors of the wrong shape ({described})")


class UpdateNames:
    """Checkpoint-named updates -> the served model's names; the pieces of fused tensors a push has not completed yet
    are held (with the push's weight version) until their last piece comes."""

    def __init__(self, model: PreTrainedModel):
        self.layout = CheckpointLayout(model)
        self.held: dict[str, dict[str, torch.Tensor]] = {}
        self.version: str | None = None

    def convert(self, update: dict[str, torch.Tensor], version: str | None
                ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """(the model-named tensors `update` completes, the pieces held after it); nothing is kept until `hold`.
        BadRequestError when pieces of another version are held (that push ended incomplete: they are dropped) or a
        piece names no expert of the model."""
        if self.held and version != self.version:
            message = self.incomplete(f"the push of weight version {self.version!r} ended")
            raise BadRequestError(f"{message}; weight version {version!r} was not applied either: push it again")
        held = {target: dict(pieces) for target, pieces in self.held.items()}
        try:
            return self.layout.to_model(update, held), held
        except UnknownPieceError as err:
            raise BadRequestError(f"weight update refused: {err}") from None

    def hold(self, held: dict[str, dict[str, torch.Tensor]], version: str | None) -> None:
        self.held, self.version = held, version

    def incomplete(self, when: str) -> str:
        """The error for held pieces at `when` (a push's end); drops them."""
        message = (f"{when} with {self.layout.describe_incomplete(self.held)}; a push must send every checkpoint "
                   "tensor of a fused tensor (all of a MoE layer's experts), in one update or across the buckets "
                   "of one weight version; the pieces are dropped and the engine keeps its weights for those tensors")
        self.held, self.version = {}, None
        return message

    def complete(self, weights: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
        """A full set of checkpoint-named `weights` (from `source`) under the model's names."""
        try:
            return self.layout.to_model(weights)
        except (IncompleteTensorError, UnknownPieceError) as err:
            raise BadRequestError(f"the weights of {source} do not fit the model: {err}") from None

    def to_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return to_checkpoint(self.layout.model, tensors)


def read_checkpoint(model_path: str | Path, weights_dir: str | Path | None) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in an HF directory inside `weights_dir` (symlinks resolved, so every
    file read lies inside it); ForbiddenError outside it, BadRequestError when it holds none."""
    if weights_dir is None:
        raise ForbiddenError("this engine loads no weights from disk: it was started without --weights-dir; start "
                             "it with --weights-dir DIR (the run's weights directory) and pass a directory inside it")
    root = os.path.realpath(weights_dir)
    directory = _inside(root, model_path, "model_path")
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise BadRequestError(
            f"model_path {str(model_path)!r} is not a directory with *.safetensors files; "
            "pass an HF checkpoint directory saved with save_pretrained(safe_serialization=True)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(_inside(root, file, "a weights file")))
    return tensors


def _inside(root: str, path: str | Path, what: str) -> Path:
    resolved = os.path.realpath(path)
    if os.path.commonpath([root, resolved]) != root:
        raise ForbiddenError(f"{what} {str(path)!r} is outside the engine's --weights-dir {root!r}; write the "
                             "weights under that directory (links are followed: their targets must be inside too)")
    return Path(resolved)


def check_finite(update: dict[str, torch.Tensor], serving: str) -> None:
    """Raise BadRequestError when a floating-point tensor of `update` holds NaN or Inf (`serving`: the version that
    keeps serving, for the message)."""
    bad = [name for name, t in update.items() if t.is_floating_point() and not all_finite(t)]
    if bad:
        raise BadRequestError(
            f"weight update refused: {len(bad)} of {len(update)} tensors hold NaN or Inf values (e.g. {bad[:3]}); "
            f"the engine keeps serving weight version {serving!r}. The trainer's weights diverged: check its loss "
            "and grad norm (a lower --lr, --clip-grad) or the checkpoint the weights came from"
        )


def update_body_limit(model: PreTrainedModel) -> tuple[int, str]:
    """The largest /update_weights_from_tensor body (bytes, how to fix): every tensor of the model in float32 (or
    its own wider dtype), plus room for the safetensors header."""
    tensors = model.state_dict()
    limit = sum(t.numel() * max(4, t.element_size()) for t in tensors.values()) + 2**20 + 512 * len(tensors)
    return limit, "send only the served model's tensors, in float32 or narrower"


def apply_update(model: PreTrainedModel, update: dict[str, torch.Tensor], borrowed: frozenset[int] = frozenset(),
                 adopt: bool = False) -> frozenset[int]:
    """Put checked tensors into the model (cast to its dtype and device); tied tensors share storage.

    `adopt`: a parameter whose update has its dtype and device becomes a view of the update's tensor (no copy; the
    caller guarantees nobody writes that memory while the model serves from it: a trainer's shared segment).
    `borrowed`: the ids of parameters that are such views now; one updated without adoption gets storage of its own
    again instead of being written through. Returns the ids of the parameters that are views afterwards.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    own = model.state_dict()
    views = set(borrowed)
    with torch.no_grad():
        for name, tensor in update.items():
            param = params.get(name)
            if param is None:  # a buffer
                own[name].copy_(tensor.to(dtype=own[name].dtype, device=own[name].device))
            elif adopt and tensor.dtype == param.dtype and tensor.device == param.device and tensor.is_contiguous():
                param.data = tensor
                views.add(id(param))
            elif id(param) in views:
                param.data = torch.empty_like(param.data, memory_format=torch.contiguous_format).copy_(tensor)
                views.discard(id(param))
            else:
                param.data.copy_(tensor.to(dtype=param.dtype, device=param.device))
    return frozenset(views)


def free_weights(model: PreTrainedModel) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Drop every parameter's storage (each becomes an empty tensor of its dtype, the module tree stays) and hand the
    freed pages back to the OS; returns each parameter's shape and dtype, for `restore_weights`."""
    shapes = {}
    for name, param in model.named_parameters():  # a tied parameter is listed once
        shapes[name] = (param.shape, param.dtype)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    trim_heap()
    return shapes


def restore_weights(model: PreTrainedModel, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                    weights: dict[str, torch.Tensor]) -> None:
    """Allocate the parameters `free_weights` dropped and fill them from `weights` (HF names; BadRequestError, with
    nothing allocated, unless they cover every parameter with the right shapes)."""
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise BadRequestError(f"the weights to resume from lack {len(missing)} of the model's tensors, e.g. "
                              f"{missing[:3]}; give a full checkpoint")
    check_update({name: torch.empty(shape, device="meta") for name, (shape, _) in shapes.items()},
                 {name: weights[name] for name in shapes})
    params = dict(model.named_parameters())
    for name, (shape, dtype) in shapes.items():
        params[name].data = torch.empty(shape, dtype=dtype, device=params[name].device)
    apply_update(model, {name: weights[name] for name in shapes})


def read_own_checkpoint(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of the directory the engine itself was started from (or last loaded by
    /update_weights_from_disk, inside --weights-dir): no --weights-dir check, the engine chose this path."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise BadRequestError(f"{model_path} holds no *.safetensors files to resume the weights from")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors

