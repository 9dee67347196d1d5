"""The per-worker KV byte budget, kept hard: admission before a KV task runs, eviction after.

With a budget set, every task that adds KV to a worker - its output blocks
(``kv_out`` in its annotation) and the blocks it will fetch there - is held back when
submitted (restricted to no worker, so Dask parks it in ``no-worker`` once its inputs
exist) until ``policy.admission.admit`` says there is room. Room is made by evicting
unpinned blocks *before* the task is sent: the worker receives the release and then the
task on the same ordered stream, so it never holds both. Bytes promised to a task stay
reserved until it finishes, so two tasks cannot be admitted into the same room. A task
that cannot fit yet waits in line, oldest first; it fails (``KVBudgetError``, a clear
message) only when it never can. When the cluster made no progress for
``admission-patience`` - no KV task ran anywhere and no KV left memory: parked tasks hold
each other's room through states their clients keep - the youngest stuck task is
preempted (``KVPreempted``; its workflow releases its states and retries) and the rest
wait on. A periodic check (``enforce``) still trims retained blocks
down to the budget as states are released (``policy.eviction.choose_victims``).

Tenants with a quota (``daskflow-kv.tenants.<name>.quota``) are guaranteed that many KV
bytes on every worker: another tenant's task may evict their blocks only down to it, and
may not take the part of it they do not hold yet (``policy.admission.Tenancy``); the
periodic trim never takes a tenant below its quota either.

The chunk tasks of one parallel prefill are a *gang*: they must run at the same time (each
waits for the K/V of the chunks before it), so they are admitted together or not at all -
one admitted alone would hold its worker's thread waiting for a peer still parked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from daskflow_kv import dask_internals as di
from daskflow_kv.errors import KVBudgetError, KVPreempted
from daskflow_kv.keys import CACHE_CLIENT, HOLD_WORKER
from daskflow_kv.policy.admission import ADMIT, FAIL, STUCK, Tenancy, admit
from daskflow_kv.policy.eviction import choose_victims
from daskflow_kv.state.catalog import KVCatalog

from .kv_events import EventLog
from .kv_settings import KVSettings
from .kv_usage import KVUsage

logger = logging.getLogger("daskflow_kv.scheduler")
NO_QUOTAS = Tenancy()


@dataclass(slots=True)
class Held:
    """A KV task under admission control, from submission until it leaves its worker."""

    target: str | None  # the worker the plan chose
    out_bytes: int  # KV the task's output adds there
    namespace: str | None  # whose task it is (its events go there)
    since: float  # when it was submitted
    reserved: int = 0  # bytes promised once admitted (output + fetched inputs)
    worker: str | None = None  # where it was admitted
    gang: str | None = None  # tasks that must start together (a parallel prefill's chunks)
    gang_size: int = 1  # how many tasks the gang has


class Verdict(NamedTuple):
    """What admission decided for one parked task."""

    action: str  # admit | wait | fail
    victims: tuple  # blocks to evict first (admit)
    reason: str  # why it waits or fails
    worker: str  # where it would run
    need: int  # KV bytes it adds there


def _since(members: list) -> float:
    """When the last of a stuck task's (or gang's) members was submitted."""
    return max(h.since for _, _, h, _ in members)


class BudgetEnforcer:
    __slots__ = ("_scheduler", "_settings", "_catalog", "_usage", "_events", "_quotas", "_held", "_reserved",
                 "_admit_pending", "_evicting", "_flushed", "_over_budget", "_dirty", "_progress_at")

    def __init__(self, scheduler, settings: KVSettings, catalog: KVCatalog, usage: KVUsage, events: EventLog,
                 quotas: Mapping[str, int] | None = None):
        self._scheduler = scheduler  # tasks to park, send, fail; workers to trim
        self._settings = settings  # kv_budget_bytes and admission_patience, read at each decision
        self._quotas = dict(quotas or {})  # namespace -> KV bytes per worker guaranteed to it
        self._catalog = catalog  # eviction counters and each block's namespace
        self._usage = usage  # KV bytes per worker and what could be evicted
        self._events = events  # evict and over-budget events
        self._held: dict = {}  # key -> Held: KV tasks parked until admitted, or admitted and not finished
        self._reserved: dict[str, int] = {}  # worker -> KV bytes promised to admitted, running tasks
        self._admit_pending = False  # something freed room: try the parked tasks again
        self._evicting: set = set()  # keys released by the budget, until Dask confirms
        self._flushed: set = set()  # those of them released under a budget of 0 (a deliberate flush)
        self._over_budget: set[str] = set()  # workers over budget with only pinned blocks left
        self._dirty = False  # KV use may have changed since the last check (or a worker is still over)
        self._progress_at = 0.0  # when a KV task last finished or KV last left memory: a parked task's patience runs from here

    # -- what other parts ask ---------------------------------------------------------------------
    def is_held(self, key) -> bool:
        """Under admission control: parked, or admitted and not finished."""
        return key in self._held

    def awaiting_admission(self, key) -> bool:
        """Parked: admission, not its restriction, decides where it goes."""
        held = self._held.get(key)
        return held is not None and held.worker is None

    def destination(self, key) -> str | None:
        """Where a held task was admitted, else where its plan sends it (None: not held)."""
        held = self._held.get(key)
        return None if held is None else (held.worker or held.target)

    def note_change(self) -> None:
        """KV use changed (a block arrived or was spilled, a state was released): check again."""
        self._dirty = True

    def note_progress(self) -> None:
        """Something freed or may soon free KV (a state released, a block left memory): parked
        tasks wait on, and try again."""
        self._progress_at = time.time()
        self._admit_pending = True

    def confirm_evicted(self, key) -> str | None:
        """Dask let go of ``key``. -> "evicted" when the budget had released it under pressure,
        "flushed" when under a budget of 0 (everything goes on purpose: nothing to regret),
        None when the budget had not released it."""
        if key in self._evicting:
            self._evicting.discard(key)
            if key in self._flushed:
                self._flushed.discard(key)
                return "flushed"
            return "evicted"
        return None

    def forget_worker(self, worker: str) -> None:
        """``worker`` is gone: nothing is reserved there; parked tasks planned there go elsewhere."""
        self._over_budget.discard(worker)
        self._reserved.pop(worker, None)
        self.note_progress()

    # -- admission --------------------------------------------------------------------------------
    def hold(self, ts, target: str | None, out_bytes: int, namespace: str | None, gang: str | None = None,
             gang_size: int = 1) -> bool:
        """Park a KV task until admitted; False (run it as usual) when no budget is set."""
        if self._settings.kv_budget_bytes is None:
            return False
        self._held[ts.key] = Held(target, int(out_bytes), namespace, time.time(), gang=gang, gang_size=int(gang_size))
        di.pin(self._scheduler, ts, HOLD_WORKER)
        return True

    def transition(self, key, start: str, finish: str) -> None:
        held = self._held.get(key)
        if held is None:
            return
        if finish == "no-worker" and held.worker is None:
            self._scheduler.loop.add_callback(self.admit)  # after this transition batch, not inside it
        elif start == "processing" and finish != "processing":
            self._reserved[held.worker] = self._reserved.get(held.worker, 0) - held.reserved
            self._held.pop(key, None)
            self.note_progress()  # its room may let a waiting task in
        elif finish in ("released", "forgotten", "erred") and held.worker is None:
            self._held.pop(key, None)

    def admit(self) -> None:
        """Send every parked task that fits; evict first where that makes room."""
        self._admit_pending = False
        if not self._held:
            return
        now = time.time()
        stimulus = f"kv-admit-{now}"
        gangs: dict[str, list] = {}
        stuck: list[list] = []  # [(key, ts, held, verdict)] per task or gang that nothing can unblock
        running = any(h.worker is not None for h in self._held.values())  # its end may free room
        for key, held in sorted(self._held.items(), key=lambda kv: kv[1].since):
            ts = self._scheduler.tasks.get(key)
            if ts is None or held.worker is not None or ts.state != "no-worker":
                continue
            if held.gang is not None:
                gangs.setdefault(held.gang, []).append((key, ts, held))
                continue
            d = self._decide(ts, held, now, running=running)
            if d is not None and d.action == STUCK:
                stuck.append([(key, ts, held, d)])
            elif d is not None:
                self._apply(key, ts, held, d, stimulus)
        for members in gangs.values():
            self._admit_gang(members, now, stimulus, stuck, running)
        if stuck:
            self._preempt_youngest(stuck, stimulus)

    def _preempt_youngest(self, stuck: list[list], stimulus: str) -> None:
        """Break a deadlock: on each worker with stuck tasks, fail the youngest (task or gang)
        with ``KVPreempted``; its workflow releases what it holds there and retries. The
        others' patience starts again."""
        youngest: dict[str, list] = {}
        for members in stuck:
            worker = members[0][3].worker
            if worker not in youngest or _since(members) > _since(youngest[worker]):
                youngest[worker] = members
        for members in youngest.values():
            for key, ts, held, d in members:
                reason = d.reason + "; preempted (the youngest task waiting there) so older ones can run: retry it"
                self._held.pop(key, None)
                self._events.record("preempt", held.namespace, worker=d.worker, key=str(key), reason=reason)
                di.fail_task(self._scheduler, key, KVPreempted(reason), stimulus)
        self.note_progress()

    def _admit_gang(self, members: list, now: float, stimulus: str, stuck: list, running: bool) -> None:
        """All of a gang at once: admitted when every member fits, failed when one never can."""
        waited = now - min(h.since for _, _, h in members)
        if len(members) < members[0][2].gang_size and waited < self._settings.admission_patience:
            return  # the rest still wait for their inputs; a member that never comes stops blocking later
        verdicts, promised = [], {}
        for key, ts, held in members:
            v = self._decide(ts, held, now, promised, running)
            if v is None:
                return
            verdicts.append(v)
            promised[v.worker] = promised.get(v.worker, 0) + v.need
        actions = {v.action for v in verdicts}
        if actions == {ADMIT}:
            for (key, ts, held), v in zip(members, verdicts):
                self._apply(key, ts, held, v, stimulus)
        elif FAIL in actions:  # one never fits: the gang fails as one, none holds a thread waiting
            reason = next(v.reason for v in verdicts if v.action == FAIL)
            for (key, ts, held), v in zip(members, verdicts):
                self._apply(key, ts, held, v._replace(action=FAIL, victims=(), reason=reason), stimulus)
        elif STUCK in actions:  # preempted as one, if it is the youngest
            reason = next(v.reason for v in verdicts if v.action == STUCK)
            stuck.append([(key, ts, held, v._replace(reason=reason)) for (key, ts, held), v in zip(members, verdicts)])

    def _pick_worker(self, ts, held: Held) -> str | None:
        workers = self._scheduler.workers
        if held.target in workers:
            return held.target
        # The planned worker is gone: where most of its inputs are, else the least busy.
        score: dict[str, int] = {}
        for d in ts.dependencies:
            for w in d.who_has or ():
                score[w.address] = score.get(w.address, 0) + d.get_nbytes()
        if score:
            return max(sorted(score), key=score.get)
        ws = sorted(workers.values(), key=lambda w: (len(w.processing), w.address))
        return ws[0].address if ws else None

    def _decide(self, ts, held: Held, now: float, promised: dict | None = None,
                running: bool = False) -> Verdict | None:
        """The verdict for one parked task; None when no worker can take it.

        ``promised``: worker -> bytes this pass already gave the task's gang there;
        ``running``: a KV task admitted anywhere is still running.
        """
        worker = self._pick_worker(ts, held)
        if worker is None:
            return None
        budget = self._settings.kv_budget_bytes
        if budget is None:  # the budget was lifted meanwhile
            return Verdict(ADMIT, (), "", worker, 0)
        ws = self._scheduler.workers[worker]
        need = held.out_bytes + self._usage.incoming(ts, worker)
        wu = self._usage.usage(ws, now)
        promised_here = (promised or {}).get(worker, 0)
        reserved = self._reserved.get(worker, 0) + promised_here
        tenancy = NO_QUOTAS
        if self._quotas:
            by_owner = self._reserved_by_owner(worker)
            by_owner[held.namespace] = by_owner.get(held.namespace, 0) + promised_here
            tenancy = Tenancy(held.namespace, self._quotas, wu.by_owner, by_owner)
        d = admit(need, wu.used, reserved, budget, wu.blocks, now, running,
                  now - max(held.since, self._progress_at), self._settings.admission_patience, worker, tenancy)
        return Verdict(d.action, d.victims, d.reason, worker, need)

    def _reserved_by_owner(self, worker: str) -> dict[str | None, int]:
        """Bytes promised to each namespace's admitted, running tasks on ``worker``."""
        out: dict[str | None, int] = {}
        for h in self._held.values():
            if h.worker == worker:
                out[h.namespace] = out.get(h.namespace, 0) + h.reserved
        return out

    def _apply(self, key, ts, held: Held, verdict: Verdict, stimulus: str) -> None:
        action, victims, reason, worker, need = verdict
        if action == ADMIT:
            self._evict(worker, victims, stimulus)
            held.worker, held.reserved = worker, need
            self._reserved[worker] = self._reserved.get(worker, 0) + need
            di.pin(self._scheduler, ts, worker)
            di.reschedule(self._scheduler, [key], stimulus)
        elif action == FAIL:
            self._held.pop(key, None)
            self._events.record("over-budget", held.namespace, worker=worker, key=str(key), reason=reason)
            di.fail_task(self._scheduler, key, KVBudgetError(reason), stimulus)

    # -- eviction ---------------------------------------------------------------------------------
    def _evict(self, addr: str, keys, stimulus: str) -> None:
        for key in keys:
            ts = self._scheduler.tasks[key]
            namespace = self._catalog.namespace_of(key)  # before the release: a forgotten block leaves the catalog
            if len(ts.who_has or ()) > 1:  # drop this worker's replica only
                di.drop_replica(self._scheduler, addr, [key], stimulus)
            else:
                self._evicting.add(key)
                if self._settings.kv_budget_bytes == 0:
                    self._flushed.add(key)
                di.unwant(self._scheduler, [key], CACHE_CLIENT, stimulus)
            self._catalog.count("evictions", namespace=namespace)
            self._catalog.count("bytes_evicted", ts.get_nbytes(), namespace)
            self._events.record("evict", namespace, key=key, worker=addr, nbytes=ts.get_nbytes())

    def enforce(self, force: bool = False) -> list:
        """Admit what now fits, then trim every worker to the budget (retained blocks after
        their states were released). ``force``: check even if nothing changed. -> evicted keys."""
        if self._admit_pending or self._held:
            self.admit()
        budget = self._settings.kv_budget_bytes
        if budget is None or not (self._dirty or force):
            return []
        self._dirty = False
        now = time.time()
        stimulus = f"kv-evict-{now}"
        evicted = []
        for addr, ws in list(self._scheduler.workers.items()):
            wu = self._usage.usage(ws, now)
            room = budget - self._reserved.get(addr, 0)
            if wu.used <= room:
                self._over_budget.discard(addr)
                continue
            plan = choose_victims(wu.blocks, wu.used, room, now, floors=self._quotas, held=wu.by_owner)
            self._evict(addr, plan.victims, stimulus)
            evicted += plan.victims
            if plan.over_budget_pinned:
                self._dirty = True  # check again: pinned blocks become evictable when released
                if addr not in self._over_budget:
                    self._over_budget.add(addr)
                    logger.info("worker %s holds %d KV bytes, over its budget, all pinned", addr,
                                plan.remaining_bytes)
                    self._events.record("over-budget", None, worker=addr, nbytes=plan.remaining_bytes)
            else:
                self._over_budget.discard(addr)
        self._evicting = {k for k in self._evicting if k in self._scheduler.tasks}  # dropped some other way
        self._flushed &= self._evicting
        return evicted
