"""What the budget counts: the KV bytes each worker holds in memory, and which could go.

Cataloged blocks, replicas and prefill / store-load outputs hold K/V (``keys.holds_kv``);
a block key outside the catalog is nobody's. A block cut from an output still in memory
on the same worker shares its tensors, and a block the worker spilled to disk is not in
memory: neither adds to the worker's use. A block is pinned (never evicted) while it is
leased, read by a waiting or running task, or held by a live state.

Each KV byte has an owner: the namespace whose task computed its key (``kv_ownership``),
for the tenants' quotas (``policy.admission``).
"""

from __future__ import annotations

from typing import NamedTuple

from daskflow_kv.keys import CACHE_CLIENT, holds_kv, is_block, is_output
from daskflow_kv.policy.eviction import BlockUsage
from daskflow_kv.state.catalog import KVCatalog

from .kv_leases import LeaseBook
from .kv_ownership import KeyOwnership
from .kv_tiers import TierTracker


class WorkerUsage(NamedTuple):
    """One worker's KV in memory, as the budget sees it."""

    used: int  # KV bytes held in memory
    blocks: list[BlockUsage]  # the cataloged blocks among them, for eviction
    by_owner: dict[str | None, int]  # namespace -> its share of ``used``


class KVUsage:
    __slots__ = ("_scheduler", "_catalog", "_tiers", "_leases", "_ownership")

    def __init__(self, scheduler, catalog: KVCatalog, tiers: TierTracker, leases: LeaseBook,
                 ownership: KeyOwnership):
        self._scheduler = scheduler  # who has what, and how big
        self._catalog = catalog  # block entries: reuse, last access, chain
        self._tiers = tiers  # spilled blocks do not count
        self._leases = leases  # leased blocks are pinned
        self._ownership = ownership  # whose each KV key is

    def is_kv(self, key) -> bool:
        """Cataloged blocks, replicas and outputs (a block key outside the catalog is nobody's)."""
        return key in self._catalog.blocks or (holds_kv(key) and not is_block(key))

    def _parent_key(self, e) -> str | None:
        """The Dask key of a block's parent (its entry names the parent by content address)."""
        return None if e.parent is None else self._catalog.current_key(e.parent)

    def held_bytes(self, ts, ws) -> int:
        """What ``ts`` adds to ``ws``'s KV *memory*. A block (or a batch's branch) cut from a
        prefill's or a load's output shares its tensors: while that output is still in memory
        there, it adds nothing. A block the worker spilled to disk adds nothing either."""
        if not self.is_kv(ts.key) or self._tiers.spilled_on(ts.key, ws.address):
            return 0
        for d in ts.dependencies:
            if is_output(d.key) and ws in (d.who_has or ()):
                return 0
        return ts.get_nbytes()

    def bytes_by_worker(self) -> dict[str, int]:
        """KV bytes each worker holds in memory now."""
        return {addr: sum(self.held_bytes(ts, ws) for ts in ws.has_what)
                for addr, ws in self._scheduler.workers.items()}

    def leased(self, key, now: float) -> bool:
        return self._leases.is_leased(key, now)

    def acquired_for(self, key, client: str) -> set:
        return self._leases.acquired_for(key, client)

    def lease_runs(self, key) -> set:
        return self._leases.lease_runs(key)

    def end_leases(self, run: tuple) -> None:
        self._leases.end_leases(run)

    def pinned(self, ts, now: float) -> bool:
        """A block this worker must keep: leased, read by a waiting/running task, or held by a state."""
        if self._leases.is_leased(ts.key, now) or ts.waiters:
            return True
        if len(ts.who_has or ()) > 1:  # an extra replica: the states keep the other copy
            return False
        return any(cs.client_key != CACHE_CLIENT for cs in ts.who_wants or ())

    def usage(self, ws, now: float) -> WorkerUsage:
        """KV bytes held on one worker, the evictable view of the cataloged ones, and whose."""
        used, usage, by_owner = 0, [], {}
        for ts in ws.has_what:
            if not self.is_kv(ts.key):
                continue
            held = self.held_bytes(ts, ws)
            used += held
            e = self._catalog.blocks.get(ts.key)
            owner = e.namespace if e is not None else self._ownership.owner(ts.key)
            by_owner[owner] = by_owner.get(owner, 0) + held
            # Replicas go by themselves once read; only blocks are evicted, and only those in
            # memory: evicting a spilled one frees disk, not the memory the budget is about.
            if e is not None and not self._tiers.spilled_on(ts.key, ws.address):
                usage.append(BlockUsage(ts.key, ts.get_nbytes(), e.last_access, e.reuse_count,
                                        self.pinned(ts, now), self._parent_key(e), e.start, e.namespace,
                                        self._leases.is_planned(ts.key, now), len(ts.who_has or ()) > 1))
        return WorkerUsage(used, usage, by_owner)

    def incoming(self, ts, worker: str) -> int:
        """KV bytes ``ts`` will bring into ``worker``'s memory: its KV inputs held elsewhere
        (fetched) and those on ``worker``'s spill disk (read back)."""
        return sum(d.get_nbytes() for d in ts.dependencies
                   if self.is_kv(d.key) and (not any(w.address == worker for w in d.who_has or ())
                                             or self._tiers.spilled_on(d.key, worker)))

    def spilled_inputs(self, ts, worker: str) -> list:
        """``ts``'s KV inputs on ``worker``'s spill disk (read back when it runs there)."""
        return [d.key for d in ts.dependencies if self._tiers.spilled_on(d.key, worker)]
