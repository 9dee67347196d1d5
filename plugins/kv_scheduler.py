"""The KV-aware scheduler plugin: catalog, locality, cache retention, eviction, profiles.

Dask already places tasks, moves dependencies, counts references and recomputes lost keys.
This plugin adds what Dask does not know about KV cache:

* a catalog of blocks and states (token ranges, chains, reuse, lifecycle), exported as rows
  or an Arrow table, and a prefix index so any client finds the longest cached prefix;
* acquisition: a lookup hands the caller's client a reference to every matched block in
  the same event-loop tick (``client_desires_keys``, as ``Variable.get`` does), so a block
  found in the cache cannot be evicted before the client holds its future, and a released
  block that is needed again is recomputed by Dask from its lineage;
* locality: a KV-consuming task runs where its blocks live unless the plan says transfer.
  Its worker restriction is strict while that worker lives (a loose one would let work
  stealing move it and drag the blocks along); when the worker dies, the plugin loosens
  the restrictions that pointed at it, so the tasks run elsewhere and Dask recomputes the
  lost blocks from lineage;
* retention: published blocks are also wanted by a scheduler-side pseudo-client, so a prefix
  outlives the workflow that made it and the next one reuses it;
* eviction: per-worker KV byte budget, enforced by dropping the least valuable blocks no
  live state, running task or fresh lookup references (the pseudo-client lets go of them);
* tiers: which blocks a worker has spilled to disk and which are in the persistent store,
  from the workers' own reports (``kv_tiers``): the budget counts only blocks in memory;
* profiles: prefill timings reported by workers, fitted per worker for the cost model, and
  bandwidth per worker pair from Dask's own transfer measurements or a calibration probe;
* an Active Memory Manager policy that drops extra replicas of everything but KV blocks:
  their replicas are placed on purpose (the budget, not the AMM, decides when they go).

Lifecycle events (materialize, fork, resume, extend, merge, transfer, recompute, evict, lost,
release) go to the Dask event log under ``EVENT_TOPIC`` (``client.get_events("daskflow-kv")``).

Load it with ``client.register_plugin(KVSchedulerPlugin())`` or
``dask scheduler --preload daskflow_kv.plugins.kv_scheduler [--kv-budget 2GiB]``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque

import click
from distributed.active_memory_manager import ReduceReplicas, Suggestion
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from daskflow_kv import config
from daskflow_kv import dask_internals as di
from daskflow_kv.keys import CACHE_CLIENT, EVENT_TOPIC, PLUGIN_NAME, PREFILL_TOPIC, REPORT_RPC, is_block, is_placed, short_key
from daskflow_kv.policy.cost_model import PrefillSample, fit_prefill_profile
from daskflow_kv.state.catalog import KVCatalog, rows_to_arrow

from .dashboard import KVDashboardPlugin
from .handoff import HandoffPlugin
from .kv_budget import KVBudget
from .kv_client_api import KVClientAPI
from .kv_tiers import KVTiers
from .tenants import TenantRegistry
from .worker import KVWorkerPlugin, TorchSerializationPlugin

logger = logging.getLogger("daskflow_kv.scheduler")

def public_event(event: dict) -> dict:
    """An event as Dask's event log (readable by any client) gets it: keys cut short."""
    out = dict(event)
    if "key" in out:
        out["key"] = short_key(str(out["key"]))
    if "keys" in out:
        out["keys"] = [short_key(str(k)) for k in out["keys"]]
    return out


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


