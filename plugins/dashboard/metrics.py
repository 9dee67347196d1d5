"""Prometheus metrics of the KV cache under the scheduler's ``/metrics``.

The numbers are the ones the KV dashboard page shows, read from the KV scheduler plugin
through its operator views (``operator_counters``, ``operator_catalog``), and named after the
page's counters with a ``daskflow_kv_`` prefix:

====================================  ======================================================
``daskflow_kv_tokens_reused_total``    prompt tokens taken from cached KV blocks
``daskflow_kv_tokens_computed_total``  prompt tokens prefilled
``daskflow_kv_reuse_ratio``            reused / (reused + computed)
``daskflow_kv_bytes_transferred_total``  KV bytes the plan moved between workers
``daskflow_kv_transfers_total``        transfer decisions carried out
``daskflow_kv_recomputes_total``       prefixes the cost model chose to prefill again
``daskflow_kv_lineage_recomputes_total``  blocks Dask recomputed from lineage (lost, released)
``daskflow_kv_evictions_total``        blocks released under the byte budget
``daskflow_kv_bytes_evicted_total``    bytes those blocks held
``daskflow_kv_evictions_regretted_total``  evicted blocks that were needed, and made, again
``daskflow_kv_preemptions_total``      waiting tasks the budget preempted (their level redone)
``daskflow_kv_store_writes_total``     blocks workers wrote to the persistent store
``daskflow_kv_store_bytes_written_total``  bytes those blocks hold
``daskflow_kv_store_loads_total``      blocks loaded from the store instead of prefilled
``daskflow_kv_store_bytes_read_total``  bytes those blocks hold
``daskflow_kv_store_corrupt_total``    stored objects that failed verification (recomputed)
``daskflow_kv_worker_bytes{worker}``   KV bytes each worker holds now
``daskflow_kv_worker_budget_bytes``    per-worker KV budget (absent when unbounded)
``daskflow_kv_engine_{batch,mean_batch,step_seconds,waiting,running}{worker}``  each worker's continuous-batching loop
``daskflow_kv_states{status}``         catalogued states by status (live, released)
``daskflow_kv_blocks{status}``         catalogued blocks by status (memory, evicted, ...)
====================================  ======================================================

No series names a namespace unless the operator sets ``daskflow-kv.dashboard.tenant-labels``
(a tenant's name is not for whoever can scrape the port); then three more come with a
``namespace`` label: ``daskflow_kv_tenant_states{namespace,status}``,
``daskflow_kv_tenant_blocks{namespace,status}`` and ``daskflow_kv_tenant_bytes{namespace}``
(KV bytes workers hold for the namespace's blocks, each copy counted).

One collector is registered in ``prometheus_client.REGISTRY`` per process, while at least
one scheduler has installed it (``install`` / ``uninstall``, reference counted, so several
schedulers in one process never register the same names twice). Which scheduler it
reports is decided per request: the KV dashboard plugin serves ``/metrics`` through
``KVPrometheusHandler``, Dask's own handler with the serving scheduler set around
``generate_latest``; outside a request it reports the scheduler installed last (as Dask's
own collectors do).
"""

from __future__ import annotations

import contextvars
import importlib.util
import logging
import math
import re
import threading
import weakref
from collections import Counter

from daskflow_kv import config, keys

logger = logging.getLogger("daskflow_kv.metrics")

PREFIX = "daskflow_kv_"
KV_PLUGIN_NAME = keys.PLUGIN_NAME  # KVSchedulerPlugin.name

# Page counter name -> (help text, prometheus type). Counters get "_total" appended.
COUNTERS = {
    "tokens_reused": ("Prompt tokens taken from cached KV blocks", "counter"),
    "tokens_computed": ("Prompt tokens prefilled on workers", "counter"),
    "reuse_ratio": ("Tokens reused / (reused + computed)", "gauge"),
    "bytes_transferred": ("KV bytes moved between workers by transfer decisions", "counter"),
    "transfers": ("Transfer decisions carried out (one per destination)", "counter"),
    "recomputes": ("KV prefixes the cost model chose to prefill again on a destination", "counter"),
    "lineage_recomputes": ("KV blocks Dask computed again from lineage after they left memory", "counter"),
    "evictions": ("KV blocks released under the per-worker byte budget", "counter"),
    "bytes_evicted": ("KV bytes released under the per-worker byte budget", "counter"),
    "evictions_regretted": ("Evicted KV blocks that were needed, and made, again", "counter"),
    "preemptions": ("Waiting KV tasks the budget preempted to break a deadlock (their level is redone)", "counter"),
    "store_writes": ("KV blocks workers wrote to the persistent store", "counter"),
    "store_bytes_written": ("KV bytes workers wrote to the persistent store", "counter"),
    "store_loads": ("KV blocks loaded from the persistent store instead of prefilled", "counter"),
    "store_bytes_read": ("KV bytes loaded from the persistent store", "counter"),
    "store_corrupt": ("Stored KV objects that failed verification and were recomputed", "counter"),
}

