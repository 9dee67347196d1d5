"""The KV-aware scheduler plugin: the composition root of the scheduler side.

Dask already places tasks, moves dependencies, counts references and recomputes lost keys.
This plugin adds what Dask does not know about KV cache, one part per concern, each an
object with its own state (built at ``start``, given the parts it calls):

* ``catalog`` (``state.catalog``): blocks and states (token ranges, chains, reuse,
  lifecycle), exported as rows or an Arrow table, and a prefix index so any client finds
  the longest cached prefix;
* ``leases`` (``kv_leases``): a lookup hands the caller's client a reference to every
  matched block in the same event-loop tick, so a block found in the cache cannot be
  evicted before the client holds its future;
* ``locality`` (``kv_locality``): a KV-consuming task runs where its blocks live unless
  the plan says transfer, strictly while that worker lives; restrictions to a dead worker
  are loosened and Dask recomputes the lost blocks from lineage;
* ``lifecycle`` (``kv_lifecycle``): retention - published blocks are also wanted by a
  scheduler-side pseudo-client, so a prefix outlives the workflow that made it - and what
  Dask's transitions did to each cataloged block;
* ``budget`` (``kv_budget``, counting with ``usage``, ``kv_usage``): the per-worker KV byte
  budget, kept hard by admission before a KV task runs and eviction of the least valuable
  unpinned blocks after;
* ``tiers`` (``kv_tiers``): which blocks a worker has spilled to disk and which are in the
  persistent store, from the workers' own reports: the budget counts only blocks in memory;
* ``queue`` (``kv_queue``): predicted seconds of KV work queued per worker, for placement;
* ``profiles`` (``kv_profiles``): prefill timings reported by workers, fitted per worker for
  the cost model, and bandwidth per worker pair from Dask or a calibration probe;
* ``event_log`` (``kv_events``): lifecycle events (materialize, fork, resume, extend, merge,
  transfer, recompute, evict, lost, release) and cost-model decisions, shown per namespace;
  an open scheduler also publishes them to Dask's event log under ``EVENT_TOPIC`` with keys
  cut short (with tenants, nothing of them goes there: any client reads it);
* ``views`` (``kv_views``) and ``client_api`` (``kv_client_api``): what clients (per tenant,
  ``tenants``) and the dashboard read, and the ``kv_*`` RPCs;
* ``ownership`` (``kv_ownership``): every new task under a KV key passes here before Dask
  schedules it - only its own namespace's session may compute a key, its annotation is
  checked (``kv_notes``), and what fails is refused before anything of it runs; a graph
  holding a value no worker message carries is refused too (``kv_wire``), and whatever
  goes wrong while a graph is checked refuses its KV tasks (``update_graph`` fails closed);
* ``declared`` (``kv_declared``): with tenants, a KV task's result holds no more than the
  bytes it was admitted on, checked before the scheduler takes it;
* ``reports`` (``kv_reports``): workers' reports, accepted only from the worker itself;
* ``engines`` (``kv_engines``): each worker's continuous-batching loop (batch, step time, queue);
* ``gate`` (``kv_gate``): the workflow gate - at most so many running workflow runs per
  worker, the rest waiting in line;
* ``timeline`` (``kv_timeline``): finished workflows and periodic samples, for the KV page's
  live plots;
* ``span_history`` (``kv_span_history``): Dask's spans forget the task groups a KV stream
  keeps re-creating, so a long-running scheduler does not grow with the workflows served.

And an Active Memory Manager policy that drops extra replicas of everything but KV blocks:
their replicas are placed on purpose (the budget, not the AMM, decides when they go).

Load it with ``client.register_plugin(KVSchedulerPlugin())`` or
``dask scheduler --preload daskflow_kv.plugins.kv_scheduler [--kv-budget 2GiB]``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import click
from distributed.active_memory_manager import ReduceReplicas, Suggestion
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from daskflow_kv import config
from daskflow_kv import dask_internals as di
from daskflow_kv.keys import (BIND_OP, CACHE_CLIENT, PLUGIN_NAME, PREFILL_TOPIC, REPORT_HELLO_RPC, REPORT_OP,
                              is_block, is_placed)
from daskflow_kv.policy.cost_model import PrefillSample
from daskflow_kv.state.catalog import KVCatalog

from . import kv_wire
from .dashboard import KVDashboardPlugin
from .handoff import HandoffPlugin
from .kv_budget import BudgetEnforcer
from .kv_client_api import ClientHandlers
from .kv_declared import DeclaredKV
from .kv_events import EventLog
from .kv_gate import WorkflowGate
from .kv_leases import LeaseBook
from .kv_lifecycle import BlockLifecycle
from .kv_locality import Locality
from .kv_notes import BlockNote, ComputeNote
from .kv_ownership import KeyOwnership, cut_from_output
from .kv_profiles import ProfileBook
from .kv_queue import QueueTracker
from .kv_engines import EngineGauges
from .kv_reports import WorkerReports
from .kv_rpc_counts import RpcCounts
from .kv_settings import KVSettings
from .kv_span_history import SpanHistory
from .kv_tiers import TierTracker
from .kv_timeline import KVTimeline
from .kv_usage import KVUsage
from .kv_views import KVViews
from .tenants import AccessDenied, TenantRegistry
from .worker import KVWorkerPlugin, TorchSerializationPlugin

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

logger = logging.getLogger("daskflow_kv.scheduler")


class KVAwareReduceReplicas(ReduceReplicas):
    """Dask's ReduceReplicas for every key except KV blocks, whose replicas are placed on purpose."""

    def run(self):
        gen = super().run()
        sent = None
        while True:  # forward what the AMM sends back, as the wrapped generator expects
            try:
                suggestion: Suggestion = gen.send(sent)
            except StopIteration:
                return
            sent = None
            if not is_block(suggestion.ts.key):
                sent = yield suggestion


