"""The process group that carries weights from a trainer to engines, as SGLang's /init_weights_update_group makes one.

Rank 0 is the trainer (it hosts the rendezvous store at master_address:master_port); engine `i` joins as
`rank_offset + i`. Weights go by broadcast from rank 0, one tensor at a time, in the order the names were sent
(SGLang's /update_weights_from_distributed contract). On a CPU the backend is gloo; SGLang's nccl needs GPUs and is
refused by name here. Built from torch's public ProcessGroupGloo and TCPStore, so that neither side needs a default
(world) process group: a trainer rank already in one, and an engine in none, both join.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo",)
DEFAULT_TIMEOUT_S = 300.0
"""How long a rendezvous or one broadcast may wait for the other side before failing (not hanging)."""


def parse_dtype(name: str) -> torch.dtype:
    """torch's dtype for SGLang's spelling ('bfloat16', 'float32'; 'torch.' prefix allowed); ValueError otherwise."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dtype


@dataclass
class WeightGroup:
    """One rank's membership of a weight-update group; `broadcast` from rank 0, `close` to leave."""

    name: str
    rank: int
    world_size: int
    store: dist.Store
    group: dist.ProcessGroupGloo

    @classmethod
    def join(cls, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str = "gloo", host: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> WeightGroup:
        """Join (rank 0: create) the group; returns once all `world_size` ranks have joined, or raises after
        `timeout_s`. `host`: this rank's own address for gloo's connections (default: master_address)."""
        if backend not in BACKENDS:
            raise ValueError(f"weight-update group backend {backend!r} is not available here: the embedded engine "
                             f"runs on CPU, where the group is {' or '.join(BACKENDS)} (nccl is SGLang's, on GPUs)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host or master_address)]
        group = dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank, world_size, options)
        return cls(group_name, rank, world_size, store, group)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0 sends `tensor`; every other rank receives into it (contiguous, CPU)."""
        self.group.broadcast(tensor, 0).wait()

    def close(self) -> None:
        # Dropping the references closes gloo's connections; the store's server goes with rank 0's object.
        self.group = self.store = None  # type: ignore[assignment]
