"""Each worker's continuous-batching loop as the scheduler last heard of it.

A worker's report carries its step loop's counters (``model.step_engine.EngineStats``):
requests in the last step's batch, how long that step took, requests waiting to join and
running, steps and the sum of batch sizes (their ratio is the mean batch). The KV page and
``/metrics`` show them per worker. Numbers only, checked: a report is a worker's, but a
bad number must not break a page.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class EngineGauge:
    batch: int = 0  # requests in the last step
    step_s: float = 0.0  # seconds the last step took
    waiting: int = 0  # requests waiting to join
    running: int = 0  # requests in the running batch
    steps: int = 0  # forward steps since the worker started
    batch_total: int = 0  # sum of per-step batch sizes
    completed: int = 0  # requests finished

    @property
    def mean_batch(self) -> float:
        return self.batch_total / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_batch": self.mean_batch}


def _count(v) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 53 else None


def gauge_of(stats) -> EngineGauge | None:
    """The gauge a report's ``engine`` field says (one loop's counters, or several summed), or
    None when it is not well formed."""
    if not isinstance(stats, dict):
        return None
    counts = {k: _count(stats.get(k, 0)) for k in ("batch", "waiting", "running", "steps", "batch_total",
                                                    "completed")}
    step_s = stats.get("step_s", 0.0)
    if any(v is None for v in counts.values()) or not isinstance(step_s, (int, float)) \
            or isinstance(step_s, bool) or not (math.isfinite(step_s) and 0 <= step_s < 1e6):
        return None
    return EngineGauge(step_s=float(step_s), **counts)


def merge(loops: dict) -> dict:
    """One worker's loops (a dict per model) as one: counts summed, the slowest last step."""
    out = {"batch": 0, "step_s": 0.0, "waiting": 0, "running": 0, "steps": 0, "batch_total": 0, "completed": 0}
    for st in loops.values():
        for k in out:
            out[k] = max(out[k], st.get(k, 0)) if k == "step_s" else out[k] + st.get(k, 0)
    return out


class EngineGauges:
    __slots__ = ("_by_worker",)

    def __init__(self):
        self._by_worker: dict[str, EngineGauge] = {}  # worker -> its loop, from its last report

    def update(self, worker: str, stats) -> None:
        g = gauge_of(stats)
        if g is not None:
            self._by_worker[worker] = g

    def of(self, worker: str) -> EngineGauge:
        return self._by_worker.get(worker, EngineGauge())

    def forget_worker(self, worker: str) -> None:
        self._by_worker.pop(worker, None)
