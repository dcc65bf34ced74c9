"""Training steps of the Megatron backend in worker processes (one per rank), for tests and benchmarks.

`run_world` runs a world of `world` ranks (file:// rendezvous, bounded by a timeout) that each build a
MegatronBackend at the given TP x PP, load a torch_dist checkpoint and train on one saved batch; global rank 0
writes the per-step metrics and the full HF-named weights afterwards to `<out>/<tag>.pt`.

The ranks run in fresh spawned processes, or, once `use_rank_pool()` was called (the test session does), in a
RankPool's: processes spawned once that run one world after another. A spawned rank spends ~5 s of CPU importing
torch, megatron-core and transformers before its first step, more than the tiny model's whole job; the suite runs
some forty worlds. Every job builds and closes its own backend (process group and megatron's parallel state
included), as a backend in one process after another does in the tests that run in-process.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LR = 1e-3
"""The tests' learning rate: Adam's first step moves a weight by about this much."""

LENGTHS = [(7, 3), (9, 4), (5, 2), (12, 5), (6, 3), (10, 1), (8, 4), (11, 6)]
"""(prompt + response tokens, response tokens) of the test rollout: 4 groups of 2."""


def make_batch(seed: int = 0):
    from slimeflow.rollout.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, 250, (total,), generator=g) for total, _ in LENGTHS]
    masks = [torch.ones(n) for _, n in LENGTHS]
    masks[3][1] = 0.0  # a tool token inside a response
    rewards = [float(i % 3 == 0) for i in range(len(LENGTHS))]
    return TrainBatch(tokens=tokens, response_lengths=[n for _, n in LENGTHS], loss_masks=masks,
                      rewards=torch.tensor(rewards), rollout_log_probs=[-torch.rand(n, generator=g) for _, n in LENGTHS])


def make_config(**groups):
    from slimeflow.config.train import TrainConfig

    batch = {"rollout_batch_size": 4, "n_samples_per_prompt": 2, "num_rollout": 1, **groups.pop("batch", {})}
    return TrainConfig(batch=batch, **groups)


def rollout_batch(hf: Path):
    """The test rollout, its rollout log-probs those of the HF model (what an engine serving it samples from)."""
    from slimeflow.train.backends.torch.backend import TorchBackend

    config = make_config()
    batch = make_batch()
    torch_backend = TorchBackend(hf, config.optimizer, config.algorithm, config.batch, seed=3, device="cpu")
    batch.rollout_log_probs = torch_backend.compute_log_probs(batch).log_probs
    return batch


def two_step_config(**megatron):
    """Two optimizer steps per rollout (so the old log-probs come from a forward of their own), the KL loss
    against the reference model, micro-batches of 2."""
    return make_config(batch={"micro_batch_size": 2, "global_batch_size": 4}, optimizer={"lr": LR},
                       algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1}, megatron=megatron)


def train_steps(backend, batch, config, rank: int, world_size: int) -> list[dict[str, float]]:
    """train_on_rollout's steps, each step's metrics kept (it averages them)."""
    from slimeflow.train.train_step import accumulate_gradients, plan_steps, prepare

    plan = plan_steps(batch, config.batch.global_batch_size, rank, world_size, config.batch.balance_data)
    prepared = prepare(backend, batch, config, [share for _, share in plan], world_size, single_step=len(plan) == 1)
    return [{**accumulate_gradients(backend, batch, indices, share, prepared, config), **backend.optimizer_step()}
            for indices, share in plan]


def train_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """Build the backend of `rank`, load the job's checkpoint (its weights; everything with job["resume"]), train;
    rank 0's steps, weights, optimizer parameter groups and model chunk count (None on the other ranks). With
    job["save"]: save after the batch as rollout 0 under that root, then train on job["next_batch"] (the steps
    and weights returned are that batch's: an uninterrupted run)."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint, save_checkpoint

    config = job["config"]
    backend = make_backend(job, rank, world)
    try:
        load_checkpoint(backend, job["checkpoint"], weights_only=not job.get("resume", False))
        steps = train_steps(backend, job["batch"], config, backend.dp_rank, backend.dp_size)
        if "save" in job:
            first = steps
            save_checkpoint(backend, job["save"], 0, {"rollout_id": 0})
            steps = train_steps(backend, job["next_batch"], config, backend.dp_rank, backend.dp_size)
        weights = backend.named_weights()
        groups = [{"weight_decay": g["weight_decay"], "dims": sorted({p.dim() for p in g["params"]})}
                  for g in backend.optimizer.param_groups]
        chunks = len(backend.model)
    finally:
        backend.close()
    result = {"steps": steps, "weights": weights, "groups": groups, "chunks": chunks}
    if "save" in job:
        result["first_steps"] = first
    return result if rank == 0 else None


def make_backend(job: dict[str, Any], rank: int = 0, world: int = 1):
    """The job's MegatronBackend for `rank` (its model shape from the job's checkpoint; nothing loaded yet)."""
    from slimeflow.train.backends.megatron.backend import MegatronBackend

    config = job["config"]
    return MegatronBackend(job["hf"], job["checkpoint"], config.optimizer, config.algorithm, config.batch,
                           config.megatron, seed=3, rank=rank, world_size=world, init_method=job["init"],
                           ref_load=job.get("ref_load", job["checkpoint"]) if config.algorithm.use_kl_loss else None,
                           hooks=job.get("hooks"))


def _worker(rank: int, world: int, job: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    result = job["work"](rank, world, job)
    if result is not None:
        torch.save(result, Path(job["out"]) / f"{job['tag']}.pt")


def make_job(out: Path, tag: str, hf: Path, checkpoint: Path, batch, config) -> dict[str, Any]:
    return {"hf": str(hf), "checkpoint": str(checkpoint), "batch": batch, "config": config, "out": str(out),
            "tag": tag, "init": (out / f"rendezvous-{uuid.uuid4().hex[:8]}").as_uri()}


def run_world(world: int, tag: str, out: Path, hf: Path, checkpoint: Path, batch, config,
              timeout: float = 240.0, work: Callable[[int, int, dict[str, Any]], Any] = train_job,
              **extra: Any) -> dict[str, Any]:
    """Train in `world` ranks; rank 0's {'steps': [...], 'weights': {...}}. `work(rank, world, job)` runs in each
    (a module-level function; the job holds `extra` too) and rank 0's result is returned."""
    job = {**make_job(out, tag, hf, checkpoint, batch, config), "work": work, **extra}
    if _POOL.enabled:
        _POOL.run(world, job, timeout)
    else:
        _spawn_world(world, job, timeout)
    return torch.load(out / f"{tag}.pt", weights_only=False)


def _spawn_world(world: int, job: dict[str, Any], timeout: float) -> None:
    import torch.multiprocessing as mp

    context = mp.start_processes(_worker, args=(world, job), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job['tag']}: {world} ranks did not finish in {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def _serve(inbox: Any, outbox: Any) -> None:
    """A pool process: run (rank, world, job) tasks until None or until its parent is gone; report each as (rank,
    traceback or None). Not a daemonic process: megatron's checkpoint writer starts processes of its own."""
    parent = os.getppid()
    while True:
        try:
            task = inbox.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:  # the session died without closing the pool
                return
            continue
        if task is None:
            return
        rank, world, job = task
        try:
            _worker(rank, world, job)
            outbox.put((rank, None))
        except BaseException:  # reported to the caller, who then replaces the pool (other ranks may be stuck)
            outbox.put((rank, traceback.format_exc()))


class RankPool:
    """Spawned processes, started on first use, that run the ranks of one world after another (rank r in process r).

    A world that fails (a rank raises, or the world outlives its timeout) takes the pool down with it: its other
    ranks may wait in a collective forever. The next world starts a new one."""

    def __init__(self) -> None:
        self.enabled = False
        self.processes: list[Any] = []
        self.inboxes: list[Any] = []
        self.outbox: Any = None

    def _grow(self, size: int) -> None:
        context = multiprocessing.get_context("spawn")
        if self.outbox is None:
            self.outbox = context.Queue()
        while len(self.processes) < size:
            inbox = context.Queue()
            process = context.Process(target=_serve, args=(inbox, self.outbox))
            process.start()
            self.processes.append(process)
            self.inboxes.append(inbox)

    def run(self, world: int, job: dict[str, Any], timeout: float) -> None:
        self._grow(world)
        for rank in range(world):
            self.inboxes[rank].put((rank, world, job))
        deadline = time.monotonic() + timeout
        pending = set(range(world))
        try:
            while pending:
                try:
                    rank, error = self.outbox.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r in pending if not self.processes[r].is_alive()]
                    if dead:
                        raise RuntimeError(f"{job['tag']}: rank {dead[0]}'s process died (exit code "
                                           f"{self.processes[dead[0]].exitcode})") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{job['tag']}: {world} ranks did not finish in {timeout} s") from None
                    continue
                if error is not None:
                    raise RuntimeError(f"{job['tag']}: rank {rank} raised:\n{error}")
                pending.discard(rank)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every process of the pool (by pid: SIGKILL after a second's grace) and forget them."""
        for inbox, process in zip(self.inboxes, self.processes, strict=True):
            if process.is_alive():
                try:
                    inbox.put_nowait(None)
                except (ValueError, OSError):
                    pass
        for process in self.processes:
            process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        self.processes, self.inboxes, self.outbox = [], [], None


_POOL = RankPool()
atexit.register(_POOL.close)


def use_rank_pool(enabled: bool = True) -> RankPool:
    """Run the worlds of `run_world` in one reused set of processes from now on (see the module's docstring)."""
    _POOL.enabled = enabled
    if not enabled:
        _POOL.close()
    return _POOL
