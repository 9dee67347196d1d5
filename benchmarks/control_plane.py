"""What one workflow costs the scheduler and the client, apart from the model (measured).

The simulator charges Dask one 14 ms hop per task and the scheduler nothing else, so it
cannot say where one scheduler stops keeping up. This measures it: a cluster in a process of
its own (so the scheduler's CPU is told apart from the client's), the tiny model (so the
forward passes cost next to nothing and the control plane is most of the work), and clients
that keep ``--concurrency`` workflows in flight each, drawn from a pool of RAG and debate
workflows over shared documents (``load_stream.build``). Per worker count and mode, over the
stream: the scheduler process's CPU seconds, this process's (the clients': compile, plan,
submit, gather), the workers', the scheduler's task transitions and the ``kv_*`` RPCs the plugin
answered (by name, counted where they enter: ``bench.control_budget``), each per workflow.

* ``state``: daskflow-kv (KV blocks as Dask keys, lookups, plans, the scheduler plugin);
* ``text``: the same workflows as text, each agent one Dask task with no KV kept: Dask's own
  cost for the same calls, the floor under ``state``.

Every state-mode output is checked against the pool's text replay (exact, or the run says so).

    python benchmarks/control_plane.py --workers 2 4 8 --out benchmarks/results/control_plane.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path

from daskflow_kv.bench import cluster_process
from daskflow_kv.bench.chaos import agent_tokens, run_flow
from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json
from daskflow_kv.bench.load_stream import Arrival, build, doc_sequence, documents
from daskflow_kv.bench import process_load
from daskflow_kv.bench.control_budget import rpc_calls, rpc_spent


def stream(runtimes, pool, ref, mode: str, workflows: int, concurrency: int, seed: int) -> dict:
    """``workflows`` runs from ``pool``, ``concurrency`` in flight per runtime; -> the records."""
    records, lock, issued = [], threading.Lock(), [0]

    def drain(c: int, j: int) -> None:
        r = random.Random(seed * 1000 + c * 100 + j)
        while True:
            with lock:
                if issued[0] >= workflows:
                    return
                issued[0] += 1
            i = r.randrange(len(pool))
            t = time.perf_counter()
            try:
                out = agent_tokens(run_flow(runtimes[c], pool[i], mode))
                rec = {"latency_s": time.perf_counter() - t, "agree": out == ref[i]}
            except Exception as e:  # noqa: BLE001 -- recorded: a lost workflow
                rec = {"latency_s": time.perf_counter() - t, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=drain, args=(c, j), daemon=True)
               for c in range(len(runtimes)) for j in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return records


def measure(workers: int, args) -> list[dict]:
    from distributed import Client

    from daskflow_kv.runtime.kv_runtime import KVRuntime

    proc, address = cluster_process.start(workers, log=log)
    try:
        clients = [Client(address) for _ in range(args.clients)]
        runtimes = [KVRuntime(c, "tiny-llama") for c in clients]
        rt = runtimes[0]
        docs = max(2, 2 * workers)  # two documents a worker, as the simulator's grid
        texts = documents(rt.tokenizer, docs, args.context)
        of = doc_sequence(args.pool, docs, "zipf", seed=args.seed)
        salt = f"cp-{workers}-{random.Random(args.seed).randrange(1 << 30)}"
        pool = [build(Arrival(i, 0.0, 0, of[i]), texts[of[i]], salt, args.max_new) for i in range(args.pool)]
        ref = [agent_tokens(run_flow(rt, wf, "text")) for wf in pool]  # the reference, and a warm-up of every worker
        agents = statistics.fmean(len(wf.agents) for wf in pool)
        rows = []
        for mode in args.modes:
            calls = rpc_calls(rt)
            before, t0 = process_load.snapshot(clients[0]), time.perf_counter()
            recs = stream(runtimes, pool, ref, mode, args.workflows, args.concurrency, args.seed)
            wall, load = time.perf_counter() - t0, process_load.delta(before, process_load.snapshot(clients[0]))
            ok = [r for r in recs if "error" not in r]
            rpcs = rpc_spent(rt, calls, len(ok))  # kv_* RPCs the plugin answered, by name
            n, cpu = len(ok), load["cpu_s"]  # the scheduler's apart: the cluster has a process of its own
            spent = {"scheduler": cpu["scheduler"], "client": cpu["client"], "workers": sum(cpu["workers"].values()),
                     "transitions": load["transitions"]["scheduler"]}
            per = {k: v / max(1, n) for k, v in spent.items()}
            row = {"workers": workers, "mode": mode, "workflows": len(recs), "completed": n,
                   "exact": all(r["agree"] for r in ok) and n == len(recs), "wrong": sum(not r["agree"] for r in ok),
                   "errors": sorted({r["error"] for r in recs if "error" in r})[:5], "agents_per_workflow": agents,
                   "wall_s": wall, "workflows_per_s": n / wall if wall else None,
                   "latency_median_s": statistics.median(r["latency_s"] for r in ok) if ok else None,
                   "scheduler_cpu_s_per_workflow": per["scheduler"], "client_cpu_s_per_workflow": per["client"],
                   "workers_cpu_s_per_workflow": per["workers"], "transitions_per_workflow": per["transitions"],
                   "rpc_per_workflow": rpcs, "rpc_total_per_workflow": sum(rpcs.values()),
                   "scheduler_busy": spent["scheduler"] / wall if wall else None,
                   # one scheduler process can take at most this many such workflows a second
                   "scheduler_bound_workflows_per_s": 1 / per["scheduler"] if per["scheduler"] else None}
            rows.append(row)
            log(f"{workers} workers, {mode}: {n}/{len(recs)} in {wall:.1f} s ({row['workflows_per_s']:.1f}/s), "
                f"scheduler {1000 * per['scheduler']:.0f} ms, client {1000 * per['client']:.0f} ms, "
                f"{per['transitions']:.0f} transitions, {sum(rpcs.values()):.1f} kv RPCs a workflow; scheduler busy {row['scheduler_busy']:.0%}"
                + ("" if row["exact"] else f"; NOT EXACT: {row['wrong']} wrong, {len(recs) - n} failed"))
        for c in clients:
            c.close()
        return rows
    finally:
        cluster_process.end(proc)


def scheduler_check(rows: list[dict], grid_path: Path) -> list[dict]:
    """The simulator's daskflow-kv rows (MODELED) against one scheduler process: the cores of
    scheduler CPU their throughput would take at the measured cost per workflow (the range
    over the worker counts measured here). Above 1, one scheduler cannot drive that rate."""
    import json

    costs = [r["scheduler_cpu_s_per_workflow"] for r in rows if r["mode"] == "state" and r["completed"]]
    if not costs or not grid_path.exists():
        return []
    by_point: dict[tuple, list[float]] = {}
    for g in json.loads(grid_path.read_text())["grid"]:
        if g["system"] == "daskflow-kv":
            by_point.setdefault((g["workers"], g["stream"]), []).append(g["completed_per_min"] / 60)
    out = []
    for (w, stream), rates in sorted(by_point.items()):
        rate = statistics.median(rates)
        out.append({"label": "MODELED rate x measured cost", "workers": w, "stream": stream,
                    "workflows_per_s": rate, "scheduler_cores": [rate * min(costs), rate * max(costs)],
                    "one_scheduler_keeps_up": rate * max(costs) <= 1.0})
    return out


def _relative(v):
    """A path as the repository names it (results carry no machine's absolute paths)."""
    if isinstance(v, Path) and v.is_absolute():
        try:
            return str(v.relative_to(Path.cwd()))
        except ValueError:
            return str(v)
    return str(v) if isinstance(v, Path) else v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--modes", nargs="+", choices=["state", "text"], default=["text", "state"])
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4, help="workflows in flight per client")
    ap.add_argument("--workflows", type=int, default=120, help="workflows per worker count and mode")
    ap.add_argument("--pool", type=int, default=24, help="distinct workflows the stream draws from")
    ap.add_argument("--context", type=int, default=256, help="document tokens")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--grid", type=Path, default=RESULTS_DIR / "simulation.json",
                    help="the simulator's grid whose daskflow-kv rates are held against one scheduler")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "control_plane.json")
    args = ap.parse_args(argv)
    rows = [r for w in args.workers for r in measure(w, args)]
    doc = {"label": "measured", "command": command_line("python benchmarks/control_plane.py", argv),
           "machine": machine_info(),
           "model": "tiny-llama", "config": {k: _relative(v) for k, v in vars(args).items() if k != "out"}, "rows": rows,
           "exact": all(r["exact"] for r in rows if r["mode"] == "state"),
           "scheduler_check": scheduler_check(rows, args.grid)}
    for c in doc["scheduler_check"]:
        lo, hi = c["scheduler_cores"]
        log(f"grid {c['workers']:>3} workers {c['stream']:<12} {c['workflows_per_s']:6.1f} workflows/s MODELED: "
            f"{lo:.2f}-{hi:.2f} scheduler cores" + ("" if c["one_scheduler_keeps_up"] else "  (more than one)"))
    write_json(args.out, doc)
    log(f"wrote {args.out}")
    return 0 if doc["exact"] else 3


if __name__ == "__main__":
    raise SystemExit(main())
