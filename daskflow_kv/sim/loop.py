"""The event loop: timed callbacks on a virtual clock, in time order (ties: in the order set)."""

from __future__ import annotations

import heapq


class EventLoop:
    __slots__ = ("now", "_heap", "_seq", "events")

    def __init__(self):
        self.now = 0.0  # virtual s
        self._heap: list = []  # (time, seq, fn, args)
        self._seq = 0  # tie-breaker: same time, first set runs first
        self.events = 0  # callbacks run so far

    def at(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))

    def after(self, dt: float, fn, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = float("inf")) -> float:
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)
        return self.now