# Series naming a namespace, only with daskflow-kv.dashboard.tenant-labels: (name, help, labels).
TENANT_FAMILIES = (
    ("tenant_states", "Catalogued KV states by namespace and status", ["namespace", "status"]),
    ("tenant_blocks", "Catalogued KV blocks by namespace and status", ["namespace", "status"]),
    ("tenant_bytes", "KV bytes workers hold for a namespace's blocks (each copy counted)", ["namespace"]),
)

_current_scheduler: contextvars.ContextVar = contextvars.ContextVar("daskflow_kv_metrics_scheduler", default=None)


def metric_name(counter: str) -> str:
    """The exposed Prometheus name of a page counter (what ``/metrics`` lists)."""
    kind = COUNTERS.get(counter, ("", "counter"))[1]
    return PREFIX + _sanitize(counter) + ("_total" if kind == "counter" else "")


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", str(name))


# -- reading the KV plugin (shared with the dashboard) -------------------------------------
def kv_plugin(scheduler):
    """The KV scheduler plugin on ``scheduler``, or None when it is not loaded (yet)."""
    plugins = getattr(scheduler, "plugins", None) or {}
    p = plugins.get(KV_PLUGIN_NAME)
    if p is not None:
        return p
    for p in plugins.values():  # renamed? recognise it by its interface
        if hasattr(p, "operator_counters") and hasattr(p, "operator_catalog"):
            return p
    return None


def _num(v, default=0.0) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return f if math.isfinite(f) else default


def read_counters(plugin) -> dict:
    """``operator_counters()`` normalised: counters (all numeric), kv_bytes, budget, decisions, events."""
    try:
        raw = plugin.operator_counters() or {}
    except Exception:  # a plugin mid-refactor must not take the page or /metrics down
        logger.exception("daskflow-kv: operator_counters failed")
        raw = {}
    counters = {k: _num(v) for k, v in (raw.get("counters") or {}).items() if _num(v, None) is not None}
    for name in COUNTERS:
        counters.setdefault(name, 0.0)
    total = counters["tokens_reused"] + counters["tokens_computed"]
    if "reuse_ratio" not in (raw.get("counters") or {}):
        counters["reuse_ratio"] = counters["tokens_reused"] / total if total else 0.0
    kv_bytes = raw.get("kv_bytes")
    if kv_bytes is None and hasattr(plugin, "kv_bytes_by_worker"):
        try:
            kv_bytes = plugin.kv_bytes_by_worker()
        except Exception:  # noqa: BLE001 -- as above
            kv_bytes = {}
    budget = raw.get("kv_budget_bytes", getattr(plugin, "kv_budget_bytes", None))
    return {
        "counters": counters,
        "kv_bytes": {str(w): int(_num(b)) for w, b in (kv_bytes or {}).items()},
        "kv_budget_bytes": None if budget is None else int(_num(budget)),
        "decisions": list(raw.get("decisions") or []),
        "events": list(raw.get("events") or []),
    }


def read_catalog(plugin) -> list[dict]:
    try:
        return list(plugin.operator_catalog() or [])
    except Exception:  # as in read_counters
        logger.exception("daskflow-kv: operator_catalog failed")
        return []


def status_counts(plugin, rows: list[dict] | None = None) -> tuple[Counter, Counter]:
    """(states by status, blocks by status) from the catalog rows, one count per id."""
    rows = read_catalog(plugin) if rows is None else rows
    states, blocks = {}, {}
    for r in rows:
        if r.get("state_id"):
            states[r["state_id"]] = r.get("state_status") or "live"
        if r.get("block_key"):
            blocks[r["block_key"]] = r.get("status") or "unknown"
    return Counter(states.values()), Counter(blocks.values())


