"""The scheduler's waiting requests, one lane per call, admitted round-robin between calls.

A single /generate of thousands of prompts used to queue ahead of every later call (and of /health_generate's
probe) until its last prompt started: minutes of waiting for a one-token request. Taking one prompt from each
lane in turn lets a later call start as soon as a slot frees, while one call alone (a rollout's batch) is still
admitted in its own order.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar


class _Waiting(Protocol):
    arrived: float
    ends_batch: bool


T = TypeVar("T", bound=_Waiting)


class Lanes(Generic[T]):
    """FIFO within a lane (one call's requests), round-robin between lanes; not thread-safe (the scheduler's)."""

    def __init__(self) -> None:
        self._lanes: collections.deque[tuple[int, collections.deque[T]]] = collections.deque()
        self._size = 0
        self._calls = 0  # lanes ever added: a lane's number says which call came last

    def add(self, items: list[T]) -> None:
        """One call's requests, as a lane of their own."""
        if items:
            self._calls += 1
            self._lanes.append((self._calls, collections.deque(items)))
            self._size += len(items)

    def take(self, count: int) -> list[T]:
        """Up to `count` requests, one per lane in turn, continuing from where the last take stopped."""
        taken: list[T] = []
        while len(taken) < count and self._lanes:
            lane = self._lanes.popleft()
            taken.append(lane[1].popleft())
            if lane[1]:
                self._lanes.append(lane)
        self._size -= len(taken)
        return taken

    def oldest_arrival(self) -> float:
        return min(lane[0].arrived for _, lane in self._lanes)

    def newest_ends_batch(self) -> bool:
        """Whether the latest call still waiting came as one batch whose last request is still here (nothing else
        of it is coming: no reason to hold it for the admission window)."""
        return max(self._lanes, key=lambda lane: lane[0])[1][-1].ends_batch

    def remove(self, gone: Callable[[T], bool]) -> None:
        kept = ((number, collections.deque(item for item in lane if not gone(item))) for number, lane in self._lanes)
        self._lanes = collections.deque(lane for lane in kept if lane[1])
        self._size = sum(len(lane) for _, lane in self._lanes)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[T]:
        for _, lane in self._lanes:
            yield from lane