class KVSchedulerPlugin(SchedulerPlugin):
    """The composition root: builds the parts at ``start``, routes Dask's hooks to them.

    Each concern is one object with its own state (see the module of each); parts that need
    another hold a reference to it and call its public methods.
    """

    name = PLUGIN_NAME
    idempotent = True  # registering again (another client, a preload) keeps the running one

    settings: KVSettings  # the knobs; parts read them at each decision (kv_configure changes them)
    # -- built at start, in the scheduler's process ----------------------------------------------
    scheduler: Scheduler | None  # the Scheduler this plugin runs in (None until started)
    tenants: TenantRegistry  # namespaces, secrets, quotas, sessions (from the scheduler's own dask.config)
    catalog: KVCatalog  # blocks and states, the prefix index, the counters
    ownership: KeyOwnership  # which namespace may compute each KV key; refuses the rest
    declared: DeclaredKV  # what each KV task declared, held to it when it finishes (tenants)
    event_log: EventLog  # lifecycle events and cost-model decisions
    tiers: TierTracker  # spilled and persisted blocks, from the workers' reports
    leases: LeaseBook  # acquisition of looked-up blocks, and their leases
    usage: KVUsage  # KV bytes per worker, and what could be evicted
    budget: BudgetEnforcer  # admission of parked KV tasks, eviction
    queue: QueueTracker  # predicted and running KV task times per worker
    profiles: ProfileBook  # prefill profiles per worker, probed links per namespace
    locality: Locality  # restrictions: set from the plan, loosened when workers die
    lifecycle: BlockLifecycle  # cataloged blocks through Dask's transitions
    views: KVViews  # catalog rows and counters, per namespace or the operator's
    rpc_counts: RpcCounts  # kv_* RPCs answered, by name, counted where they enter
    client_api: ClientHandlers  # the kv_* RPCs
    reports: WorkerReports  # workers' reports, each from the worker itself
    engines: EngineGauges  # each worker's continuous-batching loop, from its reports
    gate: WorkflowGate  # running workflow runs per worker at most, the rest in line
    timeline: KVTimeline  # finished workflows and samples, for the KV page's live plots

    def __init__(
        self,
        kv_budget_bytes: int | str | None = None,
        memory_weight: float | None = None,
        evict_interval: float | str | None = None,
        lease_seconds: float | str | None = None,
    ):
        # None takes the value from dask.config["daskflow-kv"] (see daskflow-kv.yaml).
        self.settings = KVSettings.from_config(kv_budget_bytes, memory_weight, evict_interval, lease_seconds)
        self.scheduler = None
        self._pc: PeriodicCallback | None = None  # the periodic check (leases, orphans, budget)

    # -- the knobs, read-only (the admin's kv_configure changes ``settings``) ----------------------------
    @property
    def kv_budget_bytes(self) -> int | None:
        return self.settings.kv_budget_bytes

    @property
    def memory_weight(self) -> float:
        return self.settings.memory_weight

    @property
    def lease_seconds(self) -> float:
        return self.settings.lease_seconds

    # -- lifecycle ------------------------------------------------------------------------
    def _build(self, scheduler) -> None:
        """The parts, each given the others it calls (in dependency order)."""
        s, settings = scheduler, self.settings
        self.scheduler = s
        # Read here, in the scheduler's process: never from a plugin object a client pickled.
        self.tenants = TenantRegistry(config.get("tenants"), settings.session_ttl)
        self.catalog = KVCatalog()
        self.ownership = KeyOwnership(s, self.tenants, self.catalog)
        self.event_log = EventLog(s, public=self.tenants.open)  # with tenants: nothing in Dask's event log
        self.tiers = TierTracker(self.catalog, self.event_log)
        self.reports = WorkerReports(s, self._accept_report)
        self.engines = EngineGauges()
        self.timeline = KVTimeline()
        self.span_history = SpanHistory(s)
        self.gate = WorkflowGate(s, settings, self.tenants)
        self.leases = LeaseBook(s, self.catalog, settings)
        self.usage = KVUsage(s, self.catalog, self.tiers, self.leases, self.ownership)
        self.declared = DeclaredKV(s)
        self.budget = BudgetEnforcer(s, settings, self.catalog, self.usage, self.event_log,
                                     self.tenants.quotas(lambda: settings.kv_budget_bytes), self.tiers)
        self.budget.on_preempt = self.gate.send_back  # a run preempted for a deadlock waits at the gate again
        self.queue = QueueTracker(s)
        self.profiles = ProfileBook(s, settings.prefill_samples)
        self.locality = Locality(s, self.catalog, self.budget, self.queue, self.event_log)
        self.lifecycle = BlockLifecycle(s, self.catalog, self.budget, self.event_log)
        self.rpc_counts = RpcCounts()
        self.views = KVViews(s, settings, self.catalog, self.tiers, self.usage, self.event_log, self.tenants,
                             self.rpc_counts)
        self.client_api = ClientHandlers(s, settings, self.tenants, self.catalog, self.ownership, self.leases,
                                         self.locality, self.budget, self.usage, self.queue, self.profiles,
                                         self.lifecycle, self.event_log, self.views, self.timeline)

    async def start(self, scheduler) -> None:
        self._build(scheduler)
        di.ensure_client(scheduler, CACHE_CLIENT)
        di.add_handlers(scheduler, self.rpc_counts.counted(self.client_api.handlers()))
        di.add_handlers(scheduler, self.rpc_counts.counted(self.gate.handlers()))
        di.add_handlers(scheduler, {REPORT_HELLO_RPC: self.reports.hello})  # a worker asks for its token
        # On the sender's own stream (before any worker plugin or client could send them):
        di.add_stream_handlers(scheduler, {REPORT_OP: self.reports.report, BIND_OP: self.handle_bind})
        di.guard_data_handlers(scheduler, self.ownership.refused_data)  # KV keys only from their tasks
        if not self.tenants.open:
            di.guard_task_finished(scheduler, self.declared.refused)  # no more KV than admitted
            di.divert_worker_events(scheduler, PREFILL_TOPIC, self.prefill_event)  # never in Dask's event log
        di.replace_amm_policy(scheduler, ReduceReplicas, KVAwareReduceReplicas())
        # What a KV cluster needs besides this plugin, installed from here whatever started the
        # cluster: the workers' serializers, reports and hand-off channel, and the KV page.
        for plugin in (TorchSerializationPlugin(), KVWorkerPlugin(), HandoffPlugin()):
            await di.install_worker_plugin(scheduler, plugin)
        await scheduler.register_scheduler_plugin(KVDashboardPlugin(), name=KVDashboardPlugin.name, idempotent=True)
        self._pc = PeriodicCallback(self._tick, self.settings.evict_interval * 1000)
        self._pc.start()

    async def close(self) -> None:
        if self._pc is not None:
            self._pc.stop()

    def _tick(self) -> None:
        now = time.time()
        self.leases.expire(now)
        self.lifecycle.tidy(now)
        try:
            self.locality.reschedule_orphans(f"kv-tick-{now}")
            self.locality.release_paused(now, f"kv-tick-{now}")
            self.budget.enforce()
            self.gate.drop_stale()  # runs that stopped asking, or renewing, lose their place
        except Exception:  # never let a bug here take the scheduler's loop down
            logger.exception("daskflow-kv periodic check failed")
        try:
            self.span_history.prune(now)
        except Exception:  # Dask's bookkeeping is best effort: never at the budget's expense
            logger.exception("daskflow-kv span history pruning failed")
        if self.timeline.due(now):
            try:
                self._sample_timeline(now)
            except Exception:  # the live plots must not stop the budget's checks, nor these them
                logger.exception("daskflow-kv timeline sample failed")

    def _sample_timeline(self, now: float) -> None:
        kv_bytes = self.usage.bytes_by_worker()
        gauges = {w: self.engines.of(w) for w in kv_bytes}
        reused = self.catalog.counter_by_namespace("tokens_reused")
        computed = self.catalog.counter_by_namespace("tokens_computed")
        self.timeline.sample(now, kv_bytes, {w: g.steps for w, g in gauges.items()},
                             {w: g.batch_total for w, g in gauges.items()},
                             {ns: (int(reused.get(ns, 0)), int(computed.get(ns, 0)))
                              for ns in reused.keys() | computed.keys()})

    # -- Dask's hooks, routed to the parts ------------------------------------------------------
    def update_graph(self, scheduler, *, client, keys, tasks, annotations, priority, stimulus_id, **kwargs) -> None:
        """Check a graph before Dask schedules any of it, failing closed: whatever goes wrong
        here refuses the graph's new KV tasks, with one log line (Dask would log a hook's
        exception and schedule the graph anyway)."""
        notes = annotations.get("kv", {})
        unchecked = self.ownership.unchecked(tasks)
        try:
            unsendable = kv_wire.unsendable(tasks, annotations, priority)
            if unsendable:  # the worker-stream DoS: refused whoever sends it
                why = next(iter(unsendable.values()))
                self.ownership.refuse(list(unsendable), AccessDenied(
                    f"refused: this graph holds a key, priority or annotation Dask cannot send to a worker ({why}); "
                    "integers must fit in 64 bits"), stimulus_id)
                logger.warning("daskflow-kv: refused %d task(s) whose worker message cannot be sent (%s)",
                               len(unsendable), why)
            self._add_graph(scheduler, tasks, notes, stimulus_id)
        except Exception as e:  # noqa: BLE001 -- fail closed
            logger.warning("daskflow-kv: a graph could not be checked (%s); its %d new KV task(s) are refused",
                           type(e).__name__, len(unchecked))
            logger.debug("daskflow-kv: the graph check failed", exc_info=True)
            self.ownership.refuse(unchecked, AccessDenied(
                f"refused: daskflow-kv could not check this graph ({type(e).__name__})"), stimulus_id)
        finally:
            # Read here, needed nowhere else: workers never get them (nor Dask's task pages).
            di.strip_annotation(scheduler, [scheduler.tasks[k] for k in notes if k in scheduler.tasks], "kv")

    def _add_graph(self, scheduler, tasks, notes: dict, stimulus_id: str) -> None:
        # Whose each new KV task is comes from the client stream the graph came on (never from
        # the graph); what may not run is refused here, before Dask schedules anything.
        admitted = self.ownership.admit_graph(tasks, notes, stimulus_id)
        published = []
        for key, a in admitted.items():
            namespace = None if a.session is None else a.session.namespace
            if isinstance(a.note, BlockNote) and a.session is not None:
                self.catalog.add_block(a.note.meta(), namespace)
                published.append(key)
                self._admit_copy(scheduler.tasks[key], a.note, namespace)
            elif isinstance(a.note, ComputeNote):
                self.declared.declare(key, a.note.kv_out)
                self.locality.place(scheduler.tasks[key], a.note, namespace)
        if published:  # the cache keeps them past the workflow that made them
            di.want(scheduler, published, CACHE_CLIENT)
        self.client_api.arrivals.note()  # states waiting for these blocks may register now
        # Planned for a worker that died since the client looked: let Dask place them.
        self.locality.loosen_dead_restrictions(scheduler.tasks[k] for k in tasks
                                               if is_placed(k) and k in scheduler.tasks)

    def _admit_copy(self, ts, note: BlockNote, namespace: str | None) -> None:
        """A block that is not cut from a KV output (a cached block shortened: a copy) adds its
        own K/V: with tenants, admission sees it on its declared bytes, held to them when it
        finishes (``kv_declared``), on the worker its task is restricted to."""
        if cut_from_output(ts):
            return
        self.declared.declare(ts.key, note.nbytes)
        if self.tenants.open:
            return
        target = next(iter(ts.worker_restrictions or ()), None)
        self.budget.hold(ts, target, note.nbytes, namespace)

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        self.budget.transition(key, start, finish)
        self.queue.transition(key, start, finish)
        self.lifecycle.transition(key, start, finish)
        if start == "memory":
            self.declared.left_memory(key)
        if finish == "forgotten":
            self.ownership.forget(key)
            self.declared.forget(key)

    def log_event(self, topic, msg) -> None:
        """An open scheduler: prefill timings workers log to Dask's event log (with tenants they
        never reach it: ``prefill_event``)."""
        if topic == PREFILL_TOPIC and self.tenants.open and isinstance(msg, dict):
            self.prefill_event(msg.get("worker"), msg)

    def prefill_event(self, worker=None, msg=None) -> None:
        """A prefill's timing, counted only when it came on that worker's own stream (any client
        may log to the topic). With tenants, workers' timings come here instead of Dask's event
        log, which any client reads (``dask_internals.divert_worker_events``)."""
        try:
            self._prefill_event(worker, msg)
        except Exception:  # noqa: BLE001 -- a raise would end the worker's stream
            logger.exception("daskflow-kv: a prefill timing could not be read")

    def _prefill_event(self, worker, msg) -> None:
        if not isinstance(msg, dict) or not self.reports.is_worker_stream(worker):
            return
        msg = {**msg, "worker": worker}
        sample = _prefill_sample(msg)
        if sample is None:
            return
        if not msg.get("shared_steps"):  # batched with other requests: the time was not this prefill's alone
            self.profiles.add_sample(msg["worker"], sample)
        if msg.get("op") != "calibrate":
            namespace = self.tenants.namespace_of_tag(msg.get("tag"))  # the tag of the task that prefilled
            self.catalog.count("tokens_computed", sample.new_tokens, namespace)
            # A batch reads one prefix for k branches: it reports the k-fold reuse separately.
            reused = msg.get("tokens_reused", sample.prefix_tokens)
            self.catalog.count("tokens_reused", reused if _count(reused) else 0, namespace)

    def remove_worker(self, scheduler, worker, *, stimulus_id=None, **kwargs) -> None:
        # Runs after Dask's own transitions for the loss.
        self.reports.forget_worker(worker)
        self.engines.forget_worker(worker)
        self.profiles.forget_worker(worker)
        self.tiers.forget_worker(worker)
        self.budget.forget_worker(worker)
        stimulus = f"kv-worker-lost-{time.time()}"
        rescheduled = self.locality.replace_lost(stimulus)
        dropped = self.lifecycle.drop_lost_cache_only(stimulus)
        self.event_log.record("worker-lost", None, worker=worker, rescheduled=rescheduled, dropped=dropped)

    def add_worker(self, scheduler, worker) -> None:
        self.locality.reschedule_orphans(f"kv-worker-added-{time.time()}")
        self.gate.admit()  # more places: the next in line go in now

    def remove_client(self, scheduler, client: str) -> None:
        """A client left (closed, or its process died): its sessions end and the states it
        registered are released - Dask already dropped its wants, so their blocks are the
        cache's now, evictable; nothing of it stays live in the catalog."""
        self.tenants.end_client(client)
        self.gate.remove_client(client)
        for st in self.catalog.release_client(client):
            self.event_log.record("release", st.namespace, state_id=st.state_id, reason="client left")
        self.budget.note_change()
        self.budget.note_progress()

    def handle_bind(self, nonce=None, **ignored) -> None:
        """``BIND_OP`` on a client's stream: the login challenge it answers (``tenants``), for the
        client that stream serves (``client=`` is whatever the message says: ignored). Never raises."""
        try:
            self.tenants.bind(nonce, di.stream_client(self.scheduler), di.current_connection())
        except Exception:  # noqa: BLE001 -- a raise would end the sender's stream
            logger.exception("daskflow-kv: bind failed")

    def _accept_report(self, worker: str, spilled: list[str] | None, events: list[dict], engine=None,
                       can_spill: bool | None = None) -> None:
        """A worker's own report (``kv_reports``): its spilled blocks and store I/O (see kv_tiers),
        its continuous-batching loop (``kv_engines``)."""
        if worker not in self.scheduler.workers:
            return
        if engine is not None:
            self.engines.update(worker, engine)
        if self.tiers.report(worker, spilled, events, can_spill):
            self.budget.note_change()  # spilled blocks no longer count against the budget

    # -- what the planner, the dashboard and the exports read -------------------------------------
    def busy_seconds(self, worker: str) -> float:
        return self.queue.busy_seconds(worker)

    def prefill_profiles(self) -> dict[str, dict]:
        return self.profiles.prefill_profiles()

    def bandwidth(self, namespace: str | None = None) -> dict[str, float]:
        return self.profiles.bandwidth(namespace)

    def kv_bytes_by_worker(self) -> dict[str, int]:
        return self.usage.bytes_by_worker()

    def catalog_rows(self, namespace: str | None = None) -> list[dict]:
        return self.views.catalog_rows(namespace)

    def counters_view(self, namespace: str | None = None) -> dict:
        return self.views.counters_view(namespace)

    def operator_catalog(self) -> list[dict]:
        return self.views.operator_catalog()

    def operator_counters(self) -> dict:
        return self.views.operator_counters()

    def operator_events(self) -> list[dict]:
        return self.views.operator_events()

    def catalog_table(self):
        return self.views.catalog_table()


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40


def _prefill_sample(msg: dict) -> PrefillSample | None:
    """The sample a prefill event reports, if its numbers are sane (tokens counts, finite seconds)."""
    n, p, t = msg.get("new_tokens"), msg.get("prefix_tokens", 0), msg.get("seconds")
    if not (_count(n) and n > 0 and _count(p) and isinstance(t, (int, float)) and not isinstance(t, bool)
            and 0 < t < 1e6):
        return None
    return PrefillSample(n, p, float(t))


@click.command()
@click.option("--kv-budget", default=None, help="per-worker KV bytes, e.g. 2GiB (default: daskflow-kv.kv-budget)")
@click.option("--kv-memory-weight", default=None, type=float, help="seconds charged per KV byte placed")
async def dask_setup(scheduler, kv_budget: str | None = None, kv_memory_weight: float | None = None) -> None:
    """Entry point for ``dask scheduler --preload daskflow_kv.plugins.kv_scheduler``."""
    await scheduler.register_scheduler_plugin(
        KVSchedulerPlugin(kv_budget_bytes=kv_budget, memory_weight=kv_memory_weight), name=PLUGIN_NAME,
        idempotent=True,
    )
