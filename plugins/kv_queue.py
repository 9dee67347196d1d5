"""The queue the planner waits on: predicted and running KV task times per worker.

Each KV compute task's plan predicts how long it takes (``predicted_s`` in its
annotation). A worker works through its KV tasks at about one predicted second per second
(``policy.queue_estimate``, the rule the simulator applies too), so the seconds still queued
there are what its sent tasks were predicted to take, less what has run since the first was sent,
plus every task planned for it that has not been sent yet - waiting for its inputs (a
branch behind its prefix's transfer) or parked for admission. Counting only what was sent
made a worker whose next tasks wait on their inputs look idle to the next plan: under a
stream that priced a rebuild there as free compute (exp 7 rebuilt up to 59 % of its
prefill that way) and, in the simulation at 128 workers, herded plans onto the same few
"idle" workers. The planner (``policy.placement``) reads it as ``busy_s`` in the
``kv_snapshot`` answer to place by earliest finish time.
"""

from __future__ import annotations

import time

from daskflow_kv.policy.queue_estimate import queued_seconds


class QueueTracker:
    __slots__ = ("_scheduler", "_predicted", "_running")

    def __init__(self, scheduler):
        self._scheduler = scheduler  # where a task was sent (``processing_on``)
        self._predicted: dict = {}  # KV compute task key -> (target worker, predicted seconds), from the plan
        self._running: dict = {}  # key -> (worker, when it was sent there)

    def expect(self, key, worker: str | None, seconds: float) -> None:
        """The plan says ``key`` takes ``seconds`` on ``worker``."""
        self._predicted[key] = (worker, float(seconds))

    def transition(self, key, start: str, finish: str) -> None:
        if key not in self._predicted:
            return
        ts = self._scheduler.tasks.get(key)
        if finish == "processing" and ts is not None and ts.processing_on is not None:
            self._running[key] = (ts.processing_on.address, time.time())
        elif start == "processing":
            self._running.pop(key, None)
            if finish in ("memory", "erred", "released", "forgotten"):
                self._predicted.pop(key, None)
        elif finish in ("forgotten", "erred"):
            self._predicted.pop(key, None)

    def busy_seconds(self, worker: str) -> float:
        """Predicted seconds of KV work still queued on ``worker``.

        Its KV tasks take the times their plans predicted; what has run since the first was
        sent there is subtracted. Tasks planned for ``worker`` and not sent yet (waiting for
        inputs, parked for admission) count whole (``policy.queue_estimate``).
        """
        sent = [(t0, self._predicted[k][1]) for k, (w, t0) in self._running.items() if w == worker]
        planned = sum(p for k, (w, p) in self._predicted.items() if w == worker and k not in self._running)
        first = min((t0 for t0, _ in sent), default=None)
        return queued_seconds(sum(p for _, p in sent), first, time.time(), planned)
