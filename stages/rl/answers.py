"""Finding the answer in a response, and deciding mathematical equivalence with math-verify on any thread.

math-verify bounds its parsing and verification time with signal.alarm, which only works in the main thread (it
raises ValueError elsewhere). MathJudge uses those timeouts on the main thread and, on any other thread (a Ray
async actor's event loop, asyncio.to_thread, a thread pool), runs the same check in a worker process whose main
thread can use them, with a wall-clock backstop that kills a stuck worker.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    r"""The content of the last \boxed{...} (or \fbox{...}, or `\boxed 5`) in `text`, braces matched; else None."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    if start >= len(text):
        return None
    if text[start] != "{":
        word = re.match(r"[^\s$]+", text[start:])
        return word.group(0) if word else None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return None


def after_thinking(response: str) -> str | None:
    """The part after the reasoning (`</think>` or `###Response`), or None when the response has no such marker."""
    for marker in ("</think>", "###Response"):
        if marker in response:
            return response.split(marker, 1)[1]
    return None


def _verify(pred: str, gold: str, timeout_s: int) -> bool:
    """math-verify equivalence of a predicted answer and a gold answer (both bare answers, LaTeX or plain)."""
    # Imported here: math-verify brings sympy and mpmath (0.3 s), which every Ray process of the loop would import
    # at start-up for rewards (prefix_match, f1, a custom one) that never call it.
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout_s) or parse(gold, parsing_timeout=timeout_s)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout_s)
    if not gold_parsed or not pred_parsed:
        # Neither side is mathematics math-verify can read (a word, say): only an exact match counts.
        return pred.strip() == gold.strip()
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


class MathJudge:
    """Answer equivalence through math-verify, with a timeout that holds on any thread.

    On the main thread math-verify's own timeouts apply (a timeout counts as not equal, math-verify's rule). On
    other threads the check runs in one spawned worker process (started on first use, ~1 s); a check that
    outlives `backstop_s` (default 3 x `timeout_s` + 30 s) kills the worker, counts as not equal, and the next check starts a new one.
    Close the judge (or use it as a context manager) to stop the worker.
    """

    def __init__(self, timeout_s: int = 5, backstop_s: float | None = None):
        if timeout_s < 1:
            raise ValueError(f"the math-verify timeout must be >= 1 second, got {timeout_s}")
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
        # The worker's main thread applies math-verify's timeouts; this outer bound covers its start-up too.
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
