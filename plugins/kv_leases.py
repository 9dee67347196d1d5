"""Acquisition: a lookup hands its caller a reference to every block it found, at once.

``acquire`` makes the caller's client (and the cache's pseudo-client) want the keys in the
same event-loop tick as the lookup (``client_desires_keys``, as ``Variable.get`` does), so
a block found in the cache cannot be evicted before the client holds its future. Only keys
Dask holds or is computing are handed out: a released one would come back only by Dask's
unplanned rerun of the whole task that first made it, so its content is made again by a
planned prefill under a fresh key instead (``keys.rebuilt_key``). Each acquired
key is also leased for ``lease_seconds``: the budget leaves it alone until its reader's
task holds it.

A released state a later step will read can be announced (``plan``): its blocks are
evicted last until they are read again or the hint runs out (``policy.eviction``, rule 3).
"""

from __future__ import annotations

import time

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import CACHE_CLIENT
from daskflow_kv.state.catalog import KVCatalog

from .kv_settings import KVSettings

NOT_HELD = ("released", "erred", "forgotten")  # task states a lookup never hands out


def held(ts) -> bool:
    """Dask holds this task's key, or is computing it: reading it runs nothing unplanned."""
    return ts is not None and ts.state not in NOT_HELD


class LeaseBook:
    __slots__ = ("_scheduler", "_catalog", "_settings", "_until", "_planned", "_holders")

    def __init__(self, scheduler, catalog: KVCatalog, settings: KVSettings):
        self._scheduler = scheduler  # tasks and clients to want keys for
        self._catalog = catalog  # which keys are cataloged blocks (the cache keeps those)
        self._settings = settings  # lease_seconds, read at each acquisition
        self._until: dict = {}  # key -> time until which eviction leaves it alone
        self._planned: dict = {}  # key -> time until which eviction takes it last (announced reuse)
        self._holders: dict = {}  # key -> {client: {(namespace, run), ...}}: runs it was acquired for

    def acquire(self, keys: list, client: str | None, run: tuple | None = None) -> dict:
        """Make ``client`` (and the cache) want those of ``keys`` Dask holds. -> key: state.
        ``run``: the (namespace, workflow run) the client acquires them for."""
        tasks = self._scheduler.tasks
        known = [k for k in dict.fromkeys(keys) if held(tasks.get(k))]
        if not known:
            return {}
        now = time.time()
        for k in known:
            self._until[k] = now + self._settings.lease_seconds
            self._planned.pop(k, None)  # the announced reuse came: the lease takes over
            if client is not None:
                self._holders.setdefault(k, {}).setdefault(client, set()).add(run or (None, None))
        if client in self._scheduler.clients:  # not a client that has gone meanwhile
            di.want(self._scheduler, known, client)
        di.want(self._scheduler, [k for k in known if k in self._catalog.blocks], CACHE_CLIENT)
        return {k: tasks[k].state for k in known}

    def acquired_for(self, key, client: str) -> set:
        """The (namespace, workflow run)s ``client`` acquired ``key`` for that have not ended
        (``forget_run``); ``(None, None)`` among them: one acquisition said no run."""
        return self._holders.get(key, {}).get(client, set())

    def lease_runs(self, key) -> set:
        """The (namespace, workflow run)s ``key``'s lease was taken for (``(None, None)``: a
        lookup that said no run); empty when nobody's acquisition is on record."""
        return {r for runs in self._holders.get(key, {}).values() for r in runs}

    def end_leases(self, run: tuple) -> None:
        """``run`` was preempted: the leases taken only for it end now. Its lookups' blocks are
        its states' to keep, and it let those go; a lease left running would pin them until
        it expires - long enough for the run to retry and lease them again, so the task it
        was preempted for never gets their room."""
        for k in [k for k, by_client in self._holders.items() if any(run in runs for runs in by_client.values())]:
            self._forget_key_run(k, run)
            if k not in self._holders:
                self._until.pop(k, None)

    def _forget_key_run(self, key, run: tuple) -> None:
        by_client = self._holders.get(key, {})
        for c in list(by_client):
            by_client[c].discard(run)
            if not by_client[c]:
                del by_client[c]
        if not by_client:
            self._holders.pop(key, None)

    def forget_run(self, run: tuple | None) -> None:
        """A workflow run ended: what it acquired is no longer its to hold."""
        if run is None:
            return
        for k in list(self._holders):
            self._forget_key_run(k, run)

    def is_leased(self, key, now: float) -> bool:
        return self._until.get(key, 0.0) > now

    def held(self) -> int:
        """Leases and announced reuses not yet expired or forgotten (what the periodic check bounds)."""
        return len(self._until) + len(self._planned)

    def plan(self, keys, now: float) -> None:
        """A later step will read ``keys``: evict them last for ``reuse_hint`` seconds."""
        for k in keys:
            self._planned[k] = now + self._settings.reuse_hint

    def is_planned(self, key, now: float) -> bool:
        return self._planned.get(key, 0.0) > now

    def expire(self, now: float) -> None:
        """Forget leases that ran out (the periodic check)."""
        self._until = {k: t for k, t in self._until.items() if t > now}
        self._planned = {k: t for k, t in self._planned.items() if t > now}
        tasks = self._scheduler.tasks  # a holder counts while its client still wants the key
        for k in list(self._holders):
            ts = tasks.get(k)
            wanting = {cs.client_key for cs in ts.who_wants or ()} if ts is not None else set()
            kept = {c: r for c, r in self._holders[k].items() if c in wanting}
            if kept:
                self._holders[k] = kept
            else:
                del self._holders[k]
