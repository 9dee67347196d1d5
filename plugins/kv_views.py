"""What the plugin shows: catalog rows and counters, scoped per namespace or for the operator.

The client API (``kv_client_api``) hands a tenant its namespace's view; the dashboard
shows the operator's (``operator_*``): every namespace, and - with tenants configured -
keys cut short, since a full block key is a capability to read the block's K/V. A
tenant's events and decisions show keys cut short too (``kv_events.public_event``); its
counters are its own namespace's, the operator's are every namespace's added up.
"""

from __future__ import annotations

from daskflow_kv.keys import CACHE_CLIENT, short_key
from daskflow_kv.state.catalog import KVCatalog, rows_to_arrow

from .kv_events import EventLog
from .kv_settings import KVSettings
from .kv_tiers import TierTracker
from .kv_rpc_counts import RpcCounts
from .kv_usage import KVUsage
from .tenants import TenantRegistry

SHOWN_DECISIONS = 32  # newest cost-model decisions in a counters view
SHOWN_EVENTS = 64  # newest lifecycle events in a counters view


class KVViews:
    __slots__ = ("_scheduler", "_settings", "_catalog", "_tiers", "_usage", "_events", "_tenants", "_rpc")

    def __init__(self, scheduler, settings: KVSettings, catalog: KVCatalog, tiers: TierTracker, usage: KVUsage,
                 events: EventLog, tenants: TenantRegistry, rpc: RpcCounts):
        self._scheduler = scheduler  # who has each block, who wants it
        self._settings = settings  # the budget shown next to each worker's KV bytes
        self._catalog = catalog  # rows and counters
        self._tiers = tiers  # each block's tier
        self._usage = usage  # KV bytes per worker
        self._events = events  # lifecycle events and decisions
        self._tenants = tenants  # open (one trust domain) or not: whether keys are cut short
        self._rpc = rpc  # kv_* RPCs answered, by name (every namespace's: the operator's view only)

    def catalog_rows(self, namespace: str | None = None) -> list[dict]:
        """Catalog rows of ``namespace`` (None: every namespace)."""
        self._catalog.prune()
        tasks = self._scheduler.tasks
        who_has, refcount, cached, tiers = {}, {}, set(), {}
        for k in self._catalog.blocks:
            ts = tasks.get(k)
            tiers[k] = self._tiers.tier(k, ts)
            if ts is None:
                continue
            who_has[k] = sorted(ws.address for ws in (ts.who_has or ()))
            refcount[k] = len(self._catalog.live_holders.get(k, ())) + len(ts.waiters or ())
            if any(cs.client_key == CACHE_CLIENT for cs in ts.who_wants or ()):
                cached.add(k)
        return self._catalog.rows(who_has, refcount, cached, namespace, tiers)

    def counters_view(self, namespace: str | None = None, public: bool = False) -> dict:
        """``namespace``'s counters (None: every namespace's, added up), per-worker KV bytes,
        and its decisions and events (``public``: keys cut short). Every namespace's view (the
        operator's, an admin's) also counts the ``kv_*`` RPCs answered, by name: the calls are
        not kept per namespace, and one tenant's traffic is not another's to read."""
        c = dict(self._catalog.counters if namespace is None else self._catalog.counters_of(namespace))
        total = c["tokens_reused"] + c["tokens_computed"]
        c["reuse_ratio"] = c["tokens_reused"] / total if total else 0.0
        view = {
            "counters": c,
            "decisions": self._events.decisions(namespace, last=SHOWN_DECISIONS, public=public),
            "kv_bytes": self._usage.bytes_by_worker(),
            "kv_budget_bytes": self._settings.kv_budget_bytes,
            "events": self._events.events(namespace, last=SHOWN_EVENTS, public=public),
        }
        if namespace is None:
            view["rpc_calls"] = self._rpc.snapshot()
        return view

    # -- the operator's (the dashboard, /metrics, catalog exports) ---------------------------------
    def operator_catalog(self) -> list[dict]:
        """Every namespace's rows; with tenants configured, block keys cut short."""
        rows = self.catalog_rows()
        if not self._tenants.open:
            for r in rows:
                r["block_key"], r["parent_key"] = short_key(r["block_key"]), short_key(r["parent_key"])
        return rows

    def operator_counters(self) -> dict:
        return self.counters_view(public=not self._tenants.open)

    def operator_events(self) -> list[dict]:
        """The whole event log, oldest first; with tenants configured, keys cut short (as the
        operator's catalog rows: the dashboard joins the two by key)."""
        return self._events.events(public=not self._tenants.open)

    def catalog_table(self):
        """The operator's catalog as Arrow (what the dashboard's /kv/catalog.* routes serve)."""
        return rows_to_arrow(self.operator_catalog())
