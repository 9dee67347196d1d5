"""Where KV tasks run, and where a block is or will be.

A KV-consuming task runs where its blocks live unless the plan says transfer. Its worker
restriction is strict while that worker lives (a loose one would let work stealing move it
and drag the blocks along); when the worker dies, the restrictions that pointed at it are
loosened, so the tasks run elsewhere and Dask recomputes the lost blocks from lineage.
Nothing may wait on a dead worker: a task already stuck in ``no-worker`` is scheduled
again, at once or as soon as a worker is running (``reschedule_orphans``). Nor on one Dask
keeps paused: a worker whose memory the model and its allocator keep over Dask's pause
threshold may never resume, so after ``PAUSE_PATIENCE_S`` its strictly placed KV tasks are
let go to a running worker, which fetches their blocks from it (``release_paused``).

With a budget, the budget's admission decides when a placed task goes (``kv_budget``).
Each placement records the plan's cost-model decision (transfer or recompute) once per
destination, and its predicted time for the queue the planner waits on (``kv_queue``).
"""

from __future__ import annotations

from collections import defaultdict

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import is_kv, is_placed
from daskflow_kv.state.catalog import KVCatalog

from .kv_budget import BudgetEnforcer
from .kv_events import EventLog
from .kv_notes import ComputeNote
from .kv_queue import QueueTracker


PAUSE_PATIENCE_S = 5.0  # a worker paused this long lets its KV tasks run elsewhere (a pause often passes sooner)


