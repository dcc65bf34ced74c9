"""Experts as transformers holds them in memory versus as checkpoints name them.

transformers 5 keeps each MoE layer's experts fused (`mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden],
`mlp.experts.down_proj` [experts, hidden, ffn]); its save_pretrained, HF checkpoints and the converter's name map
have one tensor per expert and projection (`mlp.experts.<e>.gate_proj.weight`, ...). The training backend reads and
writes checkpoints through these two functions, which are exact inverses.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def split_experts(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory names -> checkpoint names: each fused expert tensor becomes its experts' projections (views)."""
    out = {}
    for name, tensor in weights.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for expert, piece in enumerate(tensor.unbind(0)):
            if kind == "down_proj":
                out[f"{prefix}.{expert}.down_proj.weight"] = piece
            else:  # [gate; up] on dim 0, as transformers' experts chunk it
                gate, up = piece.chunk(2, dim=0)
                out[f"{prefix}.{expert}.gate_proj.weight"], out[f"{prefix}.{expert}.up_proj.weight"] = gate, up
    return out


def fuse_experts(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> in-memory names: the inverse of split_experts. Experts must be numbered 0..E-1."""
    out, experts = {}, {}
    for name, tensor in weights.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            prefix, expert, kind = match.groups()
            experts.setdefault(prefix, {}).setdefault(int(expert), {})[kind] = tensor
    for prefix, by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{prefix}: experts {sorted(by_expert)} are not numbered 0..{len(by_expert) - 1}")
        ordered = [by_expert[e] for e in range(len(by_expert))]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]]) for p in ordered])
        out[f"{prefix}.down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    return out
