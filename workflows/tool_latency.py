"""An external tool's latency, emulated: a seeded delay before the real tool answers.

A search API or a code sandbox answers in seconds; the example tools answer in
microseconds. ``Slow(fn, Latency(seed, lo, hi))`` sleeps a delay drawn uniformly from
[lo, hi] by a hash of (seed, the tool, its argument) - the same call waits the same in
every system and mode - then returns ``fn``'s answer. Benchmarks label it EMULATED.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class Latency:
    seed: int  # one stream's draws
    lo: float  # s, shortest
    hi: float  # s, longest

    def seconds(self, tool: str, arg: str) -> float:
        h = hashlib.sha256(f"{self.seed}|{tool}|{arg}".encode()).digest()
        return self.lo + (self.hi - self.lo) * int.from_bytes(h[:8], "big") / 2**64


@dataclass(frozen=True, slots=True)
class Slow:
    fn: Callable[[str], str]  # the real tool
    latency: Latency

    @property
    def __name__(self) -> str:  # its durations are the tool's own (``flow.tool_calls.history_key``)
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def __call__(self, arg: str) -> str:
        time.sleep(self.latency.seconds(self.__name__, arg))
        return self.fn(arg)
