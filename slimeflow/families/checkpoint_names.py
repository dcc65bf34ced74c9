"""A transformers model's tensors under the names of its HF checkpoint files versus as it holds them in memory.

transformers 5 converts keys when it loads and saves: a MoE layer's experts, one tensor per expert and projection
in a checkpoint (`mlp.experts.<e>.gate_proj.weight`, ...), are fused in memory (`mlp.experts.gate_up_proj`
[experts, 2 x ffn, hidden], `mlp.experts.down_proj`). Checkpoint names are slimeflow's one naming between
components (weight updates, checkpoints, the converter's name map); both directions here run transformers' own
conversion mapping for the model (conversion_mapping.get_model_conversion_mapping, the WeightConverter operations),
so they fuse and split exactly as from_pretrained and save_pretrained do, for every family transformers converts.
"""

from __future__ import annotations

from collections.abc import Mapping
from copy import deepcopy

import torch
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)


class IncompleteTensorError(ValueError):
    """Checkpoint tensors that make only part of a fused model tensor (some of its experts), with nothing to add."""


class UnknownPieceError(ValueError):
    """A checkpoint name that maps to a fused model tensor but is none of its pieces, or a piece of the wrong shape."""


def to_checkpoint(model: PreTrainedModel, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model (in-memory) names -> checkpoint names, as save_pretrained converts them. A tensor that keeps its name is
    the caller's (no copy); the pieces split off a fused tensor are copies (each owns its memory, so a safetensors
    file or a later in-place step of the fused parameter cannot tie them together)."""
    converted = revert_weight_conversion(model, dict(tensors))
    return {name: t if tensors.get(name) is t else t.clone() for name, t in converted.items()}


class CheckpointLayout:
    """Checkpoint names -> `model`'s names, as from_pretrained converts them, for full or partial updates.

    Built once per model (it reads only names, shapes and dtypes). `to_model` accepts the model's own names too (as
    from_pretrained does). A fused tensor is made once every checkpoint tensor it is made of has arrived: a caller
    that sends them across several updates passes the same `held` dict, which keeps the pieces in between.
    """

    def __init__(self, model: PreTrainedModel):
        self.model = model
        mapping = get_model_conversion_mapping(model)  # the list from_pretrained loads with
        self._renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        self._converters = [t for t in mapping if isinstance(t, WeightConverter)]
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}
        self._meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in model.state_dict().items()}
        pieces = revert_weight_conversion(model, self._meta)  # every checkpoint name, with its shape
        self.piece_shapes: dict[str, torch.Size] = {}
        grouped: dict[str, set[str]] = {}
        for name, tensor in pieces.items():
            target, pattern = self._rename(name)
            if pattern is not None:
                grouped.setdefault(target, set()).add(name)
                self.piece_shapes[name] = tensor.shape
        self.parts: dict[str, frozenset[str]] = {target: frozenset(names) for target, names in grouped.items()}
        """Each fused model tensor -> the checkpoint names it is made of."""

    def to_model(self, tensors: Mapping[str, torch.Tensor],
                 held: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
        """`tensors` under the model's names: renamed, and the fused tensors whose pieces are all there (in `tensors`
        and `held`) made. Pieces of fused tensors still incomplete stay in `held` (by fused name); without `held`,
        IncompleteTensorError names them. A name the model does not know is passed through unchanged (the caller's
        name check reports it); UnknownPieceError for a wrong expert number or piece shape."""
        keep = held if held is not None else {}
        out: dict[str, torch.Tensor] = {}
        for name in sorted(tensors, key=dot_natural_key):  # the order from_pretrained stacks experts in
            target, pattern = self._rename(name)
            if pattern is None or target not in self.parts:  # renamed, or unknown (kept for the caller to name)
                out[target if target in self._meta else name] = tensors[name]
                continue
            self._check_piece(name, target, tensors[name])
            pieces = keep.setdefault(target, {})
            pieces[name] = tensors[name]
            if len(pieces) == len(self.parts[target]):
                out.update(self._fuse(target, keep.pop(target)))
        if held is None and keep:
            raise IncompleteTensorError(self.describe_incomplete(keep))
        return out

    def describe_incomplete(self, held: Mapping[str, Mapping[str, torch.Tensor]]) -> str:
        """What `held` lacks, for an error: each fused tensor, how many of its pieces came and one that did not."""
        parts = []
        for target, pieces in sorted(held.items()):
            missing = sorted(self.parts[target] - set(pieces), key=dot_natural_key)
            parts.append(f"{target} has {len(pieces)} of its {len(self.parts[target])} checkpoint tensors "
                         f"(missing e.g. {missing[0]})")
        return (f"{len(held)} incomplete fused tensors: " + "; ".join(parts[:3])
                + ("; ..." if len(parts) > 3 else ""))

    def _rename(self, name: str) -> tuple[str, str | None]:
        """(model name, the converter pattern it matched or None), as from_pretrained renames a checkpoint key; a
        name of the model itself stays (the model's own names are accepted as they are)."""
        target, pattern = rename_source_key(name, self._renamings, self._converters, self.model.base_model_prefix,
                                            self._meta)
        if target not in self._meta and name in self._meta:
            return name, None
        return target, pattern

    def _check_piece(self, name: str, target: str, tensor: torch.Tensor) -> None:
        if name not in self.parts[target]:
            raise UnknownPieceError(f"{name} would be part of {target}, which is made of {len(self.parts[target])} "
                                    f"checkpoint tensors such as {min(self.parts[target], key=dot_natural_key)}; "
                                    "is the expert number within the model's experts?")
        if tensor.shape != self.piece_shapes[name]:
            raise UnknownPieceError(f"{name} has shape {tuple(tensor.shape)}; the model's checkpoint has "
                                    f"{tuple(self.piece_shapes[name])}")

    def _fuse(self, target: str, pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converter = None
        for name in sorted(pieces, key=dot_natural_key):
            _, pattern = self._rename(name)
            assert pattern is not None
            converter = converter or deepcopy(self._by_pattern[pattern])
            converter.add_tensor(target, name, pattern, pieces[name])
        assert converter is not None
        made = converter.convert(target, model=self.model, config=self.model.config)
        return {name: t[0] if isinstance(t, list) else t for name, t in made.items()}
