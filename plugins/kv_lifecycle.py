"""Cataloged blocks through Dask's transitions: in memory, lost, evicted, released, recomputed.

Published blocks are also wanted by a scheduler-side pseudo-client (``CACHE_CLIENT``), so a
prefix outlives the workflow that made it and the next one reuses it. Dask's transitions
tell the catalog what happened to each block: it came (back) into memory - a second time
means Dask recomputed it from lineage -, the budget evicted it, its worker died while
someone still wanted it (lost: Dask recomputes it), or nobody wanted it any more.

A block lost with a dead worker and wanted only by the cache is not worth recomputing
now: it stays in lineage and comes back if a lookup asks for it (``drop_lost_cache_only``).
"""

from __future__ import annotations

import time

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import CACHE_CLIENT
from daskflow_kv.state.catalog import KVCatalog

from .kv_budget import BudgetEnforcer
from .kv_events import EventLog

PRUNE_INTERVAL = 5.0  # s between prunes of released states from the catalog


class BlockLifecycle:
    __slots__ = ("_scheduler", "_catalog", "_budget", "_events", "_lost_cache_only", "_pruned")

    def __init__(self, scheduler, catalog: KVCatalog, budget: BudgetEnforcer, events: EventLog):
        self._scheduler = scheduler  # who wants a block, where it is
        self._catalog = catalog  # block status and lineage recomputes
        self._budget = budget  # told when KV arrives; says which releases were its evictions
        self._events = events  # recompute and lost events
        self._lost_cache_only: set = set()  # lost with a dead worker, wanted only by the cache
        self._pruned = 0.0  # last time released states were pruned from the catalog

    def transition(self, key, start: str, finish: str) -> None:
        entry = self._catalog.blocks.get(key)
        if entry is None:
            return
        if finish == "memory":
            if self._catalog.entered_memory(key):
                ts = self._scheduler.tasks.get(key)
                where = [ws.address for ws in (ts.who_has or ())] if ts is not None else []
                self._events.record("recompute", entry.namespace, reason="lineage", key=key, workers=where)
            self._budget.note_change()
        elif start == "memory":
            self._budget.note_progress()  # room was freed: parked tasks wait on from now
            ts = self._scheduler.tasks.get(key)
            wanted = ts is not None and bool(ts.who_wants or ts.waiters)
            released = self._budget.confirm_evicted(key)
            if released:  # a flush (a budget of 0) empties the cache on purpose: no eviction to regret
                self._catalog.set_status(key, "evicted" if released == "evicted" else "released")
            elif wanted:  # its worker died; Dask recomputes it from its run spec
                self._catalog.set_status(key, "lost")
                self._events.record("lost", entry.namespace, key=key)
                if {cs.client_key for cs in ts.who_wants or ()} <= {CACHE_CLIENT} and not ts.waiters:
                    self._lost_cache_only.add(key)  # nobody but the cache needs it: see drop_lost_cache_only
            else:
                self._catalog.set_status(key, "released")
            if finish == "forgotten":
                self._catalog.forget(key)
        elif finish == "forgotten":
            self._catalog.forget(key)
        elif finish == "waiting" and entry.computed:
            self._catalog.set_status(key, "recomputing")
        elif finish == "erred":
            self._catalog.set_status(key, "erred")
            self._catalog.index.remove(key)
            # The cache lets go (after this transition batch): a block key kept erred would
            # fail every later submission of the same content instead of computing it again.
            self._scheduler.loop.add_callback(self._let_go_erred, key)

    def _let_go_erred(self, key) -> None:
        ts = self._scheduler.tasks.get(key)
        if ts is not None and ts.state == "erred":
            di.unwant(self._scheduler, [key], CACHE_CLIENT, f"kv-erred-{time.time()}")

    def drop_lost_cache_only(self, stimulus_id: str) -> int:
        """After a worker died: the cache lets go of the blocks lost with it that only the cache
        wanted (Dask would recompute them for nobody). -> how many."""
        tasks = self._scheduler.tasks
        drop = [k for k in self._lost_cache_only if self._cache_only(k) and tasks[k].state != "memory"]
        self._lost_cache_only.clear()
        for k in drop:
            self._catalog.set_status(k, "released")
        if drop:
            di.unwant(self._scheduler, drop, CACHE_CLIENT, stimulus_id)
        return len(drop)

    def drop_cache(self, stimulus_id: str) -> int:
        """The cache lets go of every cataloged block (before a cluster closes). -> how many."""
        cached = [k for k in self._catalog.blocks if k in self._scheduler.tasks]
        for k in cached:
            self._catalog.set_status(k, "released")
        di.unwant(self._scheduler, cached, CACHE_CLIENT, stimulus_id)
        return len(cached)

    def _cache_only(self, key) -> bool:
        ts = self._scheduler.tasks.get(key)
        if ts is None or ts.waiters:
            return False
        wanters = {cs.client_key for cs in ts.who_wants or ()}
        return CACHE_CLIENT in wanters and wanters <= {CACHE_CLIENT}

    def tidy(self, now: float | None = None) -> None:
        """Prune released states from the catalog, at most every ``PRUNE_INTERVAL`` seconds."""
        now = time.time() if now is None else now
        if now - self._pruned > PRUNE_INTERVAL:
            self._pruned = now
            self._catalog.prune()
