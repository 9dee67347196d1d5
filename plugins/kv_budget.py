"""The per-worker KV byte budget, kept hard: admission before a KV task runs, eviction after.

With a budget set, every task that adds KV to a worker - its output blocks
(``kv_out`` in its annotation) and the blocks it will fetch there - is held back when
submitted (restricted to no worker, so Dask parks it in ``no-worker`` once its inputs
exist) until ``policy.admission.admit`` says there is room. Room is made by evicting
unpinned blocks *before* the task is sent: the worker receives the release and then the
task on the same ordered stream, so it never holds both. Bytes promised to a task stay
reserved until it finishes (the inputs it fetches until they arrive: they then count where
they are, once), so two tasks cannot be admitted into the same room. A task
that cannot fit yet waits in line; it fails (``KVBudgetError``, a clear message) only when
it never can. The line is per worker and first come, first served by workflow run (a
run's later levels go before runs that began after it; ``flow`` in the task's note), as a
serving engine's waiting queue: while the oldest task waits for room there, no younger one
takes that room, so a large request is not starved by small ones. When the cluster made no
progress for ``admission-patience`` - no KV task ran anywhere and no KV left memory: parked
tasks hold each other's room through states their clients keep - the stuck line's oldest
task moves to a worker with room for it (with what was planned after it there,
``kv_replan``), else the youngest runs holding its room are preempted (``KVPreempted``;
each workflow releases its states, its leases end, it waits at the workflow gate again and
retries, keeping its place in line) and the rest wait on. A periodic check (``enforce``)
still trims retained blocks down to the budget as states are released
(``policy.eviction.choose_victims``).

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
from daskflow_kv.keys import CACHE_CLIENT, HOLD_WORKER, SPILL_OP
from daskflow_kv.policy.admission import (ADMIT, FAIL, STUCK, WAIT, Room, Tenancy, admit, blocks_to_spill, make_room,
                                          spill_order)
from daskflow_kv.policy.eviction import choose_victims
from daskflow_kv.state.catalog import KVCatalog

from .kv_events import EventLog
from .kv_replan import replan_downstream
from .kv_settings import KVSettings
from .kv_runs import RunLedger, pending_only_for_cache
from .kv_tiers import TierTracker
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
    reserved: int = 0  # bytes promised once admitted to its output
    fetch: tuple = ()  # its KV inputs fetched to its worker: promised there too until they arrive
    loads: tuple = ()  # its KV inputs it reads back from its worker's spill disk (in memory from admission on)
    worker: str | None = None  # where it was admitted
    gang: str | None = None  # tasks that must start together (a parallel prefill's chunks)
    gang_size: int = 1  # how many tasks the gang has
    rank: float = 0.0  # its place in line: when its workflow run was first seen (else ``since``)
    flow: str | None = None  # the workflow run it serves


class Verdict(NamedTuple):
    """What admission decided for one parked task."""

    action: str  # admit | wait | fail
    victims: tuple  # blocks to evict first (admit)
    reason: str  # why it waits or fails
    worker: str  # where it would run
    need: int  # KV bytes it adds there


STARVING = 6  # patiences a line's room may not grow, however busy other workers are, before it counts as stuck
ORPHAN_CHECK_S = 1.0  # how often parked tasks are checked for a workflow that let them go



def _run_of(unit: list) -> tuple:
    """The (namespace, workflow run) a parked task or gang serves."""
    h = unit[0][2]
    return (h.namespace, h.flow)


def _younger(unit: list, than: list) -> bool:
    """``unit`` is later in line than ``than`` and serves another workflow run (a task of no
    run is a run of its own)."""
    same_run = unit[0][2].flow is not None and _run_of(unit) == _run_of(than)
    return not same_run and _rank(unit) > _rank(than)


def _may_preempt_for(unit: list, line: tuple, over: set) -> bool:
    """Quota floors hold across namespaces: a run of another tenant than the stuck line's is
    preempted for it only while that tenant holds more than its quota there (``over``)."""
    namespace = unit[0][2].namespace
    return line[1] is None or namespace == line[1] or namespace in over


def _unfreeable(wu, reserved: int) -> int:
    """KV bytes on a worker that eviction cannot free: pinned, or ``reserved`` for running tasks."""
    return reserved + wu.used - sum(b.nbytes for b in wu.blocks if not b.pinned)


def _input_bytes(ts) -> dict[str, int]:
    """Worker -> bytes of ``ts``'s inputs it holds."""
    inputs: dict[str, int] = {}
    for d in ts.dependencies:
        for w in d.who_has or ():
            inputs[w.address] = inputs.get(w.address, 0) + d.get_nbytes()
    return inputs


