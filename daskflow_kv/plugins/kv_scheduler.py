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

import asyncio
import logging
import time
from collections import defaultdict, deque

import click
from distributed.active_memory_manager import ReduceReplicas, Suggestion
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import ClientState
from tornado.ioloop import PeriodicCallback

from daskflow_kv import config
from daskflow_kv.policy.cost_model import PrefillSample, fit_prefill_profile
from daskflow_kv.policy.eviction import BlockUsage, choose_victims
from daskflow_kv.state.catalog import KVCatalog, rows_to_arrow

logger = logging.getLogger("daskflow_kv.scheduler")

CACHE_CLIENT = "daskflow-kv-cache"  # pseudo-client that keeps published blocks alive
EVENT_TOPIC = "daskflow-kv"  # lifecycle events, visible through client.get_events
PREFILL_TOPIC = "daskflow-kv-prefill"  # timings reported by workers (see runtime.tasks)
PLUGIN_NAME = "daskflow-kv"
BLOCK_PREFIX = "kvblock-"  # every content-addressed block key starts with it
KV_TASK_PREFIXES = ("kvprefill-", BLOCK_PREFIX, "kvresult-", "kvreplica-")  # tasks placed by the plan
_NOT_USABLE = ("erred", "forgotten")  # task states a lookup never hands out


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
            if not str(suggestion.ts.key).startswith(BLOCK_PREFIX):
                sent = yield suggestion


