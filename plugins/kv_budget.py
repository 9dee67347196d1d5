"""The per-worker KV byte budget, kept hard: admission before a KV task runs, eviction after.

With a budget set, every task that adds KV to a worker - its output blocks
(``kv_out`` in its annotation) and the blocks it will fetch there - is held back when
submitted (restricted to no worker, so Dask parks it in ``no-worker`` once its inputs
exist) until ``policy.admission.admit`` says there is room. Room is made by evicting
unpinned blocks *before* the task is sent: the worker receives the release and then the
task on the same ordered stream, so it never holds both. Bytes promised to a task stay
reserved until it finishes, so two tasks cannot be admitted into the same room. A task
that cannot fit waits while other KV tasks run on its worker and fails with a clear error
otherwise (``KVBudgetError``). A periodic check still trims retained blocks down to the
budget as states are released.

The chunk tasks of one parallel prefill are a *gang*: they must run at the same time (each
waits for the K/V of the chunks before it), so they are admitted together or not at all -
one admitted alone would hold its worker's thread waiting for a peer still parked.

A mixin of ``KVSchedulerPlugin``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import HOLD_WORKER, holds_kv, is_block, is_output
from daskflow_kv.errors import KVBudgetError
from daskflow_kv.policy.admission import ADMIT, FAIL, admit
from daskflow_kv.policy.eviction import BlockUsage, choose_victims

logger = logging.getLogger("daskflow_kv.scheduler")



@dataclass(slots=True)
class Held:
    target: str | None  # the worker the plan chose
    out_bytes: int  # KV the task's output adds there
    namespace: str | None
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


class KVBudget:
    # -- accounting -------------------------------------------------------------------------------
    def _is_kv(self, key) -> bool:
        # cataloged blocks, replicas and outputs (a block key outside the catalog is nobody's)
        return key in self.catalog.blocks or (holds_kv(key) and not is_block(key))

    def _held_bytes(self, ts, ws) -> int:
        """What ``ts`` adds to ``ws``'s KV *memory*. A block (or a batch's branch) cut from a
        prefill's or a load's output shares its tensors: while that output is still in memory
        there, it adds nothing. A block the worker spilled to disk adds nothing either."""
        if not self._is_kv(ts.key) or self.spilled_on(ts.key, ws.address):
            return 0
        for d in ts.dependencies:
            if is_output(d.key) and ws in (d.who_has or ()):
                return 0
        return ts.get_nbytes()

    def kv_bytes_by_worker(self) -> dict[str, int]:
        return {addr: sum(self._held_bytes(ts, ws) for ts in ws.has_what) for addr, ws in self.scheduler.workers.items()}

    def _pinned(self, ts, now: float) -> bool:
        """A block this worker must keep: leased, read by a waiting/running task, or held by a state."""
        if self._leases.get(ts.key, 0.0) > now or ts.waiters:
            return True
        if len(ts.who_has or ()) > 1:  # an extra replica: the states keep the other copy
            return False
        return any(cs.client_key != self.CACHE_CLIENT for cs in ts.who_wants or ())

    def _usage(self, ws, now: float) -> tuple[int, list[BlockUsage]]:
        """(KV bytes held, evictable view of the cataloged ones) on one worker."""
        used, usage = 0, []
        for ts in ws.has_what:
            if not self._is_kv(ts.key):
                continue
            used += self._held_bytes(ts, ws)
            e = self.catalog.blocks.get(ts.key)
            # Replicas go by themselves once read; only blocks are evicted, and only those in
            # memory: evicting a spilled one frees disk, not the memory the budget is about.
            if e is not None and not self.spilled_on(ts.key, ws.address):
                usage.append(BlockUsage(ts.key, ts.get_nbytes(), e.last_access, e.reuse_count,
                                        self._pinned(ts, now), e.parent, e.start))
        return used, usage

    def _evict(self, addr: str, keys, stimulus: str) -> None:
        for key in keys:
            ts = self.scheduler.tasks[key]
            if len(ts.who_has or ()) > 1:  # drop this worker's replica only
                di.drop_replica(self.scheduler, addr, [key], stimulus)
            else:
                self._evicting.add(key)
                di.unwant(self.scheduler, [key], self.CACHE_CLIENT, stimulus)
            self.catalog.count("evictions")
            self.catalog.count("bytes_evicted", ts.get_nbytes())
            self._event("evict", self.catalog.namespace_of(key), key=key, worker=addr, nbytes=ts.get_nbytes())

    # -- admission --------------------------------------------------------------------------------
    def _hold(self, ts, target: str | None, out_bytes: int, namespace: str | None, gang: str | None = None,
              gang_size: int = 1) -> bool:
        """Park a KV task until admitted; False (run it as usual) when no budget is set."""
        if self.kv_budget_bytes is None:
            return False
        self._held[ts.key] = Held(target, int(out_bytes), namespace, time.time(), gang=gang, gang_size=int(gang_size))
        di.pin(self.scheduler, ts, HOLD_WORKER)
        return True

    def _admission_transition(self, key, start: str, finish: str) -> None:
        held = self._held.get(key)
        if held is None:
            return
        if finish == "no-worker" and held.worker is None:
            self.scheduler.loop.add_callback(self._admit)  # after this transition batch, not inside it
        elif start == "processing" and finish != "processing":
            self._reserved[held.worker] = self._reserved.get(held.worker, 0) - held.reserved
            self._held.pop(key, None)
            self._admit_pending = True  # its room may let a waiting task in
        elif finish in ("released", "forgotten", "erred") and held.worker is None:
            self._held.pop(key, None)

    def _incoming(self, ts, worker: str) -> int:
        """KV bytes ``ts`` will fetch to ``worker`` (its KV inputs held elsewhere)."""
        return sum(d.get_nbytes() for d in ts.dependencies
                   if self._is_kv(d.key) and not any(w.address == worker for w in d.who_has or ()))

    def _pick_worker(self, ts, held: Held) -> str | None:
        if held.target in self.scheduler.workers:
            return held.target
        # The planned worker is gone: where most of its inputs are, else the least busy.
        score = {}
        for d in ts.dependencies:
            for w in d.who_has or ():
                score[w.address] = score.get(w.address, 0) + d.get_nbytes()
        if score:
            return max(sorted(score), key=score.get)
        ws = sorted(self.scheduler.workers.values(), key=lambda w: (len(w.processing), w.address))
        return ws[0].address if ws else None

    def _admit(self) -> None:
        """Send every parked task that fits; evict first where that makes room."""
        self._admit_pending = False
        if not self._held:
            return
        now = time.time()
        stimulus = f"kv-admit-{now}"
        gangs: dict[str, list] = {}
        for key, held in sorted(self._held.items(), key=lambda kv: kv[1].since):
            ts = self.scheduler.tasks.get(key)
            if ts is None or held.worker is not None or ts.state != "no-worker":
                continue
            if held.gang is not None:
                gangs.setdefault(held.gang, []).append((key, ts, held))
                continue
            d = self._decide(ts, held, now)
            if d is not None:
                self._apply(key, ts, held, d, stimulus)
        for members in gangs.values():
            self._admit_gang(members, now, stimulus)

    def _admit_gang(self, members: list, now: float, stimulus: str) -> None:
        """All of a gang at once: admitted when every member fits, failed when one never can."""
        waited = now - min(h.since for _, _, h in members)
        if len(members) < members[0][2].gang_size and waited < self.admission_patience:
            return  # the rest still wait for their inputs; a member that never comes stops blocking later
        verdicts, promised = [], {}
        for key, ts, held in members:
            v = self._decide(ts, held, now, promised)
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

    def _decide(self, ts, held: Held, now: float, promised: dict | None = None) -> Verdict | None:
        """The verdict for one parked task; None when no worker can take it.

        ``promised``: worker -> bytes this pass already gave the task's gang there.
        """
        worker = self._pick_worker(ts, held)
        if worker is None:
            return None
        if self.kv_budget_bytes is None:  # the budget was lifted meanwhile
            return Verdict(ADMIT, (), "", worker, 0)
        ws = self.scheduler.workers[worker]
        need = held.out_bytes + self._incoming(ts, worker)
        used, usage = self._usage(ws, now)
        busy = any(k in self._held and self._held[k].worker == worker for k in (t.key for t in ws.processing))
        reserved = self._reserved.get(worker, 0) + (promised or {}).get(worker, 0)
        d = admit(need, used, reserved, self.kv_budget_bytes, usage, now, busy, now - held.since,
                  self.admission_patience, worker)
        return Verdict(d.action, d.victims, d.reason, worker, need)

    def _apply(self, key, ts, held: Held, verdict: Verdict, stimulus: str) -> None:
        action, victims, reason, worker, need = verdict
        if action == ADMIT:
            self._evict(worker, victims, stimulus)
            held.worker, held.reserved = worker, need
            self._reserved[worker] = self._reserved.get(worker, 0) + need
            di.pin(self.scheduler, ts, worker)
            di.reschedule(self.scheduler, [key], stimulus)
        elif action == FAIL:
            self._held.pop(key, None)
            self._event("over-budget", held.namespace, worker=worker, key=str(key), reason=reason)
            di.fail_task(self.scheduler, key, KVBudgetError(reason), stimulus)

    # -- the periodic check -------------------------------------------------------------------------
    def _enforce_budgets(self, force: bool = False) -> list[str]:
        """Trim every worker to the budget (retained blocks after their states were released)."""
        if self._admit_pending or self._held:
            self._admit()
        if self.kv_budget_bytes is None or not (self._dirty or force):
            return []
        self._dirty = False
        now = time.time()
        stimulus = f"kv-evict-{now}"
        evicted = []
        for addr, ws in list(self.scheduler.workers.items()):
            used, usage = self._usage(ws, now)
            room = self.kv_budget_bytes - self._reserved.get(addr, 0)
            if used <= room:
                self._over_budget.discard(addr)
                continue
            plan = choose_victims(usage, used, room, now)
            self._evict(addr, plan.victims, stimulus)
            evicted += plan.victims
            if plan.over_budget_pinned:
                self._dirty = True  # check again: pinned blocks become evictable when released
                if addr not in self._over_budget:
                    self._over_budget.add(addr)
                    logger.info("worker %s holds %d KV bytes, over its budget, all pinned", addr,
                                plan.remaining_bytes)
                    self._event("over-budget", None, worker=addr, nbytes=plan.remaining_bytes)
            else:
                self._over_budget.discard(addr)
        self._evicting = {k for k in self._evicting if k in self.scheduler.tasks}  # dropped some other way
        return evicted
