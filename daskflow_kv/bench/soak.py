"""A soak: two clients stream workflows for half an hour under a KV budget that forces evictions.

One LocalCluster (workers under nannies), a persistent store written through, a per-worker
KV budget of part of the documents' working set (never less than one workflow's KV). Each
client (its own ``Client`` and ``KVRuntime``) keeps ``concurrency`` workflows in flight,
drawn from a pool of distinct RAG and debate workflows over shared documents
(``load_stream.build``), until ``minutes`` have passed. Each pool workflow is replayed in
text mode once, first: every run of it must give those tokens.

Every ``sample_every`` seconds the scenario reads what could grow without bound: scheduler,
worker and client RSS, the scheduler's tasks, the plugin's catalog (blocks, states), event
and decision buffers, sessions, leases and planned reuse, finished-workflow records, and
the workers' store writes in flight. Growth (``growth``) compares the stream's end with the
end of ``warmup_minutes`` (the target: at most +10 %). When the clients have closed, the KV keys
left in the scheduler must be the cache's (retained on purpose), none wanted by no one.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass

from .. import dask_internals as di
from ..keys import PLUGIN_NAME
from .chaos import agent_tokens, run_flow
from .load_stream import Arrival, build, doc_sequence, documents

STALL_S = 20.0  # no workflow finished for this long: the admission state is recorded
GROWTH_LIMIT = 0.10  # +10 % from the end of warm-up to the end
GAUGES = ("scheduler_rss", "workers_rss", "client_rss", "tasks", "catalog_blocks", "catalog_states", "events",
          "decisions", "sessions", "leases", "timeline_workflows", "store_writes_in_flight", "dask_spans",
          "dask_span_groups")
# Gauges that count what is in flight: they swing with each workflow between a few units and
# their peak, so their levelling off is judged by peaks (``peak_growth``), not by the ends.
IN_FLIGHT = ("sessions", "leases", "timeline_workflows", "store_writes_in_flight", "dask_spans", "dask_span_groups")


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 30.0
    clients: int = 2
    concurrency: int = 3  # workflows in flight per client
    docs: int = 4
    context: int = 160  # tokens per shared document
    max_new: int = 8
    pool: int = 40  # distinct workflows, drawn again and again
    budget_fraction: float = 0.5  # of the documents' KV working set, per worker
    budget_workflows: float | None = None  # per-worker budget in workflows' KV; None: room for what is in flight
    sample_every: float = 30.0
    warmup_minutes: float = 5.0
    hang_s: float = 300.0  # a workflow still running this long after the stream's end counts as hung
    seed: int = 11


def _scheduler_gauges(dask_scheduler) -> dict:
    import psutil

    from daskflow_kv.keys import PLUGIN_NAME

    p = dask_scheduler.plugins[PLUGIN_NAME]
    spans, span_groups = di.span_history_size(dask_scheduler)
    return {"dask_spans": spans, "dask_span_groups": span_groups,"scheduler_rss": psutil.Process().memory_info().rss, "tasks": len(dask_scheduler.tasks),
            "catalog_blocks": len(p.catalog.blocks), "catalog_states": len(p.catalog.states),
            "events": len(p.event_log.events()), "decisions": len(p.event_log.decisions()),
            "sessions": len(p.tenants), "leases": p.leases.held(), "timeline_workflows": p.timeline.held()}


def _worker_gauges() -> dict:
    import psutil

    from daskflow_kv.store import worker_io

    return {"rss": psutil.Process().memory_info().rss, "writes": worker_io.pending_writes()}


def gauges(client) -> dict:
    import psutil

    g = client.run_on_scheduler(_scheduler_gauges)
    workers = client.run(_worker_gauges)
    g["workers_rss"] = sum(w["rss"] for w in workers.values())
    g["store_writes_in_flight"] = sum(w["writes"] for w in workers.values())
    g["client_rss"] = psutil.Process().memory_info().rss  # the clients run in this process (the scheduler too, in-process)
    return g


def growth(samples: list[dict], warmup_s: float, n: int = 3) -> dict:
    """Each gauge's growth from the end of warm-up to the end of the stream: the mean of the last
    ``n`` samples against the mean of the first ``n`` at or after ``warmup_s`` (means, since
    sessions, leases and tasks in flight come and go with each workflow). None where both are
    0; the end itself where only the base is 0."""
    after = [s for s in samples if s["at_s"] >= warmup_s]
    if len(after) < 2:
        return {}
    k = min(n, len(after) // 2)
    out = {}
    for g in GAUGES:
        b = sum(s.get(g, 0) for s in after[:k]) / k
        e = sum(s.get(g, 0) for s in after[-k:]) / k
        out[g] = (e - b) / b if b else (None if e == 0 else float(e))
    return out


def peak_growth(samples: list[dict], warmup_s: float) -> dict:
    """Each gauge's peak over the second half of the stream after warm-up against its peak over
    the first half. None where both peaks are 0."""
    after = [s for s in samples if s["at_s"] >= warmup_s]
    if len(after) < 2:
        return {}
    h = len(after) // 2
    out = {}
    for g in GAUGES:
        a, b = max(s.get(g, 0) for s in after[:h]), max(s.get(g, 0) for s in after[h:])
        out[g] = (b - a) / a if a else (None if b == 0 else float(b))
    return out


def levels_off(samples: list[dict], warmup_s: float) -> bool:
    """Every gauge grew at most ``GROWTH_LIMIT`` after warm-up: memory and what the scheduler
    keeps by their ends (``growth``), what is in flight by its peaks (``peak_growth``)."""
    ends, peaks = growth(samples, warmup_s), peak_growth(samples, warmup_s)
    return all(v is None or v <= GROWTH_LIMIT for k, v in ends.items() if k not in IN_FLIGHT) and \
        all(v is None or v <= GROWTH_LIMIT for k, v in peaks.items() if k in IN_FLIGHT)


def _admission(dask_scheduler) -> dict:
    from daskflow_kv.keys import PLUGIN_NAME

    return dask_scheduler.plugins[PLUGIN_NAME].budget.snapshot()


def _left_keys(dask_scheduler) -> dict:
    """KV keys still in the scheduler: the cache's (retained on purpose) and any other's."""
    from daskflow_kv.keys import CACHE_CLIENT, is_block

    cache, other, unwanted = 0, 0, 0
    for k, ts in dask_scheduler.tasks.items():
        if not is_block(k) or ts.state != "memory":
            continue
        wanted = {c.client_key for c in ts.who_wants or ()}
        if wanted == {CACHE_CLIENT}:
            cache += 1
        elif wanted:
            other += 1
        else:
            unwanted += 1
    return {"cache": cache, "wanted_by_others": other, "wanted_by_no_one": unwanted}


def run_soak(cluster, workers: int, cfg: SoakConfig, store: str | None = None, log=print) -> dict:
    """``cluster``: a LocalCluster or a scheduler's address, with ``workers`` workers."""
    from distributed import Client

    from ..runtime.kv_runtime import KVRuntime

    clients = [Client(cluster) for _ in range(cfg.clients)]
    runtimes = [KVRuntime(c, "tiny-llama", block_size=16, kv_store=store) for c in clients]
    rng = random.Random(cfg.seed)
    rt = runtimes[0]
    texts = documents(rt.tokenizer, cfg.docs, cfg.context)
    docs = doc_sequence(cfg.pool, cfg.docs, "zipf", seed=cfg.seed)
    salt = f"soak-{rng.randrange(1 << 30)}"
    pool = [build(Arrival(i, 0.0, 0, docs[i]), texts[docs[i]], salt, cfg.max_new) for i in range(cfg.pool)]
    log(f"soak: text replay of the {cfg.pool} pool workflows (the reference)")
    ref = [agent_tokens(run_flow(rt, wf, "text")) for wf in pool]
    one = max(sum(len(t) for t in r.values()) for r in ref) + 4 * cfg.context  # one workflow's KV, generously
    # Room for the workflows in flight (spread over the workers), not for everything the cache
    # would keep: the budget binds (evictions) without the stream living on preemptions. A
    # budget far below what is in flight is the load benchmark's concern (exp 7, issue 24).
    in_flight = cfg.clients * cfg.concurrency * one / workers
    tokens = max(cfg.budget_fraction * cfg.docs * cfg.context, in_flight)
    if cfg.budget_workflows is not None:  # a budget that binds whatever the timing (the short test)
        tokens = cfg.budget_workflows * one
    budget = int(tokens * rt.facts.bytes_per_token)
    rt.configure(kv_budget_bytes=budget)
    counters_before = rt.counters()["counters"]

    records: list[dict] = []
    lock = threading.Lock()
    t0 = time.time()
    deadline = t0 + cfg.minutes * 60

    def drain(c: int, j: int) -> None:
        r = random.Random(cfg.seed * 1000 + c * 100 + j)
        while time.time() < deadline:
            i = r.randrange(cfg.pool)
            start = time.time()
            try:
                agree = agent_tokens(run_flow(runtimes[c], pool[i], "state")) == ref[i]
                rec = {"pool": i, "client": c, "latency_s": time.time() - start, "agree": agree}
            except Exception as e:  # noqa: BLE001 -- recorded: a lost workflow
                rec = {"pool": i, "client": c, "latency_s": time.time() - start,
                       "error": f"{type(e).__name__}: {str(e)[:200]}"}
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=drain, args=(c, j), daemon=True, name=f"soak-{c}-{j}")
               for c in range(cfg.clients) for j in range(cfg.concurrency)]
    log(f"soak: {cfg.clients} clients x {cfg.concurrency} in flight for {cfg.minutes:g} min, "
        f"budget {budget / 2**20:.1f} MiB per worker")
    for th in threads:
        th.start()
    samples, stalls = [], []
    last_count, last_change = 0, time.time()
    while any(th.is_alive() for th in threads) and time.time() < deadline + cfg.hang_s:
        g = gauges(clients[0])
        with lock:
            g.update(at_s=time.time() - t0, workflows=len(records))
        samples.append(g)
        if g["workflows"] != last_count:
            last_count, last_change = g["workflows"], time.time()
        elif time.time() - last_change > STALL_S and len(stalls) < 20:  # nothing finished for a while: why
            stalls.append({"at_s": g["at_s"], "admission": clients[0].run_on_scheduler(_admission)})
            log(f"soak: no workflow finished for {time.time() - last_change:.0f} s; admission holds "
                f"{len(stalls[-1]['admission']['held'])} tasks")
        log(f"soak: {g['at_s'] / 60:5.1f} min, {g['workflows']} workflows, scheduler RSS "
            f"{g['scheduler_rss'] / 2**20:.0f} MiB, catalog {g['catalog_blocks']} blocks")
        end = time.time() + cfg.sample_every
        while time.time() < end and any(th.is_alive() for th in threads):
            time.sleep(0.5)
    hung = sum(1 for th in threads if th.is_alive())  # still in a workflow hang_s after the end
    counters = rt.counters()["counters"]
    rt.configure(unset_budget=True)
    wall = time.time() - t0
    for c in clients[1:]:
        c.close()
    # The last client gone: its states are released; what stays is the cache's.
    observer = Client(cluster)
    clients[0].close()
    time.sleep(2.0)
    left = observer.run_on_scheduler(_left_keys)
    sessions_left = observer.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.plugins[PLUGIN_NAME].tenants))
    observer.close()
    ok = [r for r in records if "error" not in r]
    g = growth(samples, cfg.warmup_minutes * 60)
    return {
        "config": asdict(cfg), "model": "tiny-llama", "workers": workers, "store": store is not None,
        "kv_budget_bytes": budget, "wall_s": wall, "workflows": len(records), "completed": len(ok),
        "wrong": sum(1 for r in ok if not r["agree"]), "lost": len(records) - len(ok), "hung_threads": hung,
        "errors": sorted({r["error"] for r in records if "error" in r})[:10],
        "workflows_per_min": len(ok) / (wall / 60),
        "evictions": counters.get("evictions", 0) - counters_before.get("evictions", 0),
        "growth_after_warmup": g,
        "peak_growth_after_warmup": peak_growth(samples, cfg.warmup_minutes * 60),
        "growth_ok": levels_off(samples, cfg.warmup_minutes * 60),
        "keys_left_after_clients_closed": left, "sessions_left": sessions_left,  # the observer has no KV session
        "samples": samples, "stalls": stalls,
    }
