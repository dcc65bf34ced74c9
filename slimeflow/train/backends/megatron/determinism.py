"""--deterministic-mode in one training process: the process-wide switches Megatron-LM and slime turn on for it.

megatron-core's own part is a TransformerConfig field (deterministic code paths: the embedding's gather instead of
F.embedding, Transformer Engine attention that insists on NVTE_ALLOW_NONDETERMINISTIC_ALGO=0). Around it Megatron-LM
calls torch.use_deterministic_algorithms(True) and asserts a deterministic NCCL_ALGO; slime's initialisation turns
cuDNN's deterministic mode on and its autotuner off, and its reproducibility guide sets NCCL_ALGO, cuBLAS's
workspace and Transformer Engine's switch in the trainers' environment. NCCL, cuBLAS and Transformer Engine read
only environment variables, so on a GPU an unset one is given slime's value here, before the backend creates its
process group and runs its first kernel, and a value that allows non-deterministic algorithms is refused by name.
On a CPU (gloo, no cuBLAS, no Transformer Engine) the variables mean nothing and are left alone.

The switches are the process's, so `DeterministicMode.enter` records what it changed and `exit` puts it back: a
trainer holds them for its backend's lifetime (MegatronBackend.close restores them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

NCCL_ALGORITHMS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
"""The NCCL_ALGO values Megatron-LM accepts in deterministic mode (one fixed reduction order)."""
CUBLAS_WORKSPACES = (":4096:8", ":16:8")
"""The cuBLAS workspace settings under which torch's deterministic mode allows cuBLAS (torch's documentation)."""
GPU_ENVIRONMENT: dict[str, tuple[str, tuple[str, ...]]] = {
    # variable: (the value set when it is unset, as slime's reproducibility guide sets it; the values allowed)
    "NCCL_ALGO": ("Ring", NCCL_ALGORITHMS),
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", CUBLAS_WORKSPACES),
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0", ("0",)),
}


def environment_problems(environ: Mapping[str, str]) -> list[str]:
    """The GPU environment variables set to values that let NCCL, cuBLAS or Transformer Engine choose
    non-deterministic algorithms under --deterministic-mode (unset ones are fine: the trainer sets them)."""
    return [f"--deterministic-mode: {name}={environ[name]!r} allows non-deterministic algorithms; set it to one of "
            f"{', '.join(allowed)} in the trainers' environment, or unset it (the trainer then sets {default})"
            for name, (default, allowed) in GPU_ENVIRONMENT.items()
            if name in environ and environ[name] not in allowed]


@dataclass
class DeterministicMode:
    """What --deterministic-mode changed in this process, to be put back by `exit`."""

    algorithms: tuple[bool, bool]
    """torch's deterministic-algorithms switch and its warn-only flag, before."""
    cudnn: tuple[bool, bool]
    """torch.backends.cudnn's deterministic and benchmark flags, before."""
    environment: tuple[str, ...]
    """The variables this process did not have and `enter` set."""

    @classmethod
    def enter(cls, cuda: bool) -> DeterministicMode:
        """Turn the switches on (with the GPU environment when `cuda`); ValueError naming a variable whose value
        allows non-deterministic algorithms, before anything is changed."""
        import torch  # here: the driver's flag checks (kernels.py) import this module and stay free of torch

        problems = environment_problems(os.environ) if cuda else []
        if problems:
            raise ValueError("; ".join(problems))
        added = tuple(name for name in GPU_ENVIRONMENT if cuda and name not in os.environ)
        algorithms = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        state = cls(algorithms, (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark), added)
        for name in added:
            os.environ[name] = GPU_ENVIRONMENT[name][0]
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        return state

    def exit(self) -> None:
        import torch  # here: see enter

        torch.use_deterministic_algorithms(self.algorithms[0], warn_only=self.algorithms[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = self.cudnn
        for name in self.environment:
            os.environ.pop(name, None)
