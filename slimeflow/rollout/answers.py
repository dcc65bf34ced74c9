"""Deciding mathematical equivalence with slime's grader (math_grader.grade) in bounded time, on any thread.

The grader ends in sympy.simplify, which can run for minutes on an unlucky expression. MathJudge bounds each check:
on the main thread with SIGALRM, on any other thread (a Ray async actor's event loop, asyncio.to_thread, a thread
pool) in a worker process whose main thread can use SIGALRM, with a wall-clock backstop that kills a stuck worker.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from typing import Any

from slimeflow.rollout.math_grader import grade


class _CheckTimedOut(BaseException):
    """Raised by SIGALRM inside a check; a BaseException so the grader's `except Exception` cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _CheckTimedOut


def _verify(pred: str, gold: str, timeout_s: int) -> bool:
    """slime's grading of a predicted answer against a gold one (both bare answers); False past `timeout_s`.

    Must run on a main thread (SIGALRM)."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout_s)
    try:
        return grade(pred, gold)
    except _CheckTimedOut:
        return False
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class MathJudge:
    """Answer equivalence through slime's grader, with a timeout that holds on any thread.

    On the main thread the check runs here under SIGALRM (a timeout counts as not equal; slime's grader has no
    timeout). On other threads it runs in one spawned worker process (started on first use, ~1 s); a check that
    outlives `backstop_s` (default 3 x `timeout_s` + 30 s) kills the worker, counts as not equal, and the next
    check starts a new one. Close the judge (or use it as a context manager) to stop the worker.
    """

    def __init__(self, timeout_s: int = 5, backstop_s: float | None = None):
        if timeout_s < 1:
            raise ValueError(f"the grading timeout must be >= 1 second, got {timeout_s}")
        self.timeout_s = timeout_s
        self.backstop_s = 3 * timeout_s + 30 if backstop_s is None else backstop_s
        self._pool: Any = None
        self._lock = threading.Lock()
        self.worker_timeouts = 0

    def equal(self, pred: str, gold: str) -> bool:
        """Whether `pred` and `gold` are the same mathematical answer."""
        if threading.current_thread() is threading.main_thread():
            return _verify(pred, gold, self.timeout_s)
        with self._lock:
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(processes=1)
            pool = self._pool
        # The worker's main thread applies the SIGALRM timeout; this outer bound covers its start-up too.
        pending = pool.apply_async(_verify, (pred, gold, self.timeout_s))
        try:
            return pending.get(timeout=self.backstop_s)
        except multiprocessing.TimeoutError:
            with self._lock:
                if self._pool is pool:
                    pool.terminate()
                    self._pool = None
                self.worker_timeouts += 1
            return False

    def close(self) -> None:
        """Stop the worker process, if one was started."""
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool.join()
                self._pool = None

    def __enter__(self) -> MathJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
