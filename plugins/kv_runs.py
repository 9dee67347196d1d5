"""Workflow runs as the KV budget sees them: their place in line, and what they keep pinned.

A run is one workflow's execution (``daskflow_kv.runtime.workflow_run``); its tasks, states
and prefix lookups carry its name (``flow``), scoped by namespace so a tenant cannot borrow
another's place. The budget admits waiting tasks in the order their runs were first seen
(``start``), and to break a deadlock preempts the runs whose release frees the room a stuck
line lacks (``pins_on``: each pinned block with the runs that keep it). A parked task whose
run let go, but whose blocks the cache already wants, is found by ``pending_only_for_cache``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from daskflow_kv.keys import CACHE_CLIENT
from daskflow_kv.state.catalog import KVCatalog

from .kv_usage import KVUsage

MAX_FLOWS = 4096  # workflow runs remembered for their place in line (the oldest-seen go first)
FLOW_IDLE_S = 300.0  # a run with no task for this long is forgotten: a reused name starts anew
MAX_SENIORITY_S = 600.0  # a run's place in line dates back at most this far (a name kept for ever jumps no line)


def pending_only_for_cache(ts, limit: int = 512) -> set | None:
    """The not-yet-computed keys downstream of ``ts`` that only the cache wants, when nothing
    else downstream (or ``ts`` itself) is wanted by a client; None when something is."""
    seen, stack, cache_only = {ts.key}, [ts], set()
    while stack:
        t = stack.pop()
        wanters = {cs.client_key for cs in t.who_wants or ()}
        if wanters - {CACHE_CLIENT} or t.state == "memory" and t is not ts:
            return None  # a client still waits for it, or it is made already (the cache keeps that)
        if CACHE_CLIENT in wanters:
            cache_only.add(t.key)
        for d in t.dependents:
            if d.key not in seen:
                if len(seen) >= limit:
                    return None
                seen.add(d.key)
                stack.append(d)
    return cache_only


def _waiting_for(ts, held: Mapping) -> set:
    """The runs whose preemption lets go of a block ``ts`` waits to read: its own run when
    admission parks it; else the runs of the parked tasks it waits for (a fork or a
    replica of a parked prefill errs with it); {(None, None)} when none is parked."""
    h = held.get(ts.key)
    if h is not None:
        return {(h.namespace, h.flow) if h.worker is None else (None, None)}
    up = {(u.namespace, u.flow) for u in (held.get(d.key) for d in ts.waiting_on or ())
          if u is not None and u.worker is None}
    return up or {(None, None)}


class RunLedger:
    __slots__ = ("_scheduler", "_catalog", "_usage", "_seen")

    def __init__(self, scheduler, catalog: KVCatalog, usage: KVUsage):
        self._scheduler = scheduler  # tasks: who waits on, and who wants, a pinned block
        self._catalog = catalog  # live states and the runs that made them
        self._usage = usage  # pinned blocks in memory, leases, what each client acquired for which run
        self._seen: dict[tuple, list[float]] = {}  # (namespace, run) -> [first seen, last seen]

    def start(self, namespace: str | None, flow: str | None, now: float) -> float:
        """When run ``flow`` of ``namespace`` was first seen (runs are per namespace: a tenant
        cannot borrow another's place), at most ``MAX_SENIORITY_S`` ago; ``now`` without one."""
        if flow is None:
            return now
        seen = self._seen.get((namespace, flow))
        if seen is None or now - seen[1] > FLOW_IDLE_S:
            if len(self._seen) >= MAX_FLOWS:
                self._forget_idle(now)
            seen = self._seen[(namespace, flow)] = [now, now]
        seen[1] = now
        return max(seen[0], now - MAX_SENIORITY_S)

    def forget(self, run: tuple | None) -> None:
        """A workflow run ended: its name's place in line is forgotten."""
        if run is not None:
            self._seen.pop(run, None)

    def _forget_idle(self, now: float) -> None:
        """Make room: runs idle for ``FLOW_IDLE_S`` go, else the least recently seen quarter."""
        idle = [k for k, (_, last) in self._seen.items() if now - last > FLOW_IDLE_S]
        for k in idle or sorted(self._seen, key=lambda k: self._seen[k][1])[: MAX_FLOWS // 4]:
            del self._seen[k]

    def rank_of(self, run: tuple) -> float | None:
        """When ``run`` was first seen (its place in line), None if it is not known."""
        seen = self._seen.get(run)
        return None if seen is None else seen[0]

    def pins_on(self, worker: str, held: Mapping) -> list[tuple[int, frozenset | None]]:
        """Each pinned KV block in memory on ``worker``: (bytes, the workflow runs keeping it -
        its live states', its waiting readers' (``_waiting_for``) and its lease's); None when
        something else keeps it too (a lease, a reader or a state no run claims), which no
        preemption frees."""
        return [(n, runs) for _, n, runs in self.pinned_blocks(worker, held)]

    def pinned_blocks(self, worker: str, held: Mapping) -> list[tuple[str, int, frozenset | None]]:
        """``pins_on`` with each key: (key, bytes, runs) - the cataloged blocks, then the other
        KV in memory there that something keeps (a rebuilt prefix's private blocks, a
        prefill's output not yet cut into blocks: what it adds to memory)."""
        ws = self._scheduler.workers.get(worker)
        if ws is None:
            return []
        now = time.time()
        out = []
        states = self._catalog.states
        for b in self._usage.usage(ws, now).blocks:
            ts = self._scheduler.tasks.get(b.key)
            if not b.pinned or ts is None:
                continue
            live = [states[sid] for sid in self._catalog.live_holders.get(b.key, ()) if sid in states]
            out.append((b.key, b.nbytes, self._keeping(ts, live, held, now)))
        for ts in ws.has_what:
            if ts.key in self._catalog.blocks or not self._usage.is_kv(ts.key) or not self._usage.pinned(ts, now):
                continue
            nbytes = self._usage.held_bytes(ts, ws)
            if nbytes:
                out.append((ts.key, nbytes, self._keeping(ts, [], held, now)))
        return out

    def _keeping(self, ts, live: list, held: Mapping, now: float) -> frozenset | None:
        """The workflow runs keeping ``ts`` in memory (``live``: the states holding it); None
        when something no run accounts for keeps it too."""
        runs = {(st.namespace, st.flow) for st in live}
        for cs in ts.who_wants or ():  # a client holding it outside its states: a lookup's futures
            if cs.client_key != CACHE_CLIENT and not any(st.client == cs.client_key for st in live):
                runs |= self._usage.acquired_for(ts.key, cs.client_key) or {(None, None)}
        for w in ts.waiters or ():
            runs |= _waiting_for(w, held)
        if self._usage.leased(ts.key, now):  # a lookup's lease: the runs it was taken for (ended on preemption)
            runs |= self._usage.lease_runs(ts.key) or {(None, None)}
        known = runs and all(flow is not None for _, flow in runs)
        return frozenset(runs) if known else None
