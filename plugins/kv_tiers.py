"""Where each KV block's bytes are: worker memory, a worker's spill disk, or the store.

Dask knows a key is "in memory" on a worker, not whether that worker's SpillBuffer has
moved it to disk; the persistent store is not Dask's at all. Workers tell the plugin both
(``runtime.kv_worker``, one ``kv_worker_report`` RPC when something changed):

* ``spilled``: the KV block keys on the worker's spill disk now (the whole list, so a
  lost report is repaired by the next one);
* ``events``: store writes finished (the block is persisted), loads, corrupt objects.

The budget counts only blocks in memory (``spilled_on``); the catalog shows each block's
tier. The RPC is open to workers (they have no tenant session): Dask trusts every
participant anyway (see docs/security.md), and a report can only mislabel tiers.

A mixin of ``KVSchedulerPlugin``.
"""

from __future__ import annotations



class KVTiers:
    def handle_worker_report(self, worker: str, spilled: list[str] | None = None, events=()) -> None:
        if worker not in self.scheduler.workers:
            return
        if spilled is not None:
            before = self.spilled.get(worker, frozenset())
            self.spilled[worker] = frozenset(spilled)
            if before != self.spilled[worker]:
                self._dirty = True  # budget use changed: spilled blocks no longer count
        for e in events or ():
            op = e.get("op")
            if op == "write" and e.get("written"):
                self.catalog.count("store_writes")
                self.catalog.count("store_bytes_written", int(e.get("nbytes") or 0))
            if op == "write":  # written now, or there already: either way a copy is stored
                self.catalog.mark_persisted(e.get("key"))
            elif op == "load":
                self.catalog.count("store_loads", int(e.get("blocks") or 0))
                self.catalog.count("store_bytes_read", int(e.get("nbytes") or 0))
                self.catalog.count("store_corrupt", int(e.get("corrupt") or 0))
                if e.get("corrupt"):
                    self._event("store-corrupt", None, worker=worker)
            elif op == "write-failed":
                self.catalog.mark_persisted(e.get("key"), False)
                self._event("store-write-failed", None, worker=worker, error=str(e.get("error", ""))[:200])

    def spilled_on(self, key, worker: str) -> bool:
        return key in self.spilled.get(worker, ())

    def tier(self, key, ts) -> str:
        """memory | spilled | store | "" (see state.catalog)."""
        if ts is not None and ts.state == "memory" and ts.who_has:
            if all(self.spilled_on(key, ws.address) for ws in ts.who_has):
                return "spilled"
            return "memory"
        entry = self.catalog.blocks.get(key)
        return "store" if entry is not None and entry.persisted else ""
