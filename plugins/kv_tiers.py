"""Where each KV block's bytes are: worker memory, a worker's spill disk, or the store.

Dask knows a key is "in memory" on a worker, not whether that worker's SpillBuffer has
moved it to disk; the persistent store is not Dask's at all. Workers tell the plugin both
(``plugins.worker``, one ``kv_worker_report`` on the worker's own stream when something changed):

* ``spilled``: the KV block keys on the worker's spill disk now (the whole list, so a
  lost report is repaired by the next one);
* ``events``: store writes finished (the block is persisted), loads, corrupt objects.

The budget counts only blocks in memory (``spilled_on``); the catalog shows each block's
tier. Reports reach this part only from the worker they are about (``kv_reports``); store
counters go to the namespace whose key a write names (loads, without keys, count as the
cluster's).
"""

from __future__ import annotations

from collections import Counter

from daskflow_kv.state.catalog import KVCatalog

from .kv_events import EventLog


def _count(e: dict, name: str) -> int:
    """A non-negative count from a report (anything else counts as 0)."""
    v = e.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 60 else 0


class TierTracker:
    __slots__ = ("_catalog", "_events", "_spilled", "_loading", "_can_spill")

    def __init__(self, catalog: KVCatalog, events: EventLog):
        self._catalog = catalog  # marks persisted blocks, counts store I/O
        self._events = events  # store failures
        # worker -> KV block keys on its spill disk: its last report, updated at once where the
        # budget spills blocks or admits a task that reads some back (the next report corrects it)
        self._spilled: dict[str, frozenset] = {}
        # worker -> spilled keys admitted tasks there read back, and how many such readers: they
        # count as in memory from the first admission until the last reader leaves, whatever
        # reports sent before the read say (``mark_loaded``)
        self._loading: dict[str, Counter] = {}
        self._can_spill: dict[str, bool] = {}  # worker -> it keeps a spill disk (its reports say)

    def _key(self, e: dict) -> str | None:
        """The Dask key of the block a store event names by content address."""
        key = e.get("key")
        return self._catalog.current_key(key) if isinstance(key, str) else None

    def _namespace(self, e: dict) -> str | None:
        key = self._key(e)
        return None if key is None else self._catalog.namespace_of(key)

    def report(self, worker: str, spilled: list[str] | None = None, events=(), can_spill: bool | None = None) -> bool:
        """Take a worker's report. -> whether its spilled blocks changed (so did its KV in memory)."""
        if isinstance(can_spill, bool):
            self._can_spill[worker] = can_spill
        changed = False
        if spilled is not None:
            before = self._spilled.get(worker, frozenset())
            on_disk = frozenset(spilled)
            loading = self._loading.get(worker)
            if loading:
                for key in [k for k in loading if k not in on_disk]:
                    del loading[key]  # not on disk any more: read back, counted in memory as Dask says
                on_disk -= loading.keys()
            self._spilled[worker] = on_disk
            changed = before != self._spilled[worker]
        for e in events or ():
            self._store_event(worker, e)
        return changed

    def _store_event(self, worker: str, e: dict) -> None:
        op, ns = e.get("op"), self._namespace(e)
        if op == "write" and e.get("written"):
            self._catalog.count("store_writes", namespace=ns)
            self._catalog.count("store_bytes_written", _count(e, "nbytes"), ns)
        if op == "write":  # written now, or there already: either way a copy is stored
            self._catalog.mark_persisted(self._key(e))
        elif op == "load":
            self._catalog.count("store_loads", _count(e, "blocks"), ns)
            self._catalog.count("store_bytes_read", _count(e, "nbytes"), ns)
            self._catalog.count("store_corrupt", _count(e, "corrupt"), ns)
            if e.get("corrupt"):
                self._events.record("store-corrupt", None, worker=worker)
        elif op == "write-failed":
            self._catalog.mark_persisted(self._key(e), False)
            self._events.record("store-write-failed", None, worker=worker, error=str(e.get("error", ""))[:200])

    def forget_worker(self, worker: str) -> None:
        self._spilled.pop(worker, None)
        self._loading.pop(worker, None)
        self._can_spill.pop(worker, None)

    def can_spill(self, worker: str) -> bool:
        return self._can_spill.get(worker, False)

    def mark_spilled(self, worker: str, keys) -> None:
        """The budget asked ``worker`` to spill ``keys`` (before anything it sends after)."""
        self._spilled[worker] = self._spilled.get(worker, frozenset()) | frozenset(keys)
        loading = self._loading.get(worker, {})
        for key in keys:
            loading.pop(key, None)

    def mark_loaded(self, worker: str, keys) -> None:
        """A task admitted on ``worker`` reads ``keys`` back from its spill disk: they count as in
        memory until it has read them (``done_loading``). A report the worker sent before the
        task started still lists them on disk; taking it would give their room away twice.
        A second task admitted while they load joins the first (``loading_of``): they stay in
        memory until the last of them leaves."""
        if worker in self._spilled:
            self._spilled[worker] = self._spilled[worker] - frozenset(keys)
        self._loading.setdefault(worker, Counter()).update(keys)

    def loading_of(self, worker: str, keys) -> list:
        """Those of ``keys`` an admitted task on ``worker`` is reading back now."""
        loading = self._loading.get(worker, {})
        return [k for k in keys if k in loading]

    def done_loading(self, worker: str, keys) -> None:
        """A task that read ``keys`` back on ``worker`` left it: once no reader is left, its next
        report says where they are."""
        loading = self._loading.get(worker)
        for key in keys if loading else ():
            if loading.get(key, 0) > 1:
                loading[key] -= 1
            else:
                loading.pop(key, None)

    def spilled_bytes(self, worker: str, nbytes) -> int:
        """Bytes of the blocks on ``worker``'s spill disk (``nbytes``: key -> size)."""
        return sum(nbytes(k) for k in self._spilled.get(worker, ()))

    def spilled_on(self, key, worker: str) -> bool:
        return key in self._spilled.get(worker, ())

    def tier(self, key, ts) -> str:
        """memory | spilled | store | "" (see state.catalog) of ``key``, whose task is ``ts``."""
        if ts is not None and ts.state == "memory" and ts.who_has:
            if all(self.spilled_on(key, ws.address) for ws in ts.who_has):
                return "spilled"
            return "memory"
        entry = self._catalog.blocks.get(key)
        return "store" if entry is not None and entry.persisted else ""
