"""The KV-aware scheduler plugin: catalog, locality, cache retention, eviction, profiles.

Dask already places tasks, moves dependencies, counts references and recomputes lost keys.
This plugin adds what Dask does not know about KV cache:

* a catalog of blocks and states (token ranges, chains, reuse, lifecycle), exported as rows
  or an Arrow table, and a prefix index so any client finds the longest cached prefix;
* locality: a KV-consuming task runs where its blocks live unless the plan says transfer
  (set as loose worker restrictions in ``update_graph``, so a dead worker's tasks can
  still run elsewhere and Dask recomputes the lost blocks from lineage);
* retention: published blocks are held by a scheduler-side pseudo-client, so a prefix
  outlives the workflow that made it and the next one reuses it;
* eviction: per-worker KV byte budget, enforced by releasing the least valuable blocks
  that no live state or task references;
* profiles: prefill timings reported by workers, fitted per worker for the cost model, and
  bandwidth per worker pair from Dask's own transfer measurements or a calibration probe;
* an Active Memory Manager policy that no longer drops KV replicas the plan placed.

Load it with ``client.register_plugin(KVSchedulerPlugin())`` or ``dask scheduler
--preload daskflow_kv.plugins.kv_scheduler``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque

from distributed.active_memory_manager import ReduceReplicas
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import ClientState
from tornado.ioloop import PeriodicCallback

from daskflow_kv.cost_model import PrefillSample, fit_prefill_profile
from daskflow_kv.eviction import BlockUsage, choose_victims
from daskflow_kv.runtime.catalog import KVCatalog, rows_to_arrow

logger = logging.getLogger("daskflow_kv.scheduler")

CACHE_CLIENT = "daskflow-kv-cache"  # pseudo-client that keeps published blocks alive
EVENT_TOPIC = "daskflow-kv"  # lifecycle events, visible through client.get_events
PREFILL_TOPIC = "daskflow-kv-prefill"  # timings reported by workers (see runtime.tasks)
PLUGIN_NAME = "daskflow-kv"
_MAX_SAMPLES = 64  # prefill samples kept per worker for the profile fit


class KVAwareReduceReplicas(ReduceReplicas):
    """Dask's ReduceReplicas, minus KV blocks: their replicas are placed on purpose."""

    def run(self):
        for suggestion in super().run():
            if not str(suggestion.ts.key).startswith("kvblock-"):
                yield suggestion


