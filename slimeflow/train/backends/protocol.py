"""The one protocol every training backend implements, as slime's actor is one abstract trainer over Megatron and FSDP.

A backend is one training rank: it builds its share of the policy (and of the frozen reference model and OPD teacher)
from the run's config, computes log-probs, runs the forward/backward and the optimizer step that train_step drives,
saves and loads its own checkpoints, exports HF-named weights for the weight sync and names the tensors that
--offload-train moves off its device. The train actor and train_step call nothing else, so a backend is chosen by
name (`slimeflow.train.backends.build_backend`) and never asked what it is.

This module stays free of torch at run time (the driver imports the registry beside it): every type that needs torch
is named under TYPE_CHECKING.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self, TypedDict

if TYPE_CHECKING:
    import torch

    from slimeflow.config.train import AlgorithmConfig, BatchConfig, OptimizerConfig, TrainConfig
    from slimeflow.io.checkpoints import CheckpointRef
    from slimeflow.rollout.types import TrainBatch
    from slimeflow.train.backends.common import LogProbs
    from slimeflow.train.loss import LossOutput, LossPlugins
    from slimeflow.train.train_hooks import TrainHooks


class RankArgs(TypedDict):
    """What every backend's constructor takes from the run and the rank's place in it (`build_backend` fills it)."""

    optimizer: OptimizerConfig
    algorithm: AlgorithmConfig
    batch: BatchConfig
    seed: int
    rank: int
    world_size: int
    init_method: str | None
    total_steps: int
    ref_load: str | None
    temperature: float
    plugin_args: Any
    """slime's args, which a custom TIS function is handed; None without one."""


class Backend(Protocol):
    """One training rank. Collective methods (every rank of the world calls them in the same order) say so."""

    @classmethod
    def build(cls, config: TrainConfig, hf_checkpoint: str, args: RankArgs, hooks: TrainHooks | None) -> Self:
        """This rank's backend for the run `config` (model, optimizer, schedule, frozen models, plug-ins), before
        any checkpoint is loaded. `hooks`: slime's hooks into its training actor. ValueError for a run it cannot
        build."""
        ...

    # -- what train_step and slime's hooks read -------------------------------------------------------------------

    @property
    def device(self) -> torch.device: ...

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int:
        """The data-parallel world: the ranks that split each global batch (all ranks but model-parallel ones)."""
        ...

    @property
    def data_parallel_group(self) -> Any:
        """The data-parallel process group (None: the default group)."""
        ...

    @property
    def plugins(self) -> LossPlugins: ...

    @property
    def needs_reference(self) -> bool:
        """Whether train_step asks for the reference model's log-probs (--use-kl-loss, --kl-coef > 0)."""
        ...

    @property
    def model(self) -> Any:
        """The policy as slime's hooks get it: a module, or Megatron's list of model chunks."""
        ...

    @property
    def ref_model(self) -> Any:
        """The frozen reference model (None when not needed)."""
        ...

    @property
    def teacher_model(self) -> Any:
        """The frozen OPD teacher (None without --opd-type megatron)."""
        ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def scheduler(self) -> Any: ...

    # -- the train step -------------------------------------------------------------------------------------------

    def micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """The micro-batches (sample indices) this rank runs its share in (`lengths`: each sample's tokens)."""
        ...

    def compute_log_probs(self, batch: TrainBatch, with_entropy: bool = False, reference: bool = False,
                          teacher: bool = False, steps: list[list[list[int]]] | None = None) -> LogProbs:
        """Response-token log-probs (fp32, CPU) of every sample under the policy, reference model or teacher;
        `steps`: each training step's micro-batches, so the log-probs are the training forward's bit for bit."""
        ...

    def forward_backward(self, batch: TrainBatch, micro_batches: list[list[int]],
                         loss_of: Callable[[list[int], LogProbs], LossOutput]) -> dict[str, float]:
        """Forward (with entropies) and backward over `micro_batches`, each one's loss from `loss_of`; the loss
        metrics summed over micro-batches and data-parallel ranks. Collective."""
        ...

    def optimizer_step(self) -> dict[str, float]:
        """Reduce and clip the gradients, step the optimizer and schedule, zero the gradients; grad_norm and lr.
        Collective."""
        ...

    # -- checkpoints, weights, memory -----------------------------------------------------------------------------

    def save_checkpoint(self, root: str | Path, rollout_id: int, extra_state: dict[str, Any],
                        before_commit: Callable[[], None] | None = None, async_save: bool = False) -> CheckpointRef:
        """Save `<root>/iter_{rollout_id:07d}` in torch_dist layout with everything a resume needs and commit it;
        `before_commit` runs just before the commit and may abandon it by raising. Collective. A previous
        `async_save`'s commit is waited for first (its error raised). With `async_save` (--async-save) it returns
        once what it writes is a consistent copy that training cannot change; the rest (hashes, fsyncs, the rename
        and the tracker, in the synchronous save's order) runs in the background until `wait_for_save`."""
        ...

    def wait_for_save(self) -> None:
        """Until this rank's --async-save commit in flight (if any) has ended; CheckpointError, from its cause, when
        it failed (the previous checkpoint then stays the latest). Not collective: a rank without one returns."""
        ...

    def load_checkpoint(self, ref_or_uri: CheckpointRef | str | Path, weights_only: bool = False) -> dict[str, Any]:
        """Restore the checkpoint (its weights only, or everything); the extra_state it was saved with ({} for
        weights only). CheckpointError for a damaged one. Every rank calls it."""
        ...

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The policy's HF-named weights for the weight sync, on the rank that pushes them ({} on the others).
        Collective."""
        ...

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this rank holds on its device: what --offload-train moves off it and brings back."""
        ...

    def close(self) -> None:
        """Release the process group (and parallel state) this backend set up."""
        ...


if TYPE_CHECKING:
    # Both backends must stay assignable to the protocol: mypy checks these two lines.
    from slimeflow.train.backends.megatron.backend import MegatronBackend
    from slimeflow.train.backends.torch.backend import TorchBackend

    def _torch_is_a_backend(backend: TorchBackend) -> Backend:
        return backend

    def _megatron_is_a_backend(backend: MegatronBackend) -> Backend:
        return backend
