"""Exp 7's daskflow-kv rows before and after a runtime change, read side by side by gate.

Made for the rebuild of evicted blocks (2026-12-06: a block Dask keeps only as released
lineage is prefilled again, planned, under a fresh key, where Dask used to rerun the whole
task that first made it). The two commits ran alternated on one host, so the host's drift
falls on both. Per run and workflow gate: throughput, p95 latency, the prompt tokens its
workers computed and those its workflows counted, blocks Dask made again from lineage, and
whether every output was exact; then each metric's median over the runs of each side. The
runs of one side must share a commit, and every run the host, unless ``--across-commits`` /
``--across-hosts`` (runs made before results recorded their commit need the first).

    python benchmarks/rebuild_ab.py --old benchmarks/results/archive/bench_rebuild_old_{1,2,3}.json \\
        --new benchmarks/results/bench_rebuild_new_{1,2,3}.json --across-commits \\
        --out benchmarks/results/rebuild_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from daskflow_kv.bench import provenance

METRICS = ("completed_per_min", "latency_p95_s", "tokens_prefilled", "tokens_counted", "lineage_recomputes")


def rows_of(path: Path, doc: dict) -> list[dict]:
    """The daskflow-kv exp 7 rows of one run, the metrics and what tells them apart."""
    out = []
    for r in doc["runs"]:
        if r.get("exp") == "exp7" and r["system"] == "dkv":
            out.append({"file": path.name, "cpu": doc["machine"]["cpu"], "stream": r["stream"], "rate": r["rate"],
                        "gate": r.get("workflow_gate"), "completed": r["completed"], "workflows": r["workflows"],
                        "exact": r.get("agree"), "rule": r.get("released_blocks", "lineage rerun"),
                        **{m: r.get(m) for m in METRICS}})
    return out


def medians(rows: list[dict]) -> dict:
    """Per gate: each metric's median and range over ``rows``."""
    out = {}
    for gate in sorted({r["gate"] for r in rows}, key=lambda g: (g is not None, g or 0)):
        mine = [r for r in rows if r["gate"] == gate]
        out[str(gate)] = {m: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                          for m in METRICS if (v := [r[m] for r in mine if r[m] is not None])}
        out[str(gate)]["runs"] = len(mine)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", nargs="+", type=Path, required=True, help="bench JSONs of the code before")
    p.add_argument("--new", nargs="+", type=Path, required=True, help="bench JSONs of the code after")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--across-commits", action="store_true", help="pool runs of different commits within a side")
    p.add_argument("--across-hosts", action="store_true", help="compare runs made on different hosts")
    args = p.parse_args(argv)
    for f in args.old + args.new:
        if not f.is_file():
            p.error(f"{f}: no such file")
    docs = {f: json.loads(f.read_text()) for f in args.old + args.new}
    try:
        for files in (args.old, args.new):  # each side one commit; every run one host
            provenance.check([(f.name, docs[f]) for f in files], args.across_commits, across_hosts=True)
        provenance.check([(f.name, d) for f, d in docs.items()], across_commits=True, across_hosts=args.across_hosts)
    except provenance.IncomparableResults as e:
        p.error(str(e))
    sides = {side: [r for f in files for r in rows_of(f, docs[f])] for side, files in (("old", args.old), ("new", args.new))}
    doc = {"runs": sides, "medians": {side: medians(rows) for side, rows in sides.items()}}
    args.out.write_text(json.dumps(provenance.stamp(doc), indent=1) + "\n")
    for side, rows in sides.items():
        for r in rows:
            print(f"{side} {r['file']:28s} gate {str(r['gate']):5s} {r['completed_per_min']:5.1f}/min "
                  f"p95 {r['latency_p95_s']:5.1f} s  computed {r['tokens_prefilled']:6d} counted {r['tokens_counted']} "
                  f"lineage {r['lineage_recomputes']} exact {r['exact']}")
    for side, by_gate in doc["medians"].items():
        for gate, m in by_gate.items():
            print(f"{side} gate {gate:5s} medians of {m['runs']}: " + ", ".join(
                f"{name} {v['median']:.1f} [{v['min']:.1f}-{v['max']:.1f}]" for name, v in m.items() if name != "runs"))


if __name__ == "__main__":
    main()
