"""Where a warm daskflow-kv agent's time to first token goes, against an in-process Engine.

Warm = the shared context is already cached on the cluster (an earlier workflow over the
same prefix with other questions: ``Workload.primer``, as ``bench --warm`` does). One
fan-out of k agents is then run exactly as the bench's ``dkv`` system runs it
(``materialize`` -> ``fork`` -> ``resume_many``), with every client-side step timed:

  materialize      lookup RPC (+ acquire of a cut tail block) + register RPC
  fork             register RPC
  plan             snapshot RPC (cluster view, prefill profiles fitted on the scheduler),
                   lookup RPC, placement, until the compute task is submitted
  dispatch         submitted -> the task starts computing on its worker (scheduler
                   transition, worker receives it, dependencies in place; from the task stream)
  worker           task start -> first token: prefix blocks copied into the batch cache
                   (load), batched suffix prefill, first sample
and, for reference, the same shapes resumed by an in-process ``Engine`` on the same worker
over a prefix already in its memory (load + prefill only). Clocks: ``time.time()`` on one host.

    python benchmarks/warm_ttft.py --model tiny-llama --context 1024 --agents 4 --reps 5
    python benchmarks/warm_ttft.py --model smollm2 --context 1500 --agents 4 --reps 3

Writes benchmarks/results/warm_ttft_<model>.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from daskflow_kv.bench import local_engine as le
from daskflow_kv.bench import systems as S
from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json
from daskflow_kv.bench.workload import build_workload
from daskflow_kv.runtime.plugin_client import PluginClient
from daskflow_kv.runtime.submit import Submitter


class Clock:
    """Client-side timestamps of one run: RPCs and compute-task submissions (every runtime's,
    while it is open: it wraps the parts' classes)."""

    def __init__(self):
        self.marks, self.rpcs = [], []
        self._call, self._compute = PluginClient.call, Submitter.compute
        call, compute = self._call, self._compute

        def timed_call(plugin, name, **kw):
            t = time.time()
            out = call(plugin, name, **kw)
            self.rpcs.append((name, t, time.time()))
            return out

        def timed_compute(submitter, task):
            fut = compute(submitter, task)
            self.marks.append(("submitted", task.key, time.time()))
            return fut

        PluginClient.call, Submitter.compute = timed_call, timed_compute

    def close(self):
        PluginClient.call, Submitter.compute = self._call, self._compute


def _starts(client, since: float) -> list[float]:
    """Worker wall clock when each resume task began (its prefill event: done_at - task_seconds;
    the task stream's times are shifted by the scheduler's estimate of each worker's clock)."""
    evs = S.prefill_events(client, since)
    return [e["done_at"] - e["task_seconds"] for e in evs if e["op"] == "resume"]


def one(b: S.Bench, wl) -> dict:
    rt = b.rt
    S.reset_caches(b)
    S.prime(b, "dkv", wl)
    clock = Clock()
    try:
        t0 = time.time()
        prefix = rt.materialize(wl.prefix)
        t_mat = time.time()
        branches = rt.fork(prefix, wl.agents)
        t_fork = time.time()
        gens = rt.resume_many(list(zip(branches, wl.suffixes)), wl.max_new_tokens)
        t_end = time.time()
    finally:
        clock.close()
    subs = [(k, t) for what, k, t in clock.marks]
    starts = _starts(rt.client, t0)
    firsts = [g.metrics["first_token_at"] for g in gens]
    out = {"agents": wl.agents, "prefix_tokens": len(wl.prefix), "workers": sorted({g.worker for g in gens}),
           "decisions": sorted({g.placement.action for g in gens}),
           "ttft_mean_s": statistics.fmean(f - t0 for f in firsts), "wall_s": t_end - t0,
           "materialize_s": t_mat - t0, "fork_s": t_fork - t_mat,
           "rpcs": [(n, s - t0, e - s) for n, s, e in clock.rpcs]}
    out["tasks"] = {"submitted_s": [t - t0 for _, t in subs], "started_s": [s - t0 for s in starts]}
    sub0 = min(t for _, t in subs) if subs else t_fork
    start0 = min(starts, default=None)
    m = gens[0].metrics
    out["phases"] = {
        "materialize": t_mat - t0, "fork": t_fork - t_mat, "plan_to_submit": sub0 - t_fork,
        "dispatch": None if start0 is None else start0 - sub0,
        "worker_to_first_token": None if start0 is None else min(firsts) - start0,
        "of_which_load": m["load_s"], "of_which_prefill": m["prefill_s"],
    }
    out["rpc_s"] = sum(e - s for _, s, e in clock.rpcs if s < min(firsts))
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(gens):
        groups.setdefault(g.worker, []).append(i)
    refs = [b.client.submit(le.engine_reference, rt.spec, wl.prefix, [wl.suffixes[i] for i in idxs],
                            wl.max_new_tokens, workers=[w], allow_other_workers=False, pure=False)
            for w, idxs in groups.items()]
    ref = b.client.gather(refs)
    out["engine"] = {"ttft_mean_s": statistics.fmean(t for r in ref for t in r["ttfts"]),
                     "load_s": statistics.fmean(r["load_s"] for r in ref),
                     "prefill_s": statistics.fmean(r["prefill_s"] for r in ref)}
    for g in gens:
        rt.release(g.state)
    for br in branches:
        rt.release(br)
    rt.release(prefix)
    return out


def main(argv=None) -> int:
    from distributed import Client

    from daskflow_kv.runtime.cluster import local_cluster
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    doc = {"command": command_line("python benchmarks/warm_ttft.py", argv), "machine": machine_info(), "runs": []}
    with local_cluster(2, 1, memory_limit="8GiB", dashboard_address=None) as cluster, Client(cluster) as client:
        rt = KVRuntime(client, args.model)
        S.shorten_lease(client)
        rt.calibrate(probe_bytes=8 << 20, probe_tokens=args.context)
        b = S.make_bench(rt, S.workers_of(client))
        warm = build_workload(rt.tokenizer, 128, args.agents, 2, "warmup", rt.facts.max_positions)
        one(b, warm)  # code paths, connections, kernels
        for rep in range(args.reps):
            wl = build_workload(rt.tokenizer, args.context, args.agents, args.max_new_tokens, f"wt{rep}-{time.time()}",
                                rt.facts.max_positions)
            r = one(b, wl)
            doc["runs"].append(r)
            ph = r["phases"]
            log(f"rep {rep}: dkv warm TTFT {r['ttft_mean_s'] * 1e3:.1f} ms vs Engine {r['engine']['ttft_mean_s'] * 1e3:.1f} ms"
                f" ({r['ttft_mean_s'] / r['engine']['ttft_mean_s']:.2f}x) on {len(r['workers'])} worker(s) "
                f"{r['decisions']}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ph.items() if v is not None)
                + f"; RPCs before the first token {r['rpc_s'] * 1e3:.1f} ms ("
                + ", ".join(f"{n} {d * 1e3:.1f}" for n, _, d in r["rpcs"]) + ")")
    keys = doc["runs"][0]["phases"].keys() if doc["runs"] else []
    doc["median"] = {k: statistics.median(r["phases"][k] for r in doc["runs"] if r["phases"][k] is not None)
                     for k in keys}
    doc["median"]["ttft_mean_s"] = statistics.median(r["ttft_mean_s"] for r in doc["runs"])
    doc["median"]["engine_ttft_mean_s"] = statistics.median(r["engine"]["ttft_mean_s"] for r in doc["runs"])
    out = Path(args.out) if args.out else RESULTS_DIR / f"warm_ttft_{args.model}.json"
    write_json(out, doc)
    log("median: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in doc["median"].items()) + f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
