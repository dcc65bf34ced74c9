"""slime.utils.async_utils: `run(coro)` on one background event loop, for slime's synchronous rollout functions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

__all__ = ["get_async_loop", "run"]


class AsyncLoopThread:
    """An event loop running forever in a daemon thread; `run` blocks until a coroutine finishes on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="slime-async-loop")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_loop: AsyncLoopThread | None = None
_lock = threading.Lock()


def get_async_loop() -> AsyncLoopThread:
    """The process's background loop (started on first use)."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = AsyncLoopThread()
    return _loop


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` on the background loop and return its result."""
    return get_async_loop().run(coro)