class Locality:
    __slots__ = ("_scheduler", "_catalog", "_budget", "_queue", "_events", "_paused_since")

    def __init__(self, scheduler, catalog: KVCatalog, budget: BudgetEnforcer, queue: QueueTracker,
                 events: EventLog):
        self._scheduler = scheduler  # restrictions to set, loosen and retry
        self._catalog = catalog  # blocks read are touched; transfer/recompute counters
        self._budget = budget  # holds a placed task until it fits
        self._queue = queue  # the placed task's predicted time
        self._events = events  # placement notes, decisions, transfers, recomputes
        self._paused_since: dict[str, float] = {}  # worker -> when it was first seen paused (this pause)

    # -- a new task -------------------------------------------------------------------------------
    def place(self, ts, note: ComputeNote, namespace: str | None) -> None:
        """Restrict a KV-consuming task to the plan's worker, or to where its blocks live.

        Only the blocks it reads of its own namespace count: their reuse and last access
        order eviction, so a task may not touch another tenant's."""
        reads = [k for k in note.reads if self._catalog.namespace_of(k) == namespace]
        target = note.target
        if target is None:
            held: dict[str, int] = defaultdict(int)
            for k in reads:
                dts = self._scheduler.tasks.get(k)
                for ws in (dts.who_has or ()) if dts is not None else ():
                    held[ws.address] += dts.get_nbytes()
            target = max(sorted(held), key=held.get) if held else None
        if self._budget.hold(ts, target, note.kv_out, namespace, note.gang, note.gang_size, note.flow):
            pass  # the budget decides when (and whether) it goes to ``target``: see kv_budget
        elif target is not None and target in self._scheduler.workers:
            # Strict while the worker lives (no work stealing); loosened if it dies.
            di.pin(self._scheduler, ts, target)
        for k in reads:
            self._catalog.touch(k)
        if note.predicted_s is not None:
            self._queue.expect(ts.key, target, note.predicted_s)
        self._events.record(note.op + "-task", namespace, key=str(ts.key), worker=target, state_id=note.state_id,
                            reads=len(reads))
        if note.decision and note.first:  # a destination pays once, whatever its branch count
            self._record_decision(note.decision, namespace, reads, note.state_id)

    def _record_decision(self, decision: dict, namespace: str | None, reads, state_id) -> None:
        self._events.record_decision(decision, namespace)
        if decision.get("action") == "transfer":
            self._catalog.count("transfers", namespace=namespace)
            self._catalog.count("bytes_transferred", decision.get("nbytes") or 0, namespace)
            self._events.record("transfer", namespace, src=decision.get("src"), dst=decision.get("dst"),
                                nbytes=decision.get("nbytes"), keys=list(reads), state_id=state_id)
        elif decision.get("action") == "recompute":
            self._catalog.count("recomputes", namespace=namespace)
            self._events.record("recompute", namespace, reason="cost-model", dst=decision.get("dst"),
                                tokens=decision.get("missing_tokens"), state_id=state_id)

    # -- dead workers -----------------------------------------------------------------------------
    def loosen_dead_restrictions(self, task_states) -> list:
        """Loosen strict restrictions naming only workers that are gone; -> keys stuck in no-worker."""
        alive = self._scheduler.workers
        return self._loosen_strict(task_states, lambda ts: not any(w in alive for w in ts.worker_restrictions))

    def _loosen_strict(self, task_states, unusable) -> list:
        """Loosen the strict restrictions ``unusable`` says name no worker that can run them
        (admission decides the tasks it holds); -> the loosened keys stuck in no-worker."""
        stuck = []
        for ts in task_states:
            if self._budget.awaiting_admission(ts.key) or not di.is_strict(ts) or not unusable(ts):
                continue
            di.loosen(ts)
            if ts.state == "no-worker":
                stuck.append(ts.key)
        return stuck

    def replace_lost(self, stimulus_id: str) -> int:
        """After a worker died: tasks planned on it may run anywhere; those already stuck in
        no-worker are scheduled again. -> how many were."""
        tasks = self._scheduler.tasks
        stuck = self.loosen_dead_restrictions(ts for k, ts in list(tasks.items()) if is_placed(k))
        if stuck:
            di.reschedule(self._scheduler, stuck, stimulus_id)
        return len(stuck)

    def reschedule_orphans(self, stimulus_id: str) -> None:
        """Schedule KV tasks stuck in no-worker whose loosened restrictions name no live worker.

        Dask retries a no-worker task on a new worker only if its restrictions name that
        worker, loose or not, so a task loosened while no worker was left (every job of a
        Slurm cluster gone at once) would wait forever. Runs on add_worker and every tick:
        a worker may not be running yet when it is added.
        """
        s = self._scheduler
        stuck_all = di.unrunnable(s)
        if not stuck_all or not di.has_running_worker(s):
            return
        stuck = [ts for ts in stuck_all
                 if is_placed(ts.key) and ts.loose_restrictions and ts.worker_restrictions
                 and not any(w in s.workers for w in ts.worker_restrictions)]
        if stuck:
            di.reschedule(s, [ts.key for ts in stuck], stimulus_id)
            moved = sum(ts.state != "no-worker" for ts in stuck)
            if moved:  # a count: a cluster event names no tenant's keys
                self._events.record("rescheduled", None, tasks=moved)

    def release_paused(self, now: float, stimulus_id: str) -> int:
        """KV tasks stuck in no-worker, strictly placed only on workers paused for at least
        ``PAUSE_PATIENCE_S``, may run on any running worker: placed consumers, and the block
        cuts Dask recomputes where their prefill ran. -> how many were let go."""
        s = self._scheduler
        paused = di.paused_workers(s)
        self._paused_since = {a: self._paused_since.get(a, now) for a in paused}
        long_paused = {a for a, since in self._paused_since.items() if now - since >= PAUSE_PATIENCE_S}
        if not long_paused or not di.has_running_worker(s):
            return 0
        stuck = [ts for ts in di.unrunnable(s) if is_kv(ts.key) and set(ts.worker_restrictions) <= long_paused]
        keys = self._loosen_strict(stuck, lambda ts: True)
        if keys:
            di.reschedule(s, keys, stimulus_id)
            self._events.record("paused-worker", None, workers=sorted(long_paused), rescheduled=len(keys))
        return len(keys)

    # -- where a block is -------------------------------------------------------------------------
    def where(self, ts) -> list[str]:
        """Workers that hold the key, or the one expected to compute it (following take_block)."""
        workers = self._scheduler.workers
        for _ in range(3):
            if ts.who_has:
                return sorted(ws.address for ws in ts.who_has)
            if ts.processing_on is not None:
                return [ts.processing_on.address]
            if self._budget.is_held(ts.key):  # parked for admission: where the plan sends it
                dest = self._budget.destination(ts.key)
                return [dest] if dest in workers else []
            if ts.worker_restrictions:
                return sorted(w for w in ts.worker_restrictions if w in workers)
            if len(ts.dependencies) != 1:  # a block's only input is the prefill that made it
                break
            ts = next(iter(ts.dependencies))
        return []