class KVSchedulerPlugin(SchedulerPlugin):
    name = PLUGIN_NAME
    idempotent = True  # registering again (another client, a preload) keeps the running one

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
        max_samples = config.get("scheduler.prefill-samples")  # per worker, for the profile fit
        self.catalog = KVCatalog()
        self.samples: dict[str, deque] = defaultdict(lambda: deque(maxlen=max_samples))
        self.probed_bandwidth: dict[tuple[str, str], float] = {}  # (src, dst) -> bytes/s
        self.decisions: deque = deque(maxlen=256)  # recent cost-model decisions, newest last
        self.events: deque = deque(maxlen=1024)  # recent lifecycle events
        self.scheduler = None
        self._dirty = False  # something changed since the last budget check (or still over)
        self._leases: dict[str, float] = {}  # key -> time until which eviction leaves it alone
        self._evicting: set[str] = set()  # keys released by the budget, until Dask confirms
        self._lost_cache_only: set[str] = set()  # lost with a dead worker, wanted only by the cache
        self._over_budget: set[str] = set()  # workers over budget with only pinned blocks left
        self._pruned = 0.0  # last time released states were pruned from the catalog
        self._pc: PeriodicCallback | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.clients.setdefault(CACHE_CLIENT, ClientState(CACHE_CLIENT))
        scheduler.handlers.update(
            {
                "kv_lookup": self.handle_lookup,
                "kv_acquire": self.handle_acquire,
                "kv_snapshot": self.handle_snapshot,
                "kv_register_states": self.handle_register_states,
                "kv_release_state": self.handle_release_state,
                "kv_catalog": self.handle_catalog,
                "kv_counters": self.handle_counters,
                "kv_record_bandwidth": self.handle_record_bandwidth,
                "kv_configure": self.handle_configure,
                "kv_evict_now": self.handle_evict_now,
            }
        )
        amm = scheduler.extensions.get("amm")
        if amm is not None:
            for policy in list(amm.policies):
                if type(policy) is ReduceReplicas:
                    amm.policies.discard(policy)
                    amm.add_policy(KVAwareReduceReplicas())
        self._pc = PeriodicCallback(self._tick, self.evict_interval * 1000)
        self._pc.start()

    async def close(self) -> None:
        if self._pc is not None:
            self._pc.stop()

    def _event(self, op: str, **detail) -> None:
        event = {"op": op, "time": time.time(), **detail}
        self.events.append(event)
        self.scheduler.log_event(EVENT_TOPIC, event)

    # -- graph ----------------------------------------------------------------------------
    def update_graph(self, scheduler, *, client, keys, tasks, annotations, priority, stimulus_id, **kwargs) -> None:
        published = []
        for key, note in annotations.get("kv", {}).items():
            ts = scheduler.tasks.get(key)
            if ts is None or not isinstance(note, dict):
                continue
            if note.get("role") == "block":
                self.catalog.add_block(note["meta"])
                published.append(key)
            elif note.get("role") == "compute":
                self._place(ts, note)
        if published:
            scheduler.client_desires_keys(published, CACHE_CLIENT)
        # Planned for a worker that died since the client looked: let Dask place them.
        self._loosen_dead_restrictions(scheduler.tasks[k] for k in tasks if str(k).startswith(KV_TASK_PREFIXES))

    def _loosen_dead_restrictions(self, task_states) -> list:
        """Loosen strict restrictions naming only workers that are gone; -> keys stuck in no-worker."""
        alive = self.scheduler.workers
        stuck = []
        for ts in task_states:
            r = ts.worker_restrictions
            if r and not ts.loose_restrictions and not any(w in alive for w in r):
                ts.loose_restrictions = True
                if ts.state == "no-worker":
                    stuck.append(ts.key)
        return stuck

    def _place(self, ts, note: dict) -> None:
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
        if target is not None and target in self.scheduler.workers:
            # Strict while the worker lives (no work stealing); loosened if it dies.
            ts.worker_restrictions = {target}
            ts.loose_restrictions = False
        for k in reads:
            self.catalog.touch(k)
        op = note.get("op", "compute")
        self._event(op + "-task", key=str(ts.key), worker=target, state_id=note.get("state_id"), reads=len(reads))
        decision = note.get("decision")
        if not decision or not note.get("first"):  # a destination pays once, whatever its branch count
            return
        self.decisions.append(decision)
        if decision.get("action") == "transfer":
            self.catalog.count("transfers")
            self.catalog.count("bytes_transferred", decision.get("nbytes", 0))
            self._event("transfer", src=decision.get("src"), dst=decision.get("dst"), nbytes=decision.get("nbytes"),
                        keys=list(reads), state_id=note.get("state_id"))
        elif decision.get("action") == "recompute":
            self.catalog.count("recomputes")
            self._event("recompute", reason="cost-model", dst=decision.get("dst"),
                        tokens=decision.get("missing_tokens"), state_id=note.get("state_id"))

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        entry = self.catalog.blocks.get(key)
        if entry is None:
            return
        if finish == "memory":
            if self.catalog.entered_memory(key):
                ts = self.scheduler.tasks.get(key)
                where = [ws.address for ws in (ts.who_has or ())] if ts is not None else []
                self._event("recompute", reason="lineage", key=key, workers=where)
            self._dirty = True
        elif start == "memory":
            ts = self.scheduler.tasks.get(key)
            wanted = ts is not None and bool(ts.who_wants or ts.waiters)
            if key in self._evicting:
                self._evicting.discard(key)
                self.catalog.set_status(key, "evicted")
            elif wanted:  # its worker died; Dask recomputes it from its run spec
                self.catalog.set_status(key, "lost")
                self._event("lost", key=key)
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
        self._over_budget.discard(worker)
        stimulus = f"kv-worker-lost-{time.time()}"
        stuck = self._loosen_dead_restrictions(ts for k, ts in list(scheduler.tasks.items())
                                               if str(k).startswith(KV_TASK_PREFIXES))
        if stuck:
            scheduler.transitions({k: "processing" for k in stuck}, stimulus_id=stimulus)
        # Blocks only the cache wanted are not worth recomputing now; they stay in lineage
        # and come back if a lookup asks for them.
        drop = [k for k in self._lost_cache_only if self._cache_only(k) and scheduler.tasks[k].state != "memory"]
        self._lost_cache_only.clear()
        for k in drop:
            self.catalog.set_status(k, "released")
        if drop:
            scheduler.client_releases_keys(drop, CACHE_CLIENT, stimulus_id=stimulus)
        self._event("worker-lost", worker=worker, rescheduled=len(stuck), dropped=len(drop))

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
        if not s.unrunnable or not s.running:
            return
        stuck = [ts for ts in list(s.unrunnable)
                 if str(ts.key).startswith(KV_TASK_PREFIXES) and ts.loose_restrictions and ts.worker_restrictions
                 and not any(w in s.workers for w in ts.worker_restrictions)]
        if stuck:
            s.transitions({ts.key: "processing" for ts in stuck}, stimulus_id=stimulus_id)
            moved = sum(ts.state != "no-worker" for ts in stuck)
            if moved:
                self._event("rescheduled", keys=moved)

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
        known = [k for k in dict.fromkeys(keys) if k in tasks and tasks[k].state not in _NOT_USABLE]
        if not known:
            return {}
        now = time.time()
        for k in known:
            self._leases[k] = now + self.lease_seconds
        if client in self.scheduler.clients:  # not a client that has gone meanwhile
            self.scheduler.client_desires_keys(known, client)
        self.scheduler.client_desires_keys([k for k in known if k in self.catalog.blocks], CACHE_CLIENT)
        recompute = {k: "waiting" for k in known if tasks[k].state == "released"}
        if recompute:  # needed again after it left memory: Dask recomputes it from lineage
            self.scheduler.transitions(recompute, stimulus_id=f"kv-acquire-{now}")
        return {k: tasks[k].state for k in known}

    def _where(self, ts) -> list[str]:
        """Workers that hold the key, or the one expected to compute it (following take_block)."""
        for _ in range(3):
            if ts.who_has:
                return sorted(ws.address for ws in ts.who_has)
            if ts.processing_on is not None:
                return [ts.processing_on.address]
            if ts.worker_restrictions:
                return sorted(w for w in ts.worker_restrictions if w in self.scheduler.workers)
            if len(ts.dependencies) != 1:  # a block's only input is the prefill that made it
                break
            ts = next(iter(ts.dependencies))
        return []

    # -- eviction -------------------------------------------------------------------------
    def kv_bytes_by_worker(self) -> dict[str, int]:
        return {
            addr: sum(ts.get_nbytes() for ts in ws.has_what if ts.key in self.catalog.blocks)
            for addr, ws in self.scheduler.workers.items()
        }

    def _pinned(self, ts, now: float) -> bool:
        """A block this worker must keep: leased, read by a waiting/running task, or held by a state."""
        if self._leases.get(ts.key, 0.0) > now or ts.waiters:
            return True
        if len(ts.who_has or ()) > 1:  # an extra replica: the states keep the other copy
            return False
        return any(cs.client_key != CACHE_CLIENT for cs in ts.who_wants or ())

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

    def _enforce_budgets(self, force: bool = False) -> list[str]:
        if self.kv_budget_bytes is None or not (self._dirty or force):
            return []
        self._dirty = False
        now = time.time()
        stimulus = f"kv-evict-{now}"
        evicted = []
        for addr, ws in list(self.scheduler.workers.items()):
            kv_tasks = [ts for ts in ws.has_what if ts.key in self.catalog.blocks]
            used = sum(ts.get_nbytes() for ts in kv_tasks)
            if used <= self.kv_budget_bytes:
                self._over_budget.discard(addr)
                continue
            usage = []
            for ts in kv_tasks:
                e = self.catalog.blocks[ts.key]
                usage.append(BlockUsage(ts.key, ts.get_nbytes(), e.last_access, e.reuse_count,
                                        self._pinned(ts, now), e.parent, e.start))
            plan = choose_victims(usage, used, self.kv_budget_bytes, now)
            for key in plan.victims:
                ts = self.scheduler.tasks[key]
                if len(ts.who_has or ()) > 1:  # drop this worker's replica only
                    self.scheduler.request_remove_replicas(addr, [key], stimulus_id=stimulus)
                else:
                    self._evicting.add(key)
                    self.scheduler.client_releases_keys([key], CACHE_CLIENT, stimulus_id=stimulus)
                self.catalog.count("evictions")
                self.catalog.count("bytes_evicted", ts.get_nbytes())
                self._event("evict", key=key, worker=addr, nbytes=ts.get_nbytes())
                evicted.append(key)
            if plan.over_budget_pinned:
                self._dirty = True  # check again: pinned blocks become evictable when released
                if addr not in self._over_budget:
                    self._over_budget.add(addr)
                    logger.warning("worker %s holds %d KV bytes, over its budget, all pinned", addr,
                                   plan.remaining_bytes)
                    self._event("over-budget", worker=addr, nbytes=plan.remaining_bytes)
            else:
                self._over_budget.discard(addr)
        self._evicting = {k for k in self._evicting if k in self.scheduler.tasks}  # dropped some other way
        return evicted

    # -- profiles -------------------------------------------------------------------------
    def prefill_profiles(self) -> dict[str, dict]:
        out = {}
        for worker, samples in self.samples.items():
            if samples and worker in self.scheduler.workers:
                p = fit_prefill_profile(list(samples))
                out[worker] = {"a": p.a, "b": p.b, "c": p.c, "samples": len(samples)}
        return out

    def bandwidth(self) -> dict[str, float]:
        """Measured bytes/s per "src->dst" pair.

        A calibration probe (a real transfer timed from the receiver's transfer log) wins:
        it is recent. Dask's own per-pair figure fills the other pairs; it averages every
        transfer over 1 MB since the worker started, so it lags when the link changes.
        """
        out = {f"{src}->{dst}": bw for (dst, src), bw in self.scheduler.bandwidth_workers.items()}  # (receiver, sender)
        out.update({f"{s}->{d}": bw for (s, d), bw in self.probed_bandwidth.items()})
        return out

    # -- handlers (client RPC) ------------------------------------------------------------
    def handle_lookup(self, fingerprint: str, tokens: list[int], block_size: int, client: str | None = None) -> dict:
        """Longest cached prefix of ``tokens``, acquired for ``client`` before this returns."""
        match = self.catalog.lookup(fingerprint, tokens, block_size)
        usable = []
        for b in match.blocks:  # stop at the first block Dask cannot give back
            ts = self.scheduler.tasks.get(b.key)
            if ts is None or ts.state in _NOT_USABLE:
                break
            usable.append(b)
        covered = match.tokens if len(usable) == len(match.blocks) else (usable[-1].end if usable else 0)
        states = self._acquire([b.key for b in usable], client)
        blocks = []
        for b in usable:
            ts = self.scheduler.tasks[b.key]
            blocks.append(
                {
                    "key": b.key,
                    "start": b.start,
                    "end": b.end,
                    "nbytes": b.nbytes,
                    "tokens": list(b.token_ids),
                    "who_has": sorted(ws.address for ws in (ts.who_has or ())),
                    "where": self._where(ts),
                    "state": states.get(b.key, ts.state),
                }
            )
        return {"tokens": covered, "blocks": blocks}

    def handle_acquire(self, keys: list[str], client: str | None = None) -> dict[str, str]:
        return self._acquire(keys, client)

    def handle_snapshot(self) -> dict:
        s = self.scheduler
        kv_bytes = self.kv_bytes_by_worker()
        return {
            "workers": {
                addr: {"nthreads": ws.nthreads, "processing": len(ws.processing), "kv_bytes": kv_bytes[addr]}
                for addr, ws in s.workers.items()
            },
            "bandwidth": self.bandwidth(),
            "default_bandwidth": s.bandwidth,
            "prefill_profiles": self.prefill_profiles(),
            "kv_budget_bytes": self.kv_budget_bytes,
            "memory_weight": self.memory_weight,
        }

    async def handle_register_states(self, metas: list[dict], timeout: float = 10.0) -> None:
        """Record states, once the scheduler knows all their blocks.

        The client submits block tasks over its batched stream and calls this over RPC,
        which can overtake them; waiting here means that once an operation returns, every
        later lookup (from any client) sees its blocks.
        """
        keys = {k for m in metas for k in m["block_keys"]}
        deadline = time.time() + timeout
        while not keys <= self.scheduler.tasks.keys() and time.time() < deadline:
            await asyncio.sleep(0.002)
        for meta in metas:
            self.catalog.add_state(meta)
            self._event(meta.get("op", "state"), state_id=meta["state_id"], parents=list(meta.get("parents", ())),
                        blocks=len(meta["block_keys"]), tokens=meta.get("tokens", 0), worker=meta.get("worker"),
                        **{k: meta[k] for k in ("tokens_reused", "tokens_computed") if k in meta})

    def handle_release_state(self, state_id: str) -> None:
        self.catalog.release_state(state_id)
        self._dirty = True
        self._event("release", state_id=state_id)

    def handle_catalog(self) -> list[dict]:
        self.catalog.prune()
        tasks = self.scheduler.tasks
        who_has, refcount, cached = {}, {}, set()
        for k in self.catalog.blocks:
            ts = tasks.get(k)
            if ts is None:
                continue
            who_has[k] = sorted(ws.address for ws in (ts.who_has or ()))
            refcount[k] = len(self.catalog.live_holders.get(k, ())) + len(ts.waiters or ())
            if any(cs.client_key == CACHE_CLIENT for cs in ts.who_wants or ()):
                cached.add(k)
        return self.catalog.rows(who_has, refcount, cached)

    def handle_counters(self) -> dict:
        c = dict(self.catalog.counters)
        total = c["tokens_reused"] + c["tokens_computed"]
        c["reuse_ratio"] = c["tokens_reused"] / total if total else 0.0
        return {
            "counters": c,
            "decisions": list(self.decisions)[-32:],
            "kv_bytes": self.kv_bytes_by_worker(),
            "kv_budget_bytes": self.kv_budget_bytes,
            "events": list(self.events)[-64:],
        }

    def handle_record_bandwidth(self, src: str, dst: str, bandwidth: float) -> None:
        self.probed_bandwidth[(src, dst)] = bandwidth

    def handle_configure(self, kv_budget_bytes=None, memory_weight=None, unset_budget=False) -> None:
        if kv_budget_bytes is not None or unset_budget:
            self.kv_budget_bytes = kv_budget_bytes
        if memory_weight is not None:
            self.memory_weight = memory_weight
        self._dirty = True

    def handle_evict_now(self) -> list[str]:
        return self._enforce_budgets(force=True)

    def catalog_table(self):
        return rows_to_arrow(self.handle_catalog())


@click.command()
@click.option("--kv-budget", default=None, help="per-worker KV bytes, e.g. 2GiB (default: daskflow-kv.kv-budget)")
@click.option("--kv-memory-weight", default=None, type=float, help="seconds charged per KV byte placed")
async def dask_setup(scheduler, kv_budget: str | None = None, kv_memory_weight: float | None = None) -> None:
    """Entry point for ``dask scheduler --preload daskflow_kv.plugins.kv_scheduler``."""
    await scheduler.register_scheduler_plugin(
        KVSchedulerPlugin(kv_budget_bytes=kv_budget, memory_weight=kv_memory_weight), name=PLUGIN_NAME,
        idempotent=True,
    )
