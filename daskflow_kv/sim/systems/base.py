"""What every simulated system shares: its modeled workers, the workflow gate, and the
level-by-level run of a workflow (``System``); a level's prefix groups (``prefix_groups``)."""

from __future__ import annotations

import math

import numpy as np

from ...policy.workflow_gate import GateLine, gate_slots
from ..blocks import common_prefix
from ..loop import EventLoop
from ..worker import ModeledWorker, QueueBoard, Request


def prefix_groups(calls) -> list[tuple[int, list]]:
    """(prefix tokens, members) per group of a level's calls sharing their first segment."""
    by_first: dict[str, list] = {}
    for c in calls:
        by_first.setdefault(c.segments[0][0], []).append(c)
    return [(common_prefix([c.segments for c in m]), m) for m in by_first.values()]


class _Flow:
    """A running workflow."""

    __slots__ = ("wf", "levels", "level", "pending", "started", "done_at", "failed")

    def __init__(self, wf):
        self.wf = wf
        self.levels = wf.levels()
        self.level = -1  # the level running
        self.pending = 0  # its calls not finished
        self.started = math.nan  # virtual s it passed the gate (its arrival when there is none)
        self.done_at = math.nan  # virtual s it finished
        self.failed = None  # why it failed, if it did


class System:
    name = "?"

    def __init__(self, profile, n_workers: int, budget: int | None = None, step_tokens: int = 512,
                 max_running: int = 64, pool: int = 8, full_pool: int = 16, gate: float | None = None):
        self.profile = profile  # SimProfile
        self.loop = EventLoop()
        self.board = QueueBoard(n_workers)
        self.workers = [ModeledWorker(i, profile.worker_prefill(i), self.loop, step_tokens, max_running, profile.decode,
                                      profile.step_costs, self.board, profile.step_noise,
                                      np.random.default_rng([profile.noise_seed, i]) if profile.step_noise else None)
                        for i in range(n_workers)]
        per_host = max(1, profile.workers_per_host)
        for w in self.workers:  # hosts of ``workers_per_host`` consecutive workers, as measured
            h = w.idx // per_host * per_host
            w.peers = tuple(q for q in self.workers[h:h + per_host] if q is not w)
        self.budget = budget  # KV bytes per worker (None: unbounded)
        self.bpt = profile.bytes_per_token
        self.pool = pool  # least busy workers a placement considers beyond the prefix's holders
        self.full_pool = full_pool  # up to this many workers, every worker is considered
        self.flows: list[_Flow] = []
        self.prefilled = 0  # prompt tokens prefilled
        self.transfers = 0
        self.bytes_transferred = 0
        self.evictions = 0
        self._rid = 0
        # The runtime's workflow gate (``policy.workflow_gate``): at most ``gate`` running
        # workflows per worker, the rest waiting in line (None: every one starts when it arrives).
        self.slots = gate_slots(gate, n_workers)
        self.line = GateLine()

    # -- driving -------------------------------------------------------------------------
    def run(self, workflows) -> list[_Flow]:
        for wf in workflows:
            f = _Flow(wf)
            self.flows.append(f)
            self.loop.at(wf.at, self._arrive, f)
        self.loop.run()
        return self.flows

    def _arrive(self, f: _Flow) -> None:
        self.line.arrive(f)  # its latency counts any wait here: it runs from its arrival
        self._start(self.line.admit(self.slots))

    def _start(self, admitted: list[_Flow]) -> None:
        for f in admitted:
            f.started = self.loop.now
            self._next_level(f)

    def _next_level(self, f: _Flow) -> None:
        f.level += 1
        if f.level >= len(f.levels) or f.failed:
            f.done_at = self.loop.now
            if not f.failed:  # a failed one left when it failed
                self._leave(f)
            return
        calls = f.levels[f.level]
        f.pending = len(calls)
        self.run_level(f, calls)

    def _leave(self, f: _Flow) -> None:
        """``f`` is done or failed: its place goes to the next workflow waiting at the gate."""
        self.line.leave(f)
        self._start(self.line.admit(self.slots))

    def _call_done(self, f: _Flow) -> None:
        f.pending -= 1
        if f.pending == 0:
            self._next_level(f)

    def _request(self, w: ModeledWorker, to_prefill: int, position: int, max_new: int, predicted: float, on_done,
                 delay: float | None = None) -> Request:
        self._rid += 1
        r = Request(self._rid, to_prefill, position, max_new, predicted, on_done)
        self.prefilled += to_prefill
        self.loop.after(self.profile.task_overhead_s if delay is None else delay, w.submit, r)
        return r

    def _busy(self, w: ModeledWorker) -> float:
        """Predicted seconds queued on ``w``, as the system's router or planner sees them."""
        return w.queued_s

    def _busy_all(self):
        """``_busy`` of every worker, as an array (``QueueBoard.rank`` orders by it)."""
        return self.board.sent

    def least_busy(self, k: int, exclude=()) -> list[ModeledWorker]:
        """The ``k`` least busy workers (ties: fewer requests, then index), less ``exclude``."""
        if len(self.workers) <= k:
            return [w for w in self.workers if w.idx not in exclude]
        return [self.workers[i] for i in self.board.rank(self._busy_all(), k, exclude=exclude)]

    def run_level(self, f: _Flow, calls) -> None:
        raise NotImplementedError

    def peak_kv(self) -> list[int]:
        return [0] * len(self.workers)
