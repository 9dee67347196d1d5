"""Exp 7 under a binding KV budget, daskflow-kv beside `local` given the same hard pool.

Budgets are fractions of the documents' KV per worker (never below the largest workflow
level alone); each (stream, budget) point runs ``--reps`` times with both systems side by
side, cold. See ``daskflow_kv/bench/kv_pressure.py`` for what each row records.

    python benchmarks/kv_pressure.py                      # SmolLM2, 2 workers, Zipf + uniform, 1/2 1/4 1/8, 3 reps
    python benchmarks/kv_pressure.py --streams zipf --fractions 0.25 --reps 1 --workflows 16   # a quick look

Writes benchmarks/results/kv_pressure.json (or --out) with every row and the paired summary.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from distributed import Client

from daskflow_kv import validation
from daskflow_kv.bench import kv_pressure as KP
from daskflow_kv.bench.common import RESULTS_DIR, command_line, log, machine_info, write_json


def main(argv=None) -> int:
    ap = validation.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", nargs="+", choices=["zipf", "uniform"], default=["zipf", "uniform"])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25, 0.125],
                    help="per-worker budgets, as fractions of the documents' KV")
    ap.add_argument("--workflows", type=int, default=48, help="workflows per stream (a rep lasts minutes)")
    ap.add_argument("--rate", type=float, default=60.0, help="offered workflows per minute")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--context", type=int, default=512, help="document tokens")
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "kv_pressure.json")
    ap.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                    help="no run: summarize these runs' rows together (parts of one grid run apart) into --out")
    args = ap.parse_args(argv)
    if args.combine:
        return combine(args.combine, args.out, argv)
    v = validation
    for f in args.fractions:
        v.number("--fractions", f, above=0)
    for name in ("workflows", "docs", "context", "max_new", "reps", "workers"):
        v.integer(f"--{name.replace('_', '-')}", getattr(args, name), minimum=1)
    v.number("--rate", args.rate, above=0)

    from daskflow_kv.bench import systems as S
    from daskflow_kv.bench.run import warm_up_systems
    from daskflow_kv.runtime.cluster import local_cluster
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    logging.getLogger("daskflow_kv.scheduler").setLevel(logging.ERROR)
    t0 = time.time()
    doc = {"command": command_line("python benchmarks/kv_pressure.py", argv), "machine": machine_info(),
           "config": {k: v for k, v in vars(args).items() if k != "out"}, "targets": KP.TARGETS}
    with local_cluster(args.workers, 1, memory_limit="8GiB", dashboard_address=None) as cluster, Client(cluster) as client:
        rt = KVRuntime(client, args.model, dtype="float32")
        S.shorten_lease(client)
        doc["calibration"] = rt.calibrate(probe_bytes=32 << 20, probe_tokens=min(args.context + 128,
                                                                                 rt.facts.max_positions - 16))
        b = S.make_bench(rt, S.workers_of(client))
        warm_up_systems(b, ["local", "dkv"], args.max_new)
        doc["model"] = {"name": args.model, "bytes_per_token": rt.facts.bytes_per_token}
        doc["runs"] = KP.run(b, args.streams, args.fractions, args.workflows, args.rate, args.docs, args.context,
                             args.max_new, args.reps)
    doc["summary"] = KP.summarize(doc["runs"])
    doc["total_s"] = time.time() - t0
    write_json(args.out, doc)
    log(KP.report(doc["summary"]))
    log(f"wrote {args.out}")
    return 0 if all(r["targets"]["exact"] and r["targets"]["failed"] for r in doc["summary"]) else 3


def combine(paths: list[Path], out: Path, argv) -> int:
    """One summary over several runs' rows (each part a point of the grid, run apart), every
    part from the same commit and host (``provenance.check``)."""
    import json

    from daskflow_kv.bench import provenance

    docs = [json.loads(p.read_text()) for p in paths]
    provenance.check([(str(p), d) for p, d in zip(paths, docs)])
    rows = [r for d in docs for r in d["runs"]]
    doc = {"command": command_line("python benchmarks/kv_pressure.py", argv), "machine": machine_info(),
           "parts": [str(p) for p in paths], "configs": [d["config"] for d in docs], "targets": KP.TARGETS,
           "runs": rows, "summary": KP.summarize(rows)}
    write_json(out, doc)
    log(KP.report(doc["summary"]))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
