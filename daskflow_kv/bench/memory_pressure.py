"""Memory pressure: workers whose ``memory_limit`` is below their working set (model + KV).

A probe cluster measures a worker's resident memory once the model is loaded (the part Dask
cannot spill). The scenario's cluster then gives each worker a ``memory_limit`` of that
baseline over ``baseline_fraction`` - below the model plus the KV its share of the documents
needs - and no KV budget: Dask's memory manager is the only bound. One client streams RAG and debate workflows over
the documents (the cache keeps every context, so the KV piles up): Dask must spill blocks to
disk (its ``target``/``spill`` thresholds) and may pause a worker (``pause``); the KV tier
must follow (a spilled block does not count as held in memory; a reader unspills it).

Recorded: every workflow completes (none past ``hang_s``) and gives text replay's tokens;
the bytes Dask spilled to disk at the peak, worker pauses seen (sampled every 0.5 s), peak
resident memory against the limit, and how long the stream took.
"""

from __future__ import annotations

import threading
import time

from .chaos import agent_tokens, run_flow
from .load_stream import Arrival, build, documents


def _worker_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def baseline_rss(model: str, workers: int = 2) -> int:
    """A worker's resident bytes with ``model`` loaded (the most of any worker), on a probe cluster."""
    from distributed import Client

    from ..runtime.cluster import local_cluster
    from ..runtime.kv_runtime import KVRuntime

    with local_cluster(workers, 1, dashboard_address=None) as cluster, Client(cluster) as client:
        rt = KVRuntime(client, model, block_size=16)
        from ..dask_internals import worker_addresses

        addresses = worker_addresses(client)
        rt.wait([rt.materialize(rt.encode("warm up the model on every worker"), worker=w) for w in addresses])
        return max(client.run(_worker_rss).values())


def _spilled_total(dask_worker) -> int:
    from ..dask_internals import bytes_spilled_to_disk

    return bytes_spilled_to_disk(dask_worker)


def _sample(dask_scheduler) -> dict:
    out = {}
    for addr, ws in dask_scheduler.workers.items():
        spilled = ws.metrics.get("spilled_bytes", {}) if isinstance(ws.metrics, dict) else {}
        out[addr] = {"status": ws.status.name, "rss": ws.metrics.get("memory", 0),
                     "spilled_disk": spilled.get("disk", 0) if isinstance(spilled, dict) else 0,
                     "managed": ws.metrics.get("managed_bytes", 0)}
    return out


def run_memory_pressure(model: str = "smollm2", workflows: int = 16, docs: int = 16, context: int = 2048,
                        max_new: int = 8, baseline_fraction: float = 0.66, thresholds: dict | None = None,
                        workers: int = 2, hang_s: float = 900.0, log=print) -> dict:
    """``baseline_fraction``: the model-loaded worker's share of its ``memory_limit`` (below Dask's
    spill and pause thresholds, or nothing could ever run); ``thresholds``: Dask's
    ``distributed.worker.memory.*`` fractions to use instead of its defaults."""
    import dask
    from distributed import Client

    from ..runtime.cluster import local_cluster
    from ..runtime.kv_runtime import KVRuntime

    base = baseline_rss(model, workers)
    limit = int(base / baseline_fraction)
    thresholds = {k: dask.config.get(f"distributed.worker.memory.{k}") for k in ("target", "spill", "pause",
                                                                                    "terminate")} | (thresholds or {})
    samples: list[dict] = []
    stop = threading.Event()
    with dask.config.set({f"distributed.worker.memory.{k}": v for k, v in thresholds.items()}), \
            local_cluster(workers, 1, memory_limit=limit, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        rt = KVRuntime(client, model, block_size=16)
        bpt = rt.facts.bytes_per_token
        kv_per_worker = docs * context * bpt / workers
        log(f"memory-pressure: worker baseline {base / 2**20:.0f} MiB, memory_limit {limit / 2**20:.0f} MiB, "
            f"documents' KV per worker {kv_per_worker / 2**20:.0f} MiB (working set "
            f"{(base + kv_per_worker) / limit:.2f}x the limit)")
        texts = documents(rt.tokenizer, docs, context)
        flows = [build(Arrival(i, 0.0, 0, i % docs), texts[i % docs], "memory-pressure", max_new)
                 for i in range(workflows)]

        def watch() -> None:
            while not stop.is_set():
                try:
                    samples.append({"at": time.time(), "workers": client.run_on_scheduler(_sample)})
                except Exception:  # noqa: BLE001 -- a sample missed while the cluster is busy
                    pass
                stop.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        records: dict[int, dict] = {}
        lock = threading.Lock()

        def stream() -> None:
            for i, wf in enumerate(flows):
                t = time.time()
                try:
                    rec = {"tokens": agent_tokens(run_flow(rt, wf, "state")), "latency_s": time.time() - t}
                except Exception as e:  # noqa: BLE001 -- recorded: a lost workflow
                    rec = {"error": f"{type(e).__name__}: {str(e)[:200]}", "latency_s": time.time() - t}
                with lock:
                    records[i] = rec

        t0 = time.time()
        th = threading.Thread(target=stream, daemon=True)
        th.start()
        th.join(timeout=hang_s)
        hung = th.is_alive()
        wall = time.time() - t0
        stop.set()
        watcher.join(timeout=5)
        log(f"memory-pressure: {len(records)} workflows in {wall:.0f} s; text replay for the reference")
        with lock:  # a hung stream may still write
            records = dict(records)
        done = [i for i, r in records.items() if "error" not in r]
        ref = {i: agent_tokens(run_flow(rt, flows[i], "text")) for i in done} if not hung else {}
        tiers = rt.counters()["counters"]
        spilled_total = sum(client.run(_spilled_total).values())
    ok = {i: records[i] for i in done}
    pauses = 0  # a worker's transitions into "paused", sample to sample
    for addr in {a for s in samples for a in s["workers"]}:
        seen = [s["workers"][addr]["status"] for s in samples if addr in s["workers"]]
        pauses += sum(1 for prev, st in zip(["running"] + seen, seen) if st == "paused" and prev != "paused")
    return {
        "model": model, "workers": workers, "workflows": workflows, "docs": docs, "context": context,
        "bytes_per_token": bpt, "worker_baseline_rss": base, "kv_per_worker": kv_per_worker,
        "memory_limit": limit, "baseline_fraction": baseline_fraction, "thresholds": thresholds,
        "working_set_over_limit": (base + kv_per_worker) / limit,
        "completed": len(ok), "lost": workflows - len(ok), "hung": hung,
        "wrong": sum(1 for i, r in ok.items() if ref[i] != r["tokens"]) if not hung else None,  # None: not checked
        "errors": sorted({r["error"] for r in records.values() if "error" in r})[:5],
        "wall_s": wall, "latency_s": [round(r["latency_s"], 2) for r in records.values()],
        "peak_rss_over_limit": max((w["rss"] / limit for s in samples for w in s["workers"].values()), default=0.0),
        "peak_spilled_disk_bytes": max((sum(w["spilled_disk"] for w in s["workers"].values()) for s in samples),
                                       default=0),
        "spilled_disk_bytes_total": spilled_total,  # written to disk over the run, read back or not
        "pause_episodes": pauses,
        "paused_samples": sum(1 for s in samples for w in s["workers"].values() if w["status"] == "paused"),
        "samples": len(samples),
        "kv_counters": {k: tiers.get(k, 0) for k in ("lineage_recomputes", "evictions", "tokens_computed",
                                                     "tokens_reused")},
    }