def _why_no_spill(pins: list, keep: frozenset, wu, lacking: int) -> str:
    """What holds a worker's memory when spilling cannot free the room a task lacks (for the
    operator's snapshot): pinned blocks no run accounts for, those the task reads, views of
    outputs still in memory, the rest of the KV (prefill outputs)."""
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    unclaimed = sum(n for k, n, runs in pins if not runs and k not in keep)
    read = sum(n for k, n, _ in pins if k in keep)
    claimed = sum(n for k, n, runs in pins if runs and k not in keep)
    blocks = sum(b.nbytes for b in wu.blocks)
    return (f"no spill frees {mib(lacking)}: pinned blocks run by nobody's idle state {mib(unclaimed)}, read by it "
            f"{mib(read)}, spillable {mib(claimed)}; outside cataloged blocks {mib(max(0, wu.used - blocks))}")


def _rank(unit: list) -> tuple:
    """A parked task's (or gang's) place in line: its run's start, then its own submission."""
    return min((h.rank, h.since) for _, _, h in unit)


class BudgetEnforcer:
    __slots__ = ("_scheduler", "_settings", "_catalog", "_usage", "_tiers", "_events", "_quotas", "_held",
                 "_admit_pending", "_evicting", "_flushed", "_over_budget", "_dirty", "_progress_at", "_floors", "_runs",
                 "_orphans_checked", "_heads", "on_preempt")

    def __init__(self, scheduler, settings: KVSettings, catalog: KVCatalog, usage: KVUsage, events: EventLog,
                 quotas: Mapping[str, int] | None = None, tiers: TierTracker | None = None):
        self._scheduler = scheduler  # tasks to park, send, fail; workers to trim
        self._settings = settings  # kv_budget_bytes and admission_patience, read at each decision
        self._quotas = {} if quotas is None else quotas  # namespace -> KV bytes per worker guaranteed (live)
        self._catalog = catalog  # eviction counters and each block's namespace
        self._usage = usage  # KV bytes per worker and what could be evicted
        self._tiers = tiers  # which workers keep a spill disk, which blocks are on it (None: spill nothing)
        self._events = events  # evict and over-budget events
        self._held: dict = {}  # key -> Held: KV tasks parked until admitted, or admitted and not finished
        self._admit_pending = False  # something freed room: try the parked tasks again
        self._evicting: set = set()  # keys released by the budget, until Dask confirms
        self._flushed: set = set()  # those of them released under a budget of 0 (a deliberate flush)
        self._over_budget: set[str] = set()  # workers over budget with only pinned blocks left
        self._dirty = False  # KV use may have changed since the last check (or a worker is still over)
        self._progress_at = 0.0  # when a KV task last finished or KV last left memory anywhere
        # line -> (its oldest waiting task, the least KV eviction could not free there while it
        # waited, since when): how long its room has not grown, however busy the cluster is
        self._floors: dict[tuple, tuple] = {}
        self._runs = RunLedger(scheduler, catalog, usage)  # workflow runs: their place in line, what they pin
        self._orphans_checked = 0.0  # when parked tasks nobody needs were last let go
        self._heads: dict[str, str] = {}  # worker -> why the oldest task waiting there waits (last admission pass)
        # (namespace, run) -> None: told of each run preempted to break a deadlock (the
        # workflow gate sends it back to its line and lets fewer runs in)
        self.on_preempt = None

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
        if not self._admit_pending and self._held:  # at once, not at the next tick: a preempted
            self._scheduler.loop.add_callback(self._admit_if_pending)  # workflow retries within 0.1 s
        self._admit_pending = True

    def _admit_if_pending(self) -> None:
        if self._admit_pending:
            try:
                self.admit()
            except Exception:  # a callback's error would go unseen
                logger.exception("daskflow-kv admission failed")

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

    def snapshot(self) -> dict:
        """What admission holds now, as plain data (a stalled stream's diagnosis)."""
        now = time.time()
        tasks = self._scheduler.tasks
        return {
            "held": [{"key": str(k), "state": getattr(tasks.get(k), "state", None), "worker": h.worker,
                      "target": h.target, "reserved": h.reserved, "out_bytes": h.out_bytes, "gang": h.gang,
                      "age_s": round(now - h.since, 1)} for k, h in self._held.items()],
            "reserved": {w: self._reserved_on(w) for w in self._scheduler.workers},
            "lines": [{"worker": line[0], "namespace": line[1], "oldest": str(key), "unfreeable": nbytes,
                       "since_room_grew_s": round(now - at, 1)} for line, (key, nbytes, at) in self._floors.items()],
            "pins": {line[0]: [(n, sorted(map(str, runs)) if runs is not None else None)
                               for n, runs in self._runs.pins_on(line[0], self._held)] for line in self._floors},
            "admit_pending": self._admit_pending, "evicting": len(self._evicting),
            "over_budget": sorted(self._over_budget),
        }

    def parked_by_worker(self) -> dict[str, int]:
        """Worker -> parked tasks planned there whose inputs exist (ready to run but for room)."""
        tasks, out = self._scheduler.tasks, {}
        for key, h in self._held.items():
            ts = tasks.get(key)
            if h.worker is None and h.target is not None and ts is not None and ts.state == "no-worker":
                out[h.target] = out.get(h.target, 0) + 1
        return out

    def waiting_heads(self) -> dict[str, str]:
        """Worker -> why the oldest task waiting there waited at the last admission pass."""
        return dict(self._heads)

    def counted_by_worker(self) -> dict[str, tuple[int, int]]:
        """Worker -> (KV bytes the budget counts in its memory, bytes reserved for running tasks)."""
        now = time.time()
        return {addr: (self._usage.usage(ws, now).used, self._reserved_on(addr))
                for addr, ws in self._scheduler.workers.items()}

    def forget_worker(self, worker: str) -> None:
        """``worker`` is gone: nothing is reserved there; parked tasks planned there go elsewhere."""
        self._over_budget.discard(worker)
        self._floors = {line: f for line, f in self._floors.items() if line[0] != worker}
        self.note_progress()

    # -- admission --------------------------------------------------------------------------------
    def hold(self, ts, target: str | None, out_bytes: int, namespace: str | None, gang: str | None = None,
             gang_size: int = 1, flow: str | None = None) -> bool:
        """Park a KV task until admitted; False (run it as usual) when no budget is set.
        ``flow``: the workflow run it serves (its place in line)."""
        if self._settings.kv_budget_bytes is None:
            return False
        now = time.time()
        self._held[ts.key] = Held(target, int(out_bytes), namespace, now, gang=gang, gang_size=int(gang_size),
                                  rank=self._runs.start(namespace, flow, now), flow=flow)
        di.pin(self._scheduler, ts, HOLD_WORKER)
        return True

    def forget_run(self, run: tuple | None) -> None:
        """A workflow run ended: its name's place in line is forgotten."""
        self._runs.forget(run)

    def transition(self, key, start: str, finish: str) -> None:
        """A held task stays under admission until it finishes or Dask forgets it. One that
        is released before finishing - an input lost with a dead worker, its own worker dead
        - comes back through ``waiting``: it is parked again, so it waits in line as before
        instead of sitting restricted to the parking address (or to a dead worker) for good."""
        held = self._held.get(key)
        if held is None:
            return
        if finish == "no-worker" and held.worker is None:
            self._scheduler.loop.add_callback(self.admit)  # after this transition batch, not inside it
        elif finish in ("memory", "forgotten", "erred"):  # done, or let go for good
            self._held.pop(key, None)
            self._unreserve(held)
        elif finish == "released":  # back to waiting soon (or forgotten): parked again
            self._unreserve(held)
            if held.worker is not None:
                held.worker, held.reserved, held.fetch, held.loads = None, 0, (), ()
                ts = self._scheduler.tasks.get(key)
                if ts is not None:
                    di.pin(self._scheduler, ts, HOLD_WORKER)

    def _unreserve(self, held: Held) -> None:
        """An admitted task left its worker: its promised room is free (a waiting task may take it)."""
        if held.worker is not None:
            if held.loads and self._tiers is not None:
                self._tiers.done_loading(held.worker, held.loads)
            self.note_progress()

    def admit(self, spilled: bool = False) -> None:
        """Send every parked task that fits, in line order; evict first where that makes room,
        spill younger runs' idle blocks where only that does (then look again, once)."""
        self._admit_pending = False
        if not self._held:
            return
        now = time.time()
        stimulus = f"kv-admit-{now}"
        if now - self._orphans_checked >= ORPHAN_CHECK_S:
            self._orphans_checked = now
            self._drop_orphans(stimulus)
        units: dict[object, list] = {}  # a task alone, or a gang's members together
        for key, held in self._held.items():
            ts = self._scheduler.tasks.get(key)
            if ts is None or held.worker is not None or ts.state != "no-worker":
                continue
            units.setdefault(("gang", held.gang) if held.gang is not None else key, []).append((key, ts, held))
        running = {h.worker for h in self._held.values() if h.worker is not None}  # workers with admitted tasks
        lines: dict[tuple, list] = {}  # line -> [(unit, verdicts)] waiting there, oldest first
        blocked: dict[tuple, str] = {}  # line -> why its oldest waiting task waits (no younger one passes it)
        stuck: set[tuple] = set()  # blocked lines where nothing can unblock the oldest
        for unit in sorted(units.values(), key=_rank):
            self._admit_unit(unit, now, stimulus, running, lines, blocked, stuck)
        self._heads = {line[0]: why for line, why in blocked.items()}
        if blocked and not spilled and self._spill_for(lines, blocked, now, stimulus):
            self.admit(spilled=True)
        elif stuck:
            self._break_deadlock(lines, blocked, stuck, stimulus)

    def _spill_for(self, lines: dict, blocked: dict, now: float, stimulus: str) -> bool:
        """For each blocked line, the room its oldest task lacks once every unpinned block is
        evicted, taken from pinned blocks that no running task reads - younger runs' first,
        then its own run's, older runs' last (``policy.admission.spill_order``): they go to
        their worker's spill disk (``SPILL_OP``, sent before the task it makes room for) and no
        longer count. Their runs keep them; a task that reads one is admitted with room to
        read it back (``KVUsage.incoming``). -> whether anything was spilled."""
        if self._tiers is None:
            return False
        budget = self._settings.kv_budget_bytes or 0
        tasks, any_spilled = self._scheduler.tasks, False
        for line in blocked:
            worker = line[0]
            ws = self._scheduler.workers.get(worker)
            if ws is None or not self._tiers.can_spill(worker):
                continue
            unit, verdicts = lines[line][0]
            need = sum(v.need for v in verdicts if v.worker == worker)
            wu = self._usage.usage(ws, now)
            lacking = _unfreeable(wu, self._reserved_on(worker)) + need - budget
            if need <= 0 or lacking <= 0:
                continue  # nothing asked there, or eviction alone makes the room
            # Quota floors hold across namespaces: another tenant's blocks go only while it
            # holds more than its quota there (as for preemption, ``_may_preempt_for``).
            mine, over = unit[0][2].namespace, self._over_quota(worker, now)
            pins = [(k, self._usage.held_bytes(tasks[k], ws), runs)
                    for k, _, runs in self._runs.pinned_blocks(worker, self._held, spilling=True)
                    if k in tasks and (not self._quotas or not runs or all(ns == mine or ns in over for ns, _ in runs))]
            ranks = {r: self._runs.rank_of(r) for _, _, runs in pins if runs for r in runs}
            order = spill_order(ranks, _run_of(unit), _rank(unit)[0])
            keep = frozenset(d.key for _, ts, _ in unit for d in ts.dependencies)
            keys = blocks_to_spill(pins, order, lacking, keep)
            if not keys:
                self._heads[worker] = self._heads.get(worker, "") + "; " + _why_no_spill(pins, keep, wu, lacking)
                continue
            nbytes = sum(n for k, n, _ in pins if k in set(keys))
            di.send_to_worker_stream(self._scheduler, worker, {"op": SPILL_OP, "keys": [str(k) for k in keys]})
            self._tiers.mark_spilled(worker, keys)
            self._events.record("spill", unit[0][2].namespace, worker=worker, blocks=len(keys), nbytes=nbytes,
                                for_key=str(unit[0][0]))
            for k in keys:
                ns = self._catalog.namespace_of(k)
                self._catalog.count("spills", namespace=ns)
                self._catalog.count("bytes_spilled", tasks[k].get_nbytes(), ns)
            any_spilled = True
        return any_spilled

    def _drop_orphans(self, stimulus: str) -> None:
        """Let go of parked tasks nobody needs any more: their workflow gave up (preempted, its
        client gone) and only the cache still wants the blocks they would make, wanted from
        the moment they were submitted. Left parked, they would pin their inputs for good -
        room the next workflows need. The cache drops those pending blocks; Dask then forgets
        the task and its chain."""
        drop: set = set()
        for key, held in list(self._held.items()):
            ts = self._scheduler.tasks.get(key)
            pending = pending_only_for_cache(ts) if held.worker is None and ts is not None else None
            if pending:
                drop |= pending
                self._events.record("orphan-dropped", held.namespace, key=str(key), blocks=len(pending))
        if drop:
            di.unwant(self._scheduler, sorted(drop), CACHE_CLIENT, stimulus)

    def _line(self, worker: str, namespace: str | None) -> tuple:
        """Who queues behind whom: a worker's tasks, per tenant when tenants have quotas (one
        tenant's wait must not hold up another's guaranteed room)."""
        return (worker, namespace if self._quotas else None)

    def _admit_unit(self, unit: list, now: float, stimulus: str, running: set, lines: dict, blocked: dict,
                    stuck: set) -> None:
        """Admit a task (or a whole gang) that fits where no older task waits; fail one that
        never fits; else it waits, and no younger task passes it on its lines."""
        head = unit[0][2]
        if head.gang is not None and len(unit) < head.gang_size and \
                now - min(h.since for _, _, h in unit) < self._settings.admission_patience:
            return  # the rest still wait for their inputs; a member that never comes stops blocking later
        workers = [self._pick_worker(ts, held, now) for _, ts, held in unit]
        if None in workers:
            return
        mine = {self._line(w, h.namespace) for w, (_, _, h) in zip(workers, unit)}
        first = not mine & blocked.keys()  # no older task waits on its lines
        verdicts, promised = [], {}
        for (key, ts, held), worker in zip(unit, workers):
            v = self._decide(ts, held, worker, now, promised, running if first else None)
            verdicts.append(v)
            promised[v.worker] = promised.get(v.worker, 0) + v.need
        actions = {v.action for v in verdicts}
        if FAIL in actions:  # one never fits: a gang fails as one, none holds a thread waiting
            reason = next(v.reason for v in verdicts if v.action == FAIL)
            for (key, ts, held), v in zip(unit, verdicts):
                self._apply(key, ts, held, v._replace(action=FAIL, victims=(), reason=reason), stimulus)
            return
        if not first:  # an older task waits there: this one queues behind it
            for line in mine:
                lines.setdefault(line, []).append((unit, verdicts))
            return
        if actions == {ADMIT}:
            for (key, ts, held), v in zip(unit, verdicts):
                self._apply(key, ts, held, v, stimulus)
            return
        why = next(v.reason for v in verdicts if v.action != ADMIT)
        blocked.update(dict.fromkeys(mine, why))  # the oldest waiting on its lines
        if STUCK in actions:
            stuck |= mine
        for line in mine:
            lines.setdefault(line, []).append((unit, verdicts))

    def _break_deadlock(self, lines: dict, blocked: dict, stuck: set, stimulus: str) -> None:
        """Break a deadlock, as a serving engine preempts its newest requests. For each stuck
        line, the room its oldest task lacks is made (``policy.admission.make_room``): on a
        worker where it fits now, by moving it there with what was planned after it; else by
        failing with ``KVPreempted`` a waiting task (or gang) of each of the fewest waiting
        workflow runs younger than its run whose release frees that room - on its planned
        worker if possible, else where it then fits (a block shared by several runs is freed
        only when all of them go; a run parked on another worker may hold this one's room).
        When none exists, the line's youngest task is preempted. Preempted workflows release
        what they hold and retry, keeping their place in line. (Preempting a run that holds
        nothing there frees nothing: done again and again, that is a livelock.) The line's
        patience starts again."""
        waiting = {id(u): (u, v) for queued in lines.values() for u, v in queued}
        by_age = sorted(waiting.values(), key=lambda uv: _rank(uv[0]), reverse=True)
        victims: list[tuple] = []  # (unit, verdicts, why)
        now = time.time()
        for line in sorted(stuck, key=str):
            oldest = lines[line][0]
            # Only runs younger than the one waiting: each stuck line preempting for its own
            # oldest, two lines whose oldest runs pin each other's room would preempt both,
            # and both come back to the same deadlock (a livelock). The oldest run of all is
            # never preempted for another, so it gets its room and the line moves.
            others = {}  # run -> one of its waiting units, youngest run first
            over = self._over_quota(line[0], now)
            for unit, verdicts in by_age:
                if _younger(unit, oldest[0]) and _may_preempt_for(unit, line, over):
                    others.setdefault(_run_of(unit), (unit, verdicts))
            plan = make_room(self._rooms(line[0], *oldest, now), list(others))
            if plan is None:
                unit, verdicts = lines[line][-1]  # the youngest there: its own run's, or a younger run's
                victims.append((unit, verdicts, blocked[line] + "; preempted (the youngest task waiting there) so "
                                                                "older ones can run: retry it"))
            else:
                worker, runs = plan
                if worker != line[0]:
                    self._move(oldest[0][0], worker)
                why = blocked[line] + "; preempted (a waiting workflow holding KV there, the youngest such) so the " \
                                      "oldest waiting there can run: retry it"
                victims += [(*others[r], why) for r in runs]
            self._floors.pop(line, None)  # its patience starts again: the victims' releases take a moment
        done: set = set()
        for unit, verdicts, reason in victims:
            if unit[0][2].flow is not None:
                self._usage.end_leases(_run_of(unit))
                if self.on_preempt is not None:
                    self.on_preempt(*_run_of(unit))
            for (key, ts, held), v in zip(unit, verdicts):
                if key in done or key not in self._held:
                    continue
                done.add(key)
                self._held.pop(key, None)
                self._events.record("preempt", held.namespace, worker=v.worker, key=str(key), reason=reason)
                self._catalog.count("preemptions", namespace=held.namespace)
                di.fail_task(self._scheduler, key, KVPreempted(reason), stimulus)
        self.note_progress()

    def _over_quota(self, worker: str, now: float) -> set:
        """The tenants holding more than their quota on ``worker`` (none without quotas)."""
        if not self._quotas or worker not in self._scheduler.workers:
            return set()
        held = self._usage.usage(self._scheduler.workers[worker], now).by_owner
        return {ns for ns, n in held.items() if n > self._quotas.get(ns, 0)}

    def _rooms(self, planned: str, unit: list, verdicts: list, now: float) -> list[Room]:
        """The workers a stuck unit could run on, its planned one first, with the room it lacks
        on each. A gang stays on its planned workers (its chunks were placed together)."""
        budget = self._settings.kv_budget_bytes or 0

        def lacking(worker: str, need: int) -> int:
            wu = self._usage.usage(self._scheduler.workers[worker], now)
            return max(1, _unfreeable(wu, self._reserved_on(worker)) + need - budget)

        need = sum(v.need for v in verdicts if v.worker == planned)
        rooms = [Room(planned, lacking(planned, need), self._runs.pins_on(planned, self._held))]
        if len(unit) == 1:
            _, ts, held = unit[0]
            for w in self._other_workers(ts, planned):
                v = self._decide(ts, held, w, now)
                rooms.append(Room(w, 0 if v.action == ADMIT else lacking(w, v.need), self._runs.pins_on(w, self._held)))
        return rooms

    def _pick_worker(self, ts, held: Held, now: float) -> str | None:
        """The planned worker while it lives. Once it is gone, a running worker where the task
        fits now (``_fits_elsewhere``); where none fits, the one holding most of its inputs.
        (Sent only by input locality, a replanned task may wait behind a survivor full of
        pinned blocks while the restarted workers stand empty.)"""
        if held.target in self._scheduler.workers:
            return held.target
        fits = self._fits_elsewhere(ts, held, now)
        if fits is not None:
            return fits
        inputs = _input_bytes(ts)
        if inputs:
            return max(sorted(inputs), key=inputs.get)
        return next(iter(self._other_workers(ts, held.target)), None)

    def _other_workers(self, ts, planned: str | None) -> list[str]:
        """The running workers but ``planned``, those holding most of ``ts``'s inputs first, then
        the least busy."""
        inputs = _input_bytes(ts)
        order = sorted((ws for ws in di.running_workers(self._scheduler) if ws.address != planned),
                       key=lambda ws: (-inputs.get(ws.address, 0), len(ws.processing), ws.address))
        return [ws.address for ws in order]

    def _fits_elsewhere(self, ts, held: Held, now: float) -> str | None:
        """A running worker other than the planned one where the task fits now
        (``_other_workers``' order); None when it fits on none."""
        return next((w for w in self._other_workers(ts, held.target)
                     if self._decide(ts, held, w, now).action == ADMIT), None)

    def _move(self, entry: tuple, worker: str) -> None:
        """Send a parked task to ``worker`` instead of its planned one, with the tasks planned
        to run after it there (``kv_replan``)."""
        key, ts, held = entry
        old, held.target = held.target, worker
        moved = replan_downstream(self._scheduler, self._held, ts, old, worker)
        self._events.record("relocate", held.namespace, key=str(key), worker=worker, source=old, dependents=moved)

    def _decide(self, ts, held: Held, worker: str, now: float, promised: dict | None = None,
                running: set | None = None) -> Verdict:
        """The verdict for one parked task on ``worker``.

        ``promised``: worker -> bytes this pass already gave the task's gang there;
        ``running``: the workers where admitted KV tasks still run, given for the oldest task
        waiting on its line - the one whose wait can be declared a deadlock (STUCK): when
        nothing ran or was freed anywhere for ``admission-patience``, or when its line's room
        has not grown for ``STARVING`` patiences while nothing admitted there runs (other
        workers' progress may never free this one's room).
        """
        budget = self._settings.kv_budget_bytes
        if budget is None:  # the budget was lifted meanwhile
            return Verdict(ADMIT, (), "", worker, 0)
        ws = self._scheduler.workers[worker]
        need = held.out_bytes + self._usage.incoming(ts, worker)
        wu = self._usage.usage(ws, now)
        promised_here = (promised or {}).get(worker, 0)
        reserved = self._reserved_on(worker) + promised_here
        tenancy = NO_QUOTAS
        if self._quotas:
            by_owner = self._reserved_by_owner(worker)
            by_owner[held.namespace] = by_owner.get(held.namespace, 0) + promised_here
            tenancy = Tenancy(held.namespace, self._quotas, wu.by_owner, by_owner)
        d = admit(need, wu.used, reserved, budget, wu.blocks, now, True, 0.0,
                  self._settings.admission_patience, worker, tenancy)
        action = d.action
        if action == WAIT and running is not None:
            patience = self._settings.admission_patience
            unfreeable = _unfreeable(wu, reserved)
            grew_at = self._room_grew_at(self._line(worker, held.namespace), ts.key, unfreeable, now)
            idle = not running and now - max(held.since, self._progress_at) >= patience
            starving = worker not in running and now - max(held.since, grew_at) >= STARVING * patience
            action = STUCK if idle or starving else WAIT
        return Verdict(action, d.victims, d.reason, worker, need)

    def _room_grew_at(self, line: tuple, key, unfreeable: int, now: float) -> float:
        """When the room of ``line``'s oldest waiting task (``key``) last grew: the KV there
        that eviction cannot free fell below its least so far. Progress elsewhere in the
        cluster does not count: a worker whose line never moves is deadlocked however busy
        the others are."""
        floor = self._floors.get(line)
        if floor is None or floor[0] != key or unfreeable < floor[1]:
            floor = self._floors[line] = (key, unfreeable, now)
        return floor[2]

    def _promised(self, h: Held, worker: str) -> int:
        """What admitted task ``h`` may still add to ``worker``'s memory: its output, and the
        inputs it fetches until they are there (then they count where they are, once)."""
        tasks, out = self._scheduler.tasks, h.reserved
        for key in h.fetch:
            ts = tasks.get(key)
            if ts is not None and not any(ws.address == worker for ws in ts.who_has or ()):
                out += ts.get_nbytes()
        return out

    def _reserved_on(self, worker: str) -> int:
        """Bytes promised to tasks admitted on ``worker`` and still running (``_promised``)."""
        return sum(self._promised(h, worker) for h in self._held.values() if h.worker == worker)

    def _reserved_by_owner(self, worker: str) -> dict[str | None, int]:
        """Bytes promised to each namespace's admitted, running tasks on ``worker``."""
        out: dict[str | None, int] = {}
        for h in self._held.values():
            if h.worker == worker:
                out[h.namespace] = out.get(h.namespace, 0) + self._promised(h, worker)
        return out

    def _apply(self, key, ts, held: Held, verdict: Verdict, stimulus: str) -> None:
        action, victims, reason, worker, need = verdict
        if action == ADMIT:
            self._evict(worker, victims, stimulus)
            back, loads = self._read_back(ts, worker)
            fetch = tuple(d.key for d in ts.dependencies if self._usage.is_kv(d.key)
                          and not any(w.address == worker for w in d.who_has or ()))
            fetched = sum(d.get_nbytes() for d in ts.dependencies if d.key in fetch)
            # read back: counted where they are now, in the worker's memory; fetched: until they arrive
            held.worker, held.reserved, held.fetch, held.loads = worker, max(0, need - back - fetched), fetch, loads
            di.pin(self._scheduler, ts, worker)
            di.reschedule(self._scheduler, [key], stimulus)
        elif action == FAIL:
            self._held.pop(key, None)
            self._events.record("over-budget", held.namespace, worker=worker, key=str(key), reason=reason)
            di.fail_task(self._scheduler, key, KVBudgetError(reason), stimulus)

    def _read_back(self, ts, worker: str) -> tuple[int, tuple]:
        """``ts`` is admitted on ``worker``: its inputs on the spill disk there count as in
        memory from now on (it reads them back as it starts). -> their bytes and keys. An input that
        every holder has on disk is read from there to be sent, and stays there (the worker
        plugin's ``keep_spilled_on_peer_reads``): it counts where it arrives (``_promised``)."""
        if self._tiers is None:
            return 0, ()
        here = self._usage.spilled_inputs(ts, worker)
        # inputs an earlier admitted task here reads back already: counted in memory since its
        # admission; this task joins it as a reader, so they stay counted until both leave
        joined = self._tiers.loading_of(worker, [d.key for d in ts.dependencies])
        if here or joined:
            self._tiers.mark_loaded(worker, here + joined)
        tasks, back = self._scheduler.tasks, 0
        for key in here:
            back += tasks[key].get_nbytes()
            self._catalog.count("bytes_read_back", tasks[key].get_nbytes(), self._catalog.namespace_of(key))
        for d in ts.dependencies:
            holders = [w.address for w in d.who_has or ()]
            if worker in holders or not holders or not all(self._tiers.spilled_on(d.key, w) for w in holders):
                continue
            self._catalog.count("bytes_read_back", d.get_nbytes(), self._catalog.namespace_of(d.key))
        return back, tuple(here + joined)

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

    def _trim(self, addr: str, ws, budget: int, now: float, stimulus: str) -> list:
        """Evict unpinned blocks on one worker until it is within the budget. -> evicted keys."""
        wu = self._usage.usage(ws, now)
        room = budget - self._reserved_on(addr)
        if wu.used <= room:
            self._over_budget.discard(addr)
            return []
        plan = choose_victims(wu.blocks, wu.used, room, now, floors=self._quotas, held=wu.by_owner)
        self._evict(addr, plan.victims, stimulus)
        if plan.over_budget_pinned:
            self._dirty = True  # check again: pinned blocks become evictable when released
            if addr not in self._over_budget:
                self._over_budget.add(addr)
                logger.info("worker %s holds %d KV bytes, over its budget, all pinned", addr, plan.remaining_bytes)
                self._events.record("over-budget", None, worker=addr, nbytes=plan.remaining_bytes)
        else:
            self._over_budget.discard(addr)
        return list(plan.victims)

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
            evicted += self._trim(addr, ws, budget, now, stimulus)
        self._evicting = {k for k in self._evicting if k in self._scheduler.tasks}  # dropped some other way
        self._flushed &= self._evicting
        return evicted