class KVSchedulerPlugin(KVClientAPI, KVBudget, KVTiers, SchedulerPlugin):
    name = PLUGIN_NAME
    idempotent = True  # registering again (another client, a preload) keeps the running one
    NOT_USABLE = ("erred", "forgotten")  # task states a lookup never hands out
    CACHE_CLIENT = CACHE_CLIENT

    def __init__(
        self,
        kv_budget_bytes: int | str | None = None,
        memory_weight: float | None = None,
        evict_interval: float | str | None = None,
        lease_seconds: float | str | None = None,
    ):
        # None takes the value from dask.config["daskflow-kv"] (see daskflow-kv.yaml).
        self.kv_budget_bytes = config.get_bytes("kv-budget", kv_budget_bytes)  # per worker; None = unbounded
        self.memory_weight = config.get("memory-weight", memory_weight)  # lambda: s charged per byte placed
        self.evict_interval = config.get_seconds("scheduler.evict-interval", evict_interval)  # between checks
        self.lease_seconds = config.get_seconds("scheduler.lease", lease_seconds)  # looked-up block kept this long
        self.admission_patience = config.get_seconds("scheduler.admission-patience")  # parked task waits this long
        max_samples = config.get("scheduler.prefill-samples")  # per worker, for the profile fit
        self.catalog = KVCatalog()
        self.samples: dict[str, deque] = defaultdict(lambda: deque(maxlen=max_samples))
        self.probed_bandwidth: dict[tuple[str, str, str], float] = {}  # (namespace, src, dst) -> bytes/s
        self.probed_latency: dict[tuple[str, str, str], float] = {}  # (namespace, src, dst) -> s per fetch
        self._predicted: dict = {}  # KV compute task key -> (target worker, predicted seconds), from the plan
        self._running: dict = {}  # key -> (worker, when it was sent there): the queue the planner waits on
        self.tenants = TenantRegistry()  # replaced at start by the scheduler's own configuration
        self.decisions: deque = deque(maxlen=256)  # recent cost-model decisions, newest last
        self.events: deque = deque(maxlen=1024)  # recent lifecycle events
        self.scheduler = None
        self._dirty = False  # something changed since the last budget check (or still over)
        self._leases: dict[str, float] = {}  # key -> time until which eviction leaves it alone
        self._evicting: set[str] = set()  # keys released by the budget, until Dask confirms
        self._lost_cache_only: set[str] = set()  # lost with a dead worker, wanted only by the cache
        self._over_budget: set[str] = set()  # workers over budget with only pinned blocks left
        self._held: dict = {}  # key -> kv_budget.Held: KV tasks parked until admitted under the budget
        self._reserved: dict[str, int] = {}  # worker -> KV bytes promised to admitted, running tasks
        self._admit_pending = False  # something freed room: try the parked tasks again
        self._pruned = 0.0  # last time released states were pruned from the catalog
        self.spilled: dict[str, frozenset] = {}  # worker -> KV block keys on its spill disk (its reports)
        self._pc: PeriodicCallback | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        # Read here, in the scheduler's process: never from a plugin object a client pickled.
        self.tenants = TenantRegistry(config.get("tenants"))
        di.ensure_client(scheduler, CACHE_CLIENT)
        di.add_handlers(scheduler, self.client_handlers())
        di.add_handlers(scheduler, {REPORT_RPC: self.handle_worker_report})  # from workers, no session
        di.replace_amm_policy(scheduler, ReduceReplicas, KVAwareReduceReplicas())
        # What a KV cluster needs besides this plugin, installed from here whatever started the
        # cluster: the workers' serializers, reports and hand-off channel, and the KV page.
        for plugin in (TorchSerializationPlugin(), KVWorkerPlugin(), HandoffPlugin()):
            await di.install_worker_plugin(scheduler, plugin)
        await scheduler.register_scheduler_plugin(KVDashboardPlugin(), name=KVDashboardPlugin.name, idempotent=True)
        self._pc = PeriodicCallback(self._tick, self.evict_interval * 1000)
        self._pc.start()

    async def close(self) -> None:
        if self._pc is not None:
            self._pc.stop()

    def _event(self, op: str, namespace: str | None, **detail) -> None:
        """A lifecycle event: kept whole for its namespace (None: the cluster's own), and
        published to Dask's event log - which any client reads - with KV keys cut short."""
        event = {"op": op, "time": time.time(), "namespace": namespace, **detail}
        self.events.append(event)
        self.scheduler.log_event(EVENT_TOPIC, public_event(event))

    def remove_client(self, scheduler, client: str) -> None:
        self.tenants.end_client(client)

    # -- graph ----------------------------------------------------------------------------
    def update_graph(self, scheduler, *, client, keys, tasks, annotations, priority, stimulus_id, **kwargs) -> None:
        published = []
        for key, note in annotations.get("kv", {}).items():
            ts = scheduler.tasks.get(key)
            if ts is None or not isinstance(note, dict):
                continue
            # The session token in the annotation says whose task it is (it cannot be forged;
            # a client id or a namespace string could). No session: runs, but is not cataloged.
            session = self.tenants.find(note.get("session"))
            if note.get("role") == "block" and session is not None:
                self.catalog.add_block(note["meta"], session.namespace)
                published.append(key)
            elif note.get("role") == "compute":
                self._place(ts, note, None if session is None else session.namespace)
        if published:
            di.want(scheduler, published, CACHE_CLIENT)
        # Planned for a worker that died since the client looked: let Dask place them.
        self._loosen_dead_restrictions(scheduler.tasks[k] for k in tasks if is_placed(k))

    def _loosen_dead_restrictions(self, task_states) -> list:
        """Loosen strict restrictions naming only workers that are gone; -> keys stuck in no-worker."""
        alive = self.scheduler.workers
        stuck = []
        for ts in task_states:
            parked = ts.key in self._held and self._held[ts.key].worker is None  # admission decides those
            if not parked and di.is_strict(ts) and not any(w in alive for w in ts.worker_restrictions):
                di.loosen(ts)
                if ts.state == "no-worker":
                    stuck.append(ts.key)
        return stuck

    def _place(self, ts, note: dict, namespace: str | None) -> None:
        """Restrict a KV-consuming task to the plan's worker, or to where its blocks live."""
        reads = note.get("reads", ())
        target = note.get("target")
        if target is None:
            held: dict[str, int] = defaultdict(int)
            for k in reads:
                dts = self.scheduler.tasks.get(k)
                for ws in (dts.who_has or ()) if dts is not None else ():
                    held[ws.address] += dts.get_nbytes()
            target = max(sorted(held), key=held.get) if held else None
        if self._hold(ts, target, note.get("kv_out", 0), namespace, note.get("gang"), note.get("gang_size", 1)):
            pass  # the budget decides when (and whether) it goes to ``target``: see kv_budget
        elif target is not None and target in self.scheduler.workers:
            # Strict while the worker lives (no work stealing); loosened if it dies.
            di.pin(self.scheduler, ts, target)
        for k in reads:
            self.catalog.touch(k)
        if note.get("predicted_s") is not None:
            self._predicted[ts.key] = (target, float(note["predicted_s"]))
        op = note.get("op", "compute")
        self._event(op + "-task", namespace, key=str(ts.key), worker=target, state_id=note.get("state_id"),
                    reads=len(reads))
        decision = note.get("decision")
        if not decision or not note.get("first"):  # a destination pays once, whatever its branch count
            return
        self.decisions.append({**decision, "namespace": namespace})
        if decision.get("action") == "transfer":
            self.catalog.count("transfers")
            self.catalog.count("bytes_transferred", decision.get("nbytes", 0))
            self._event("transfer", namespace, src=decision.get("src"), dst=decision.get("dst"),
                        nbytes=decision.get("nbytes"), keys=list(reads), state_id=note.get("state_id"))
        elif decision.get("action") == "recompute":
            self.catalog.count("recomputes")
            self._event("recompute", namespace, reason="cost-model", dst=decision.get("dst"),
                        tokens=decision.get("missing_tokens"), state_id=note.get("state_id"))

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        if key in self._held:
            self._admission_transition(key, start, finish)
        if key in self._predicted:
            self._track_queue(key, start, finish)
        entry = self.catalog.blocks.get(key)
        if entry is None:
            return
        if finish == "memory":
            if self.catalog.entered_memory(key):
                ts = self.scheduler.tasks.get(key)
                where = [ws.address for ws in (ts.who_has or ())] if ts is not None else []
                self._event("recompute", entry.namespace, reason="lineage", key=key, workers=where)
            self._dirty = True
        elif start == "memory":
            ts = self.scheduler.tasks.get(key)
            wanted = ts is not None and bool(ts.who_wants or ts.waiters)
            if key in self._evicting:
                self._evicting.discard(key)
                self.catalog.set_status(key, "evicted")
            elif wanted:  # its worker died; Dask recomputes it from its run spec
                self.catalog.set_status(key, "lost")
                self._event("lost", entry.namespace, key=key)
                if {cs.client_key for cs in ts.who_wants or ()} <= {CACHE_CLIENT} and not ts.waiters:
                    self._lost_cache_only.add(key)  # nobody but the cache needs it: see remove_worker
            else:
                self.catalog.set_status(key, "released")
            if finish == "forgotten":
                self.catalog.forget(key)
        elif finish == "forgotten":
            self.catalog.forget(key)
        elif finish == "waiting" and entry.computed:
            self.catalog.set_status(key, "recomputing")
        elif finish == "erred":
            self.catalog.set_status(key, "erred")
            self.catalog.index.remove(key)

    # -- the queue the planner sees ------------------------------------------------------------
    def _track_queue(self, key, start: str, finish: str) -> None:
        ts = self.scheduler.tasks.get(key)
        if finish == "processing" and ts is not None and ts.processing_on is not None:
            self._running[key] = (ts.processing_on.address, time.time())
        elif start == "processing":
            self._running.pop(key, None)
            if finish in ("memory", "erred", "released", "forgotten"):
                self._predicted.pop(key, None)
        elif finish in ("forgotten", "erred"):
            self._predicted.pop(key, None)

    def busy_seconds(self, worker: str) -> float:
        """Predicted seconds of KV work still queued on ``worker``.

        Its KV tasks (one thread runs them in turn) take the times their plans predicted;
        what has run since the first was sent there is subtracted. Tasks parked for
        admission, planned for ``worker``, count too: they will run there.
        """
        now = time.time()
        sent = [(t0, self._predicted[k][1]) for k, (w, t0) in self._running.items() if w == worker]
        parked = sum(p for k, (w, p) in self._predicted.items() if w == worker and k not in self._running
                     and k in self._held)
        if not sent:
            return parked
        return max(0.0, sum(p for _, p in sent) - (now - min(t0 for t0, _ in sent))) + parked

    def log_event(self, topic, msg) -> None:
        if topic != PREFILL_TOPIC or not isinstance(msg, dict) or not msg.get("new_tokens"):
            return
        self.samples[msg["worker"]].append(PrefillSample(msg["new_tokens"], msg.get("prefix_tokens", 0), msg["seconds"]))
        if msg.get("op") != "calibrate":
            self.catalog.count("tokens_computed", msg["new_tokens"])
            # A batch reads one prefix for k branches: it reports the k-fold reuse separately.
            self.catalog.count("tokens_reused", msg.get("tokens_reused", msg.get("prefix_tokens", 0)))

    def remove_worker(self, scheduler, worker, *, stimulus_id=None, **kwargs) -> None:
        # Runs after Dask's own transitions for the loss. Tasks planned on the dead worker
        # may now run anywhere; those already stuck in no-worker are scheduled again.
        self.samples.pop(worker, None)
        self.spilled.pop(worker, None)
        self._over_budget.discard(worker)
        self._reserved.pop(worker, None)
        self._admit_pending = True  # parked tasks planned there go elsewhere
        stimulus = f"kv-worker-lost-{time.time()}"
        stuck = self._loosen_dead_restrictions(ts for k, ts in list(scheduler.tasks.items())
                                               if is_placed(k))
        if stuck:
            di.reschedule(scheduler, stuck, stimulus)
        # Blocks only the cache wanted are not worth recomputing now; they stay in lineage
        # and come back if a lookup asks for them.
        drop = [k for k in self._lost_cache_only if self._cache_only(k) and scheduler.tasks[k].state != "memory"]
        self._lost_cache_only.clear()
        for k in drop:
            self.catalog.set_status(k, "released")
        if drop:
            di.unwant(scheduler, drop, CACHE_CLIENT, stimulus)
        self._event("worker-lost", None, worker=worker, rescheduled=len(stuck), dropped=len(drop))

    def add_worker(self, scheduler, worker) -> None:
        self._reschedule_orphans(f"kv-worker-added-{time.time()}")

    def _reschedule_orphans(self, stimulus_id: str) -> None:
        """Schedule KV tasks stuck in no-worker whose loosened restrictions name no live worker.

        Dask retries a no-worker task on a new worker only if its restrictions name that
        worker, loose or not, so a task loosened while no worker was left (every job of a
        Slurm cluster gone at once) would wait forever. Runs on add_worker and every tick:
        a worker may not be running yet when it is added.
        """
        s = self.scheduler
        stuck_all = di.unrunnable(s)
        if not stuck_all or not di.has_running_worker(s):
            return
        stuck = [ts for ts in stuck_all
                 if is_placed(ts.key) and ts.loose_restrictions and ts.worker_restrictions
                 and not any(w in s.workers for w in ts.worker_restrictions)]
        if stuck:
            di.reschedule(s, [ts.key for ts in stuck], stimulus_id)
            moved = sum(ts.state != "no-worker" for ts in stuck)
            if moved:
                self._event("rescheduled", None, keys=moved)

    def _cache_only(self, key) -> bool:
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.waiters:
            return False
        wanters = {cs.client_key for cs in ts.who_wants or ()}
        return CACHE_CLIENT in wanters and wanters <= {CACHE_CLIENT}

    # -- acquisition ----------------------------------------------------------------------
    def _acquire(self, keys: list[str], client: str | None) -> dict[str, str]:
        """Make ``client`` (and the cache) want ``keys``; recompute released ones. -> key: state."""
        tasks = self.scheduler.tasks
        known = [k for k in dict.fromkeys(keys) if k in tasks and tasks[k].state not in self.NOT_USABLE]
        if not known:
            return {}
        now = time.time()
        for k in known:
            self._leases[k] = now + self.lease_seconds
        if client in self.scheduler.clients:  # not a client that has gone meanwhile
            di.want(self.scheduler, known, client)
        di.want(self.scheduler, [k for k in known if k in self.catalog.blocks], CACHE_CLIENT)
        released = [k for k in known if tasks[k].state == "released"]
        if released:  # needed again after it left memory: Dask recomputes it from lineage
            di.recompute(self.scheduler, released, f"kv-acquire-{now}")
        return {k: tasks[k].state for k in known}

    def _where(self, ts) -> list[str]:
        """Workers that hold the key, or the one expected to compute it (following take_block)."""
        for _ in range(3):
            if ts.who_has:
                return sorted(ws.address for ws in ts.who_has)
            if ts.processing_on is not None:
                return [ts.processing_on.address]
            held = self._held.get(ts.key)
            if held is not None:  # parked for admission: where the plan sends it
                return [held.worker or held.target] if (held.worker or held.target) in self.scheduler.workers else []
            if ts.worker_restrictions:
                return sorted(w for w in ts.worker_restrictions if w in self.scheduler.workers)
            if len(ts.dependencies) != 1:  # a block's only input is the prefill that made it
                break
            ts = next(iter(ts.dependencies))
        return []

    # -- budget loop ----------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.time()
        self._leases = {k: t for k, t in self._leases.items() if t > now}
        if now - self._pruned > 5.0:
            self._pruned = now
            self.catalog.prune()
        try:
            self._reschedule_orphans(f"kv-tick-{now}")
            self._enforce_budgets()
        except Exception:  # never let a bug here take the scheduler's loop down
            logger.exception("daskflow-kv periodic check failed")

    # -- profiles -------------------------------------------------------------------------
    def prefill_profiles(self) -> dict[str, dict]:
        out = {}
        for worker, samples in self.samples.items():
            if samples and worker in self.scheduler.workers:
                p = fit_prefill_profile(list(samples))
                out[worker] = {"a": p.a, "b": p.b, "c": p.c, "samples": len(samples)}
        return out

    def bandwidth(self, namespace: str | None = None) -> dict[str, float]:
        """Measured bytes/s per "src->dst" pair, as ``namespace``'s plans see them.

        A calibration probe (a real transfer timed from the receiver's transfer log) wins:
        it is recent. Dask's own per-pair figure fills the other pairs; it averages every
        transfer over 1 MB since the worker started, so it lags when the link changes.
        Probes count only for the namespace that ran them: no tenant steers another's plans.
        """
        out = {f"{src}->{dst}": bw for (src, dst), bw in di.link_bandwidths(self.scheduler).items()}
        out.update({f"{s}->{d}": bw for (ns, s, d), bw in self.probed_bandwidth.items() if ns == namespace})
        return out

    # -- views (the client API scopes them; the dashboard shows the operator's) -------------
    def catalog_rows(self, namespace: str | None = None) -> list[dict]:
        """Catalog rows of ``namespace`` (None: every namespace)."""
        self.catalog.prune()
        tasks = self.scheduler.tasks
        who_has, refcount, cached, tiers = {}, {}, set(), {}
        for k in self.catalog.blocks:
            ts = tasks.get(k)
            tiers[k] = self.tier(k, ts)
            if ts is None:
                continue
            who_has[k] = sorted(ws.address for ws in (ts.who_has or ()))
            refcount[k] = len(self.catalog.live_holders.get(k, ())) + len(ts.waiters or ())
            if any(cs.client_key == CACHE_CLIENT for cs in ts.who_wants or ()):
                cached.add(k)
        return self.catalog.rows(who_has, refcount, cached, namespace, tiers)

    def counters_view(self, namespace: str | None = None) -> dict:
        """Counters (cluster-wide), per-worker KV bytes, and ``namespace``'s decisions and events."""
        c = dict(self.catalog.counters)
        total = c["tokens_reused"] + c["tokens_computed"]
        c["reuse_ratio"] = c["tokens_reused"] / total if total else 0.0
        visible = lambda e: namespace is None or e.get("namespace") in (None, namespace)  # noqa: E731
        return {
            "counters": c,
            "decisions": [d for d in self.decisions if visible(d)][-32:],
            "kv_bytes": self.kv_bytes_by_worker(),
            "kv_budget_bytes": self.kv_budget_bytes,
            "events": [e for e in self.events if visible(e)][-64:],
        }

    def operator_catalog(self) -> list[dict]:
        """What the dashboard shows: every namespace's rows; with tenants configured, block
        keys cut short (a full key is a capability to read the block's K/V)."""
        rows = self.catalog_rows()
        if not self.tenants.open:
            for r in rows:
                r["block_key"], r["parent_key"] = short_key(r["block_key"]), short_key(r["parent_key"])
        return rows

    def operator_counters(self) -> dict:
        view = self.counters_view()
        if not self.tenants.open:
            view["events"] = [public_event(e) for e in view["events"]]
        return view

    def catalog_table(self):
        """The operator's catalog as Arrow (what the dashboard's /kv/catalog.* routes serve)."""
        return rows_to_arrow(self.operator_catalog())


@click.command()
@click.option("--kv-budget", default=None, help="per-worker KV bytes, e.g. 2GiB (default: daskflow-kv.kv-budget)")
@click.option("--kv-memory-weight", default=None, type=float, help="seconds charged per KV byte placed")
async def dask_setup(scheduler, kv_budget: str | None = None, kv_memory_weight: float | None = None) -> None:
    """Entry point for ``dask scheduler --preload daskflow_kv.plugins.kv_scheduler``."""
    await scheduler.register_scheduler_plugin(
        KVSchedulerPlugin(kv_budget_bytes=kv_budget, memory_weight=kv_memory_weight), name=PLUGIN_NAME,
        idempotent=True,
    )