def tenant_counts(rows: list[dict]) -> tuple[Counter, Counter, Counter]:
    """Per namespace: (states by (namespace, status), blocks by (namespace, status), KV bytes
    workers hold by namespace, each copy counted); one count per id."""
    states, blocks = {}, {}
    for r in rows:
        ns = str(r.get("namespace") or "")
        if r.get("state_id"):
            states[r["state_id"]] = (ns, r.get("state_status") or "live")
        if r.get("block_key"):
            blocks[r["block_key"]] = (ns, r.get("status") or "unknown", int(_num(r.get("nbytes"))),
                                      len([w for w in str(r.get("workers") or "").split(",") if w]))
    held = Counter()
    for ns, _, nbytes, copies in blocks.values():
        held[ns] += nbytes * copies
    return Counter(states.values()), Counter((ns, st) for ns, st, _, _ in blocks.values()), held


def tenant_labels() -> bool:
    """Whether /metrics names namespaces (``daskflow-kv.dashboard.tenant-labels``; off by default)."""
    return bool(config.get("dashboard.tenant-labels"))


# -- the collector ---------------------------------------------------------------------------
class KVMetricsCollector:
    """A prometheus_client collector for the KV plugin of the scheduler being served."""

    def __init__(self) -> None:
        self._schedulers: list = []  # weakrefs, installation order; the last is the default

    def add(self, scheduler) -> None:
        self.remove(scheduler)
        self._schedulers.append(weakref.ref(scheduler))

    def remove(self, scheduler) -> None:
        self._schedulers = [r for r in self._schedulers if r() is not None and r() is not scheduler]

    def __len__(self) -> int:
        return sum(1 for r in self._schedulers if r() is not None)

    def scheduler(self):
        current = _current_scheduler.get()
        if current is not None:
            return current
        for r in reversed(self._schedulers):
            s = r()
            if s is not None:
                return s
        return None

    def describe(self):
        """Fixed families only, so the registry can check name clashes without collecting."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, (doc, kind) in COUNTERS.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield cls(PREFIX + name, doc)
        yield GaugeMetricFamily(PREFIX + "worker_bytes", "KV bytes held per worker", labels=["worker"])
        yield GaugeMetricFamily(PREFIX + "worker_budget_bytes", "Per-worker KV byte budget")
        for name, doc in ENGINE_FAMILIES:
            yield GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
        for name, doc in GATE_FAMILIES:
            yield GaugeMetricFamily(PREFIX + name, doc)
        yield GaugeMetricFamily(PREFIX + "states", "Catalogued KV states by status", labels=["status"])
        yield GaugeMetricFamily(PREFIX + "blocks", "Catalogued KV blocks by status", labels=["status"])
        for fam, doc, labels in TENANT_FAMILIES:
            yield GaugeMetricFamily(PREFIX + fam, doc, labels=labels)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        scheduler = self.scheduler()
        plugin = kv_plugin(scheduler) if scheduler is not None else None
        if plugin is None:
            return
        snap = read_counters(plugin)
        counters = snap["counters"]
        for name, value in counters.items():
            doc, kind = COUNTERS.get(name, (f"daskflow-kv counter {name}", "counter"))
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield cls(PREFIX + _sanitize(name), doc, value=value)
        per_worker = GaugeMetricFamily(PREFIX + "worker_bytes", "KV bytes held per worker", labels=["worker"])
        for worker, nbytes in sorted(snap["kv_bytes"].items()):
            per_worker.add_metric([worker], nbytes)
        yield per_worker
        if snap["kv_budget_bytes"] is not None:
            yield GaugeMetricFamily(PREFIX + "worker_budget_bytes", "Per-worker KV byte budget",
                                    value=snap["kv_budget_bytes"])
        yield from _engine_families(plugin, scheduler)
        yield from _gate_families(plugin)
        rows = read_catalog(plugin)
        states, blocks = status_counts(plugin, rows)
        for fam, counts, doc in (("states", states, "Catalogued KV states by status"),
                                 ("blocks", blocks, "Catalogued KV blocks by status")):
            g = GaugeMetricFamily(PREFIX + fam, doc, labels=["status"])
            for status, n in sorted(counts.items()):
                g.add_metric([status], n)
            yield g
        if tenant_labels():  # the operator chose to name namespaces here
            for (fam, doc, labels), counts in zip(TENANT_FAMILIES, tenant_counts(rows)):
                g = GaugeMetricFamily(PREFIX + fam, doc, labels=labels)
                for label, n in sorted(counts.items()):
                    g.add_metric(list(label) if isinstance(label, tuple) else [label], n)
                yield g


# Each worker's continuous-batching loop (``kv_engines``): (family, help) -> the gauge's field.
ENGINE_FAMILIES = (
    ("engine_batch", "Requests in the last step of a worker's continuous-batching loop"),
    ("engine_mean_batch", "Mean requests per step of a worker's loop since it started"),
    ("engine_step_seconds", "Seconds the last step of a worker's loop took"),
    ("engine_waiting", "Requests waiting to join a worker's running batch"),
    ("engine_running", "Requests in a worker's running batch"),
)
_ENGINE_FIELDS = {"engine_batch": "batch", "engine_mean_batch": "mean_batch", "engine_step_seconds": "step_s",
                  "engine_waiting": "waiting", "engine_running": "running"}


def _engine_families(plugin, scheduler):
    from prometheus_client.core import GaugeMetricFamily

    engines = getattr(plugin, "engines", None)
    if engines is None:
        return
    gauges = {addr: engines.of(addr).as_dict() for addr in sorted(getattr(scheduler, "workers", {}))}
    for name, doc in ENGINE_FAMILIES:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
        for addr, e in gauges.items():
            g.add_metric([addr], e[_ENGINE_FIELDS[name]])
        yield g


# The workflow gate (``kv_gate``), cluster-wide counts only: no tenant's runs are named here.
GATE_FAMILIES = (
    ("workflows_running", "Workflow runs inside the workflow gate (every run passes it, limit or not)"),
    ("workflows_waiting", "Workflow runs waiting in the workflow gate's line"),
    ("workflow_gate_slots", "Workflow runs the gate lets in at once (absent: no limit)"),
)


def _gate_families(plugin):
    from prometheus_client.core import GaugeMetricFamily

    gate = getattr(plugin, "gate", None)
    if gate is None:
        return
    view = gate.view()
    values = {"workflows_running": view["running"], "workflows_waiting": view["waiting"],
              "workflow_gate_slots": view["slots"]}
    for name, doc in GATE_FAMILIES:
        if values[name] is not None:
            yield GaugeMetricFamily(PREFIX + name, doc, value=values[name])


_lock = threading.Lock()
_collector: KVMetricsCollector | None = None


def prometheus_available() -> bool:
    return importlib.util.find_spec("prometheus_client") is not None


def install(scheduler) -> bool:
    """Report ``scheduler``'s KV plugin in the process registry. Idempotent; False without prometheus_client."""
    global _collector
    if not prometheus_available():
        return False
    import prometheus_client

    with _lock:
        if _collector is None:
            collector = KVMetricsCollector()
            prometheus_client.REGISTRY.register(collector)
            _collector = collector
        _collector.add(scheduler)
    return True


