"""slime.rollout.fully_async_rollout: slime's fully-async rollout function
(`--rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async`).

A background thread keeps `sglang_server_concurrency x engines` groups in flight through `generate_and_rm_group`
(slime.rollout.sglang_rollout's: --custom-generate-function-path and --custom-rm-path apply) across rollout
boundaries. Each rollout takes the oldest `rollout_batch_size` finished groups (ordered by sample index) and leaves
the rest queued for the next one; a group that comes back ABORTED (weights changed under it) goes back to the data
source instead of to training. The finished-group queue is unbounded because its producer is the worker's event
loop (a blocking put would stall every generation); the worker stops taking prompts while a full pool of finished
groups waits, which bounds it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from slimeflow.slime_compat.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slimeflow.slime_compat.utils.async_utils import run
from slimeflow.slime_compat.utils.http_utils import get_rollout_num_engines
from slimeflow.slime_compat.utils.types import Sample

__all__ = ["AsyncRolloutWorker", "generate_rollout_fully_async"]

logger = logging.getLogger(__name__)
COLLECT_POLL_S = 0.05
DRAIN_TIMEOUT_S = 30.0

_global_worker: AsyncRolloutWorker | None = None
_worker_lock = threading.Lock()


class AsyncRolloutWorker:
    """Generates groups from `data_buffer` (slime's data-source API) on its own thread, `concurrency` at a time."""

    def __init__(self, args: Any, data_buffer: Any, concurrency: int = 10) -> None:
        self.args = args
        self.data_buffer = data_buffer
        self.concurrency = concurrency
        self.running = True
        self.output_queue: queue.Queue[tuple[int, list[Sample]]] = queue.Queue()
        self.poll_interval = 1.0
        self.worker_thread: threading.Thread | None = None
        self.state = GenerateState(args)

    def start(self) -> None:
        if self.worker_thread is None or not self.worker_thread.is_alive():
            self.running = True
            self.worker_thread = threading.Thread(target=lambda: asyncio.run(self._loop()),
                                                  name="fully-async-rollout", daemon=True)
            self.worker_thread.start()

    def stop(self) -> None:
        self.running = False
        if self.worker_thread is not None and self.worker_thread.is_alive():
            self.worker_thread.join(timeout=DRAIN_TIMEOUT_S / 6)

    def queue_size(self) -> int:
        return self.output_queue.qsize()

    def get_completed_groups(self, limit: int | None = None) -> list[tuple[int, list[Sample]]]:
        """Up to `limit` (all when None) finished (group id, group), oldest first, taken off the queue."""
        taken: list[tuple[int, list[Sample]]] = []
        while limit is None or len(taken) < limit:
            try:
                taken.append(self.output_queue.get_nowait())
            except queue.Empty:
                break
        return taken

    async def _loop(self) -> None:
        in_flight: set[asyncio.Task] = set()
        next_id = 0
        while self.running:
            for task in [t for t in in_flight if t.done()]:
                in_flight.discard(task)
            while self.running and len(in_flight) < self.concurrency and self.queue_size() < self.concurrency:
                groups = self.data_buffer.get_samples(1)
                if not groups:
                    break
                for group in groups:
                    task = asyncio.ensure_future(generate_and_rm_group(
                        self.args, group, sampling_params=dict(self.state.sampling_params), evaluation=False))
                    task.add_done_callback(self._make_done_cb(next_id))
                    in_flight.add(task)
                    next_id += 1
            await asyncio.sleep(self.poll_interval)
        if in_flight:
            await asyncio.wait(in_flight, timeout=DRAIN_TIMEOUT_S)

    def _make_done_cb(self, group_id: int) -> Callable[[Any], None]:
        """The callback that routes one finished generation: to the queue, or (aborted) back to the data source.
        It runs on the worker's event loop, so it never blocks."""
        def done(task: Any) -> None:
            try:
                group = task.result()
            except Exception:
                logger.exception("fully-async rollout: group %d failed; it is dropped", group_id)
                return
            if not isinstance(group, list):
                logger.warning("fully-async rollout: generate_and_rm_group returned %s for group %d, not a list of "
                               "samples; dropped", type(group).__name__, group_id)
            elif any(s.status is Sample.Status.ABORTED for s in group):
                self.data_buffer.add_samples([group])
            else:
                self.output_queue.put((group_id, group))
        return done


def _get_global_worker(args: Any, data_buffer: Any) -> AsyncRolloutWorker:
    """The process's worker (started on first use, and again if its thread died)."""
    global _global_worker
    with _worker_lock:
        if _global_worker is None or _global_worker.worker_thread is None \
                or not _global_worker.worker_thread.is_alive():
            concurrency = args.sglang_server_concurrency * max(1, get_rollout_num_engines(args))
            _global_worker = AsyncRolloutWorker(args, data_buffer, concurrency=concurrency)
            _global_worker.start()
        return _global_worker


@atexit.register
def _stop_global_worker() -> None:
    global _global_worker
    with _worker_lock:
        if _global_worker is not None:
            _global_worker.stop()
            _global_worker = None


def _first_index(group: list[Sample]) -> int:
    return next((int(s.index) for s in group if s.index is not None), 0)


async def _generate_rollout_async(args: Any, rollout_id: int, data_buffer: Any) -> list[list[Sample]]:
    """The oldest rollout_batch_size finished groups, waiting for them as needed, ordered by sample index."""
    if not getattr(args, "rollout_global_dataset", True):
        raise ValueError("the fully-async rollout draws prompts from the global data source; "
                         "--rollout-global-dataset must be on")
    worker = _get_global_worker(args, data_buffer)
    collected: list[list[Sample]] = []
    while len(collected) < args.rollout_batch_size:
        taken = worker.get_completed_groups(limit=args.rollout_batch_size - len(collected))
        collected += [group for _, group in taken]
        if not taken:
            await asyncio.sleep(COLLECT_POLL_S)
    logger.info("fully-async rollout %d: %d groups, %d left queued", rollout_id, len(collected),
                worker.queue_size())
    return sorted(collected, key=_first_index)


def generate_rollout_fully_async(args: Any, rollout_id: int, data_buffer: Any,
                                 evaluation: bool = False) -> list[list[Sample]]:
    """The --rollout-function-path entry point (training rollouts only)."""
    if evaluation:
        raise ValueError("the fully-async rollout does not evaluate; leave --eval-function-path unset for "
                         "slimeflow's evaluation")
    return run(_generate_rollout_async(args, rollout_id, data_buffer))
