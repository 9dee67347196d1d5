"""Exp 7 runs read side by side: host, ratio per stream and rep, and what decode steps cost.

A headline re-made on another day moved (2026-12-06: daskflow-kv 9-15 % slower than on
2026-12-05, `local` within 5 %). Two things can move it: the code since, or the host. This
reads bench JSONs that recorded their steps (``DASKFLOW_KV_BENCH_STEP_SHAPES=1``) and puts,
per run, the CPU it ran on, daskflow-kv over `local` per stream and rep, daskflow-kv's tokens
prefilled and rebuild decisions (``recompute``), and the median decode-only step (no prompt,
no join, no exit, nothing loaded) by decode rows, per system. Decode is the same work in both
systems, so a host whose decode steps are slower shrinks the ratio; an A/B of two commits
on one host, alternated, tells the code apart from the host. Runs of different commits or
hosts are refused (one line) unless ``--across-commits`` / ``--across-hosts`` says the
comparison is meant (an A/B of two commits is).

    python benchmarks/exp7_ab.py benchmarks/results/archive/bench_ab_{old,new}_{1,2}.json \\
        --across-commits --out benchmarks/results/exp7_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from daskflow_kv.bench import provenance
from daskflow_kv.sim.step_cost import row_steps

BUCKETS = ((1, 2), (3, 5), (6, 8), (9, 10**6))  # decode rows of a step, grouped


def _bucket(rows: int) -> str:
    lo, hi = next(b for b in BUCKETS if b[0] <= rows <= b[1])
    return f"{lo}+" if hi >= 10**6 else f"{lo}-{hi}"


def decode_only_steps(row: dict) -> dict[str, list[float]]:
    """Seconds of the row's decode-only steps, by decode rows (every worker's together)."""
    out = defaultdict(list)
    for steps in row_steps(row).values():
        for s in steps:
            if not (s["prompt_rows"] or s["joined"] or s["finished"] or s["loaded_tokens"]) and s["decode_rows"]:
                out[_bucket(s["decode_rows"])].append(s["seconds"])
    return out


def read_run(path: Path, doc: dict | None = None) -> dict:
    doc = doc if doc is not None else json.loads(path.read_text())
    rows = [r for r in doc["runs"] if r.get("exp") == "exp7"]
    by = {(r["stream"], r["rep"], r["system"]): r for r in rows}
    reps = []
    for (stream, rep, system), r in sorted(by.items()):
        other = by.get((stream, rep, "local"))
        if system != "dkv" or other is None:
            continue
        reps.append({"stream": stream, "rep": rep, "ratio": round(r["completed_per_min"] / other["completed_per_min"], 3),
                     "dkv_per_min": round(r["completed_per_min"], 2), "local_per_min": round(other["completed_per_min"], 2),
                     "dkv_tokens": r["tokens_prefilled"], "dkv_recomputes": (r.get("decisions") or {}).get("recompute", 0)})
    steps = defaultdict(list)
    for r in rows:
        for bucket, secs in decode_only_steps(r).items():
            steps[(r["system"], bucket)] += secs
    return {"file": path.name, "command": doc.get("command"), "cpu": doc["machine"]["cpu"], "reps": reps,
            "decode_only_step_ms": {f"{sys_} {b}": {"median": round(1000 * statistics.median(v), 1), "steps": len(v)}
                                    for (sys_, b), v in sorted(steps.items()) if len(v) >= 5}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench JSONs with exp 7 rows")
    ap.add_argument("--out", type=Path, help="write the table as JSON here")
    ap.add_argument("--across-commits", action="store_true", help="compare runs of different commits (an A/B)")
    ap.add_argument("--across-hosts", action="store_true", help="compare runs made on different hosts")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.runs if not p.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    docs = {p: json.loads(p.read_text()) for p in args.runs}
    try:
        provenance.check([(p.name, d) for p, d in docs.items()], args.across_commits, args.across_hosts)
    except provenance.IncomparableResults as e:
        ap.error(str(e))
    out = [read_run(p, d) for p, d in docs.items()]
    for run in out:
        print(f"{run['file']}  ({run['cpu']})")
        for r in run["reps"]:
            print(f"  {r['stream']:12} rep {r['rep']}: {r['ratio']:.2f}x  ({r['dkv_per_min']} vs {r['local_per_min']}/min; "
                  f"dkv {r['dkv_tokens']} tokens, {r['dkv_recomputes']} rebuilds)")
        print("  decode-only steps, ms (median):",
              ", ".join(f"{k} {v['median']:.0f}" for k, v in run["decode_only_step_ms"].items()))
    if args.out:
        args.out.write_text(json.dumps(provenance.stamp({"command": "python benchmarks/exp7_ab.py " + " ".join(
            f"benchmarks/results/{p.name}" for p in args.runs), "runs": out}), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