class KVSchedulerPlugin(SchedulerPlugin):
    name = PLUGIN_NAME

    def __init__(self, kv_budget_bytes: int | None = None, memory_weight: float = 0.0, evict_interval: float = 0.2):
        self.kv_budget_bytes = kv_budget_bytes  # per worker; None = unbounded
        self.memory_weight = memory_weight  # lambda: seconds charged per byte placed on a worker
        self.evict_interval = evict_interval  # seconds between budget checks
        self.catalog = KVCatalog()
        self.samples: dict[str, deque] = defaultdict(lambda: deque(maxlen=_MAX_SAMPLES))
        self.probed_bandwidth: dict[tuple[str, str], float] = {}  # (src, dst) -> bytes/s
        self.decisions: deque = deque(maxlen=256)  # recent cost-model decisions, newest last
        self.events: deque = deque(maxlen=1024)  # recent lifecycle events
        self.scheduler = None
        self._dirty = False  # a block entered memory since the last budget check
        self._pc: PeriodicCallback | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.clients.setdefault(CACHE_CLIENT, ClientState(CACHE_CLIENT))
        scheduler.handlers.update(
            {
                "kv_lookup": self.handle_lookup,
                "kv_snapshot": self.handle_snapshot,
                "kv_register_state": self.handle_register_state,
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
        self._pc = PeriodicCallback(self._enforce_budgets, self.evict_interval * 1000)
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
        kv = annotations.get("kv", {})
        published = []
        for key, note in kv.items():
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

    def _place(self, ts, note: dict) -> None:
        """Restrict a KV-consuming task to the plan's worker, or to where its blocks live."""
        target = note.get("target")
        reads = [self.scheduler.tasks.get(k) for k in note.get("reads", ())]
        if target is None:
            held: dict[str, int] = defaultdict(int)
            for dts in reads:
                for ws in (dts.who_has or ()) if dts is not None else ():
                    held[ws.address] += dts.nbytes
            target = max(held, key=held.get) if held else None
        if target is not None and target in self.scheduler.workers:
            # Loose: if that worker dies, the task may run elsewhere (recompute from lineage).
            ts.worker_restrictions = {target}
            ts.loose_restrictions = True
        for k in note.get("reads", ()):
            self.catalog.touch(k)
        decision = note.get("decision")
        if decision:
            self.decisions.append(decision)
            if decision.get("action") == "transfer":
                self.catalog.count("transfers")
                self.catalog.count("bytes_transferred", decision.get("nbytes", 0))
            elif decision.get("action") == "recompute":
                self.catalog.count("recomputes")
        self._event(note.get("op", "compute"), key=str(ts.key), worker=target, state_id=note.get("state_id"))

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        entry = self.catalog.blocks.get(key)
        if entry is None:
            return
        if finish == "memory":
            if entry.status in ("lost", "evicted", "released") and entry.status != "pending":
                entry.recomputes += 1
                self.catalog.count("recomputes")
                self._event("recompute", key=key)
            entry.status = "memory"
            self._dirty = True
        elif start == "memory" and finish == "released":
            ts = self.scheduler.tasks.get(key)
            wanted = ts is not None and bool(ts.who_wants)
            if entry.status != "evicted":
                self.catalog.mark(key, "lost" if wanted else "released")
                if wanted:  # a worker died holding it; Dask recomputes it from its run spec
                    self.catalog.index.add(*_index_args(entry, self.catalog))
        elif finish == "forgotten":
            if entry.status not in ("evicted",):
                self.catalog.mark(key, "released")
            self.catalog.index.remove(key)

    def log_event(self, topic, msg) -> None:
        if topic == PREFILL_TOPIC and isinstance(msg, dict) and msg.get("new_tokens"):
            self.samples[msg["worker"]].append(
                PrefillSample(msg["new_tokens"], msg.get("prefix_tokens", 0), msg["seconds"])
            )
            self.catalog.count("tokens_computed", msg["new_tokens"])
            self.catalog.count("tokens_reused", msg.get("prefix_tokens", 0))

    def remove_worker(self, scheduler, worker, **kwargs) -> None:
        self.samples.pop(worker, None)
        self._event("worker-lost", worker=worker)

    # -- eviction -------------------------------------------------------------------------
    def kv_bytes_by_worker(self) -> dict[str, int]:
        out = {}
        for addr, ws in self.scheduler.workers.items():
            out[addr] = sum(ts.nbytes for ts in ws.has_what if ts.key in self.catalog.blocks)
        return out

    def _pinned(self, ts) -> bool:
        wanters = {cs.client_key for cs in ts.who_wants or ()} - {CACHE_CLIENT}
        return bool(wanters) or bool(ts.waiters) or any(d.state == "processing" for d in ts.dependents or ())

    def _enforce_budgets(self, force: bool = False) -> list[str]:
        if self.kv_budget_bytes is None or not (self._dirty or force):
            return []
        self._dirty = False
        evicted = []
        now = time.time()
        for addr, ws in list(self.scheduler.workers.items()):
            kv_tasks = [ts for ts in ws.has_what if ts.key in self.catalog.blocks]
            used = sum(ts.nbytes for ts in kv_tasks)
            if used <= self.kv_budget_bytes:
                continue
            usage = [
                BlockUsage(
                    key=ts.key,
                    nbytes=ts.nbytes,
                    last_access=self.catalog.blocks[ts.key].last_access,
                    reuse_count=self.catalog.blocks[ts.key].reuse_count,
                    pinned=self._pinned(ts),
                    parent=self.catalog.blocks[ts.key].parent,
                )
                for ts in kv_tasks
            ]
            plan = choose_victims(usage, used, self.kv_budget_bytes, now)
            if plan.over_budget_pinned:
                logger.warning("worker %s holds %d KV bytes, over budget, all pinned", addr, plan.remaining_bytes)
            stimulus = f"kv-evict-{now}"
            for key in plan.victims:
                ts = self.scheduler.tasks[key]
                if len(ts.who_has or ()) > 1:  # drop this worker's replica only
                    self.scheduler.request_remove_replicas(addr, [key], stimulus_id=stimulus)
                else:
                    self.catalog.mark(key, "evicted")
                    self.scheduler.client_releases_keys([key], CACHE_CLIENT, stimulus_id=stimulus)
                self.catalog.count("evictions")
                self.catalog.count("bytes_evicted", ts.nbytes)
                self._event("evict", key=key, worker=addr, nbytes=ts.nbytes)
                evicted.append(key)
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
        """Measured bytes/s per "src->dst" pair: Dask's transfer records, else our probes."""
        out = {f"{s}->{d}": bw for (s, d), bw in self.probed_bandwidth.items()}
        for (dst, src), bw in self.scheduler.bandwidth_workers.items():
            out[f"{src}->{dst}"] = bw  # Dask keys it (receiver, sender)
        return out

    # -- handlers (client RPC) ------------------------------------------------------------
    def handle_lookup(self, fingerprint: str, tokens: list[int], block_size: int) -> dict:
        match = self.catalog.lookup(fingerprint, tokens, block_size)
        blocks = []
        for b in match.blocks:
            ts = self.scheduler.tasks.get(b.key)
            blocks.append(
                {
                    "key": b.key,
                    "start": b.start,
                    "end": b.end,
                    "nbytes": b.nbytes,
                    "tokens": list(b.token_ids),
                    "who_has": [ws.address for ws in (ts.who_has or ())] if ts else [],
                    "state": ts.state if ts else "forgotten",
                }
            )
        return {"tokens": match.tokens, "blocks": blocks}

    def handle_snapshot(self) -> dict:
        s = self.scheduler
        return {
            "workers": {
                addr: {"nthreads": ws.nthreads, "processing": len(ws.processing), "kv_bytes": b}
                for (addr, ws), b in zip(s.workers.items(), self.kv_bytes_by_worker().values())
            },
            "bandwidth": self.bandwidth(),
            "default_bandwidth": s.bandwidth,
            "prefill_profiles": self.prefill_profiles(),
            "kv_budget_bytes": self.kv_budget_bytes,
            "memory_weight": self.memory_weight,
        }

    def handle_register_state(self, meta: dict) -> None:
        self.catalog.add_state(meta)
        self._event(meta.get("op", "state"), state_id=meta["state_id"], parents=list(meta.get("parents", ())))

    def handle_release_state(self, state_id: str) -> None:
        self.catalog.release_state(state_id)
        self._event("release", state_id=state_id)

    def handle_catalog(self) -> list[dict]:
        who_has = {
            k: [ws.address for ws in (ts.who_has or ())]
            for k in self.catalog.blocks
            if (ts := self.scheduler.tasks.get(k)) is not None
        }
        refcount = {
            k: len({cs.client_key for cs in ts.who_wants or ()} - {CACHE_CLIENT}) + len(ts.waiters or ())
            for k in self.catalog.blocks
            if (ts := self.scheduler.tasks.get(k)) is not None
        }
        return self.catalog.rows(who_has, refcount)

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


def _index_args(entry, catalog):
    from daskflow_kv.blocks import BlockRef

    tokens = catalog.index._by_key.get(entry.key)
    ref = tokens or BlockRef(entry.key, entry.start, (), entry.nbytes)
    return ref, entry.parent, entry.fingerprint


async def dask_setup(scheduler, budget: str | None = None) -> None:
    """Entry point for ``dask scheduler --preload daskflow_kv.plugins.kv_scheduler``."""
    from dask.utils import parse_bytes

    await scheduler.register_scheduler_plugin(
        KVSchedulerPlugin(kv_budget_bytes=parse_bytes(budget) if budget else None), name=PLUGIN_NAME
    )
