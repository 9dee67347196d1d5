"""Issue 55: agents that call tools and decide what comes next, under a binding KV budget.

Two parts, on one local cluster (2 worker processes, SmolLM2 by default):

stream     ``bench.agent_tools``: a Poisson stream of ReAct agents (two tools: a calculator
           and BM25 search over the shipped corpus), debates until agreement and pruned trees
           of thought over shared documents; every tool call waits an EMULATED latency drawn
           from [0.5, 5] s. text replay, ``local`` (per-worker prefix caching) and daskflow-kv,
           --reps times each in alternating order, every one under the same per-worker KV
           budget. Targets: daskflow-kv's mean workflow latency <= 0.6x local's, tokens
           prefilled <= 0.5x text replay's, every agent's tokens equal to text replay's.
decisions  ``bench.kv_wait_trials``: per tool call, keep / spill / drop each measured from the
           same start, and the cost model's choice scored against the best (target: right in
           >= 90 % of calls).

    python benchmarks/agent_tools.py --quick            # tiny-llama, a smoke run of both parts (~2 min)
    python benchmarks/agent_tools.py                    # the published run (smollm2)
    python benchmarks/agent_tools.py --part decisions   # one part only

Writes benchmarks/results/agent_tools[_TAG].json with the commit and the host.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json


def source_commit() -> dict:
    """The commit this run measured, and whether the tree had changes on top of it."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        return {"commit": None, "dirty": None}
    return {"commit": sha or None, "dirty": dirty}


def run(args) -> dict:
    from distributed import Client

    from daskflow_kv.bench import agent_tools as A
    from daskflow_kv.bench import kv_wait_trials as T
    from daskflow_kv.bench import systems as S
    from daskflow_kv.runtime.cluster import close_runtime, local_cluster
    from daskflow_kv.runtime.kv_runtime import KVRuntime
    from daskflow_kv.workflows.common import corpus_document

    logging.getLogger("daskflow_kv.scheduler").setLevel(logging.ERROR)
    store = tempfile.mkdtemp(prefix="daskflow-kv-agent-tools-")
    doc = {"benchmark": "agent_tools", "command": command_line(), "source": source_commit(), "machine": machine_info(),
           "model": args.model, "dtype": args.dtype, "workers": args.workers,
           "tool_latency": {"lo_s": args.latency[0], "hi_s": args.latency[1], "label": "EMULATED (sleep, seeded)"},
           "targets": {"latency": "dkv mean workflow latency <= 0.6x local's", "tokens": "dkv <= 0.5x text replay's",
                       "decisions": "right in >= 90 % of calls"}}
    t0 = time.time()
    with local_cluster(args.workers, 1, dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        # The store holds only what a waiting conversation spills (no write-through of contexts:
        # a context stored by one system's run would be another's hit)
        rt = KVRuntime(client, args.model, dtype=args.dtype, kv_store=f"file://{store}", kv_store_write="off")
        S.shorten_lease(client)
        doc["calibration"] = rt.calibrate(probe_tokens=args.context + 256)
        rt.calibrate_store()
        b = S.make_bench(rt, S.workers_of(client))
        doc["bytes_per_token"] = rt.facts.bytes_per_token
        log(f"cluster ready in {time.time() - t0:.0f}s")
        if args.part in ("both", "stream"):
            docs = [corpus_document(args.context, rt.tokenizer, start=5 * j) for j in range(args.docs)]
            doc["stream"] = {"n": args.n, "rate_per_min": args.rate, "docs": args.docs, "context": args.context,
                             "max_new_tokens": args.max_new, "tool_calls_per_react": args.calls,
                             "budget_fraction": args.budget_fraction, "reps": args.reps}
            doc["stream"] |= A.stream(b, args.n, args.rate, docs, args.max_new, args.calls, tuple(args.latency),
                                      args.reps, args.budget_fraction, log=log)
            doc["stream"]["summary"] = A.summary(doc["stream"]["rows"])
            log(f"stream: {doc['stream']['summary']}")
        if args.part in ("both", "decisions"):
            doc["decisions"] = T.trials(rt, args.sizes, waits_per=args.waits, wait_range=tuple(args.latency), log=log)
            log(f"decisions: right in {doc['decisions']['right']}/{doc['decisions']['calls']} calls")
        close_runtime(rt, cluster)
    doc["total_s"] = time.time() - t0
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--part", choices=("both", "stream", "decisions"), default="both")
    p.add_argument("--n", type=int, default=12, help="workflows per stream")
    p.add_argument("--rate", type=float, default=12.0, help="arrivals per minute")
    p.add_argument("--docs", type=int, default=3, help="shared documents")
    p.add_argument("--context", type=int, default=384, help="tokens per document")
    p.add_argument("--max-new", type=int, default=16, help="tokens each agent generates at most")
    p.add_argument("--calls", type=int, default=2, help="tool calls per ReAct agent")
    p.add_argument("--latency", type=float, nargs=2, default=[0.5, 5.0], help="tool latency range, s (EMULATED)")
    p.add_argument("--budget-fraction", type=float, default=0.25,
                   help="per-worker KV budget as a share of the stream's working set (at least one workflow)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512], help="conversation tokens per decision trial")
    p.add_argument("--waits", type=int, default=2, help="tool waits drawn per (size, regime)")
    p.add_argument("--quick", action="store_true", help="tiny-llama, short stream: a smoke run, not a measurement")
    p.add_argument("--tag", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.n, args.reps, args.rate, args.tag = "tiny-llama", 4, 1, 60.0, args.tag or "quick"
        args.sizes, args.waits, args.latency, args.context = [128], 1, [0.3, 0.8], 128
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    doc = run(args)
    out = Path(args.out) if args.out else RESULTS_DIR / f"agent_tools{'_' + args.tag if args.tag else ''}.json"
    write_json(out, doc)
    log(f"wrote {out}")
    exact = doc.get("stream", {}).get("summary", {}).get("all_exact", True)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