def uninstall(scheduler) -> None:
    """Stop reporting ``scheduler``; the collector leaves the registry with the last one."""
    global _collector
    with _lock:
        if _collector is None:
            return
        _collector.remove(scheduler)
        if len(_collector) == 0:
            import prometheus_client

            try:
                prometheus_client.REGISTRY.unregister(_collector)
            except KeyError:
                pass
            _collector = None


def installed_collector() -> KVMetricsCollector | None:
    return _collector


def prometheus_handler_class():
    """Dask's scheduler ``/metrics`` handler, reporting the KV plugin of the scheduler it serves.

    None without prometheus_client (Dask then serves its "not available" text itself).
    """
    if not prometheus_available():
        return None
    from daskflow_kv import dask_internals as di

    class KVPrometheusHandler(di.prometheus_handler_base()):
        def get(self):
            token = _current_scheduler.set(self.server)
            try:
                super().get()
            finally:
                _current_scheduler.reset(token)

    return KVPrometheusHandler


def generate(scheduler) -> bytes:
    """The exposition text ``/metrics`` serves for ``scheduler`` (Dask's metrics and ours)."""
    import prometheus_client

    token = _current_scheduler.set(scheduler)
    try:
        return prometheus_client.generate_latest(prometheus_client.REGISTRY)
    finally:
        _current_scheduler.reset(token)
