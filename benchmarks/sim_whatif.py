"""What would lift daskflow-kv's lead over `local` at 32 workers (MODELED): knobs swept.

Issue 25 asks, where the modeled ratio on the Zipf stream under a budget falls short of 2x,
which term limits it and what would lift it. Two sweeps, on five draws of the stream a point,
both systems on the same draws:

* the workflow gate (running workflows a worker) at 36 and 72 workflows/min a worker, with
  the ratio of each system at its *own* best gate (``sim.whatif.each_at_its_best``): a shared
  gate flatters whichever system it suits;
* the workload's shape behind gate 4 at 36/min: the document's length (``--context``) and the
  tokens each agent decodes (``--max-new``), which set how much of the work the shared tier
  can save (the documents' prefill) against what it cannot (every agent's decode and its own
  text).

    python benchmarks/sim_whatif.py --out benchmarks/results/simulation_32w_whatif

Each point is what ``daskflow-kv simulate --workers 32 --streams zipf-budget --systems
daskflow-kv local --no-fidelity --seeds 5`` gives with the point's flags (its ``flags``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from daskflow_kv.bench import provenance
from daskflow_kv.sim import fitted_profile, simulate_grid
from daskflow_kv.sim.report import ratios
from daskflow_kv.sim.whatif import each_at_its_best

SYSTEMS = ("daskflow-kv", "local")
GATES = (2, 3, 4, 5, 6, 8, 10, 12, 16)
RATES = (36.0, 72.0)
CONTEXTS = (512, 1024, 2048, 4096)
MAX_NEW = (4, 8, 16, 32)
ROW_KEYS = ("system", "seed", "completed_per_min", "latency_p95_s", "tokens_prefilled", "evictions", "transfers")


def point(profile, workers: int, seeds: int, rate: float, gate: float, context: int = 1024, max_new: int = 16) -> dict:
    rows = simulate_grid(profile, [workers], SYSTEMS, ["zipf-budget"], rate_per_worker=rate, gate=gate,
                         context=context, max_new=max_new, seeds=seeds)
    [r] = ratios(rows)
    med = {s: statistics.median(x["completed_per_min"] for x in rows if x["system"] == s) for s in SYSTEMS}
    p95 = {s: statistics.median(x["latency_p95_s"] for x in rows if x["system"] == s) for s in SYSTEMS}
    tokens = {s: statistics.median(x["tokens_prefilled"] for x in rows if x["system"] == s) for s in SYSTEMS}
    flags = f"--rate-per-worker {rate:g} --workflow-gate {gate:g} --context {context} --max-new {max_new}"
    print(f"{flags}: {_ratio(r)} "
          f"daskflow-kv {med['daskflow-kv']:.0f}/min, local {med['local']:.0f}/min MODELED",
          file=sys.stderr, flush=True)
    return {"flags": flags, "rate_per_worker": rate, "gate": gate, "context": context, "max_new": max_new,
            "ratio": r, "completed_per_min": med, "latency_p95_s": p95, "tokens_prefilled": tokens,
            "rows": [{k: x.get(k) for k in ROW_KEYS} for x in rows]}


def _ratio(r: dict) -> str:
    """A ratio as its median with the range over the draws (one draw: no range)."""
    lo, hi = r.get("throughput_ratio_min"), r.get("throughput_ratio_max")
    return f"{r['throughput_ratio']:.2f}x" + ("" if lo is None else f" [{lo:.2f}-{hi:.2f}]")


def markdown(result: dict) -> str:
    lines = ["# What would lift the ratio at 32 workers (MODELED)", "",
             f"From `{result['command']}` ({result['date']}); profile: {result['profile']}. Zipf stream under the "
             f"budget, {result['workers']} workers, {result['seeds']} draws a point, both systems on the same draws. "
             "Every figure is MODELED.", "",
             "## The workflow gate", "",
             "| offered per worker | gate | daskflow-kv / `local`, median [range] | daskflow-kv /min | `local` /min |",
             "|---|---|---|---|---|"]
    for p in result["gate_sweep"]:
        r = p["ratio"]
        lines.append(f"| {p['rate_per_worker']:g}/min | {p['gate']:g} | {_ratio(r)} | "
                     f"{p['completed_per_min']['daskflow-kv']:.0f} | {p['completed_per_min']['local']:.0f} |")
    lines += ["", "Each system at its own best gate (best median throughput over the draws), draw by draw:", "",
              "| offered per worker | daskflow-kv's best gate | `local`'s best gate | ratio, median [range] |",
              "|---|---|---|---|"]
    for b in result["best_gates"]:
        lines.append(f"| {b['rate_per_worker']:g}/min | {b['best']['daskflow-kv']:g} "
                     f"({b['throughput']['daskflow-kv']:.0f}/min) | {b['best']['local']:g} "
                     f"({b['throughput']['local']:.0f}/min) | **{_ratio(b)}** |")
    lines += ["", "## The workload's shape (gate 4, 36/min a worker)", "",
              "| document tokens | tokens decoded a call | daskflow-kv / `local`, median [range] | "
              "tokens prefilled, daskflow-kv / `local` |", "|---|---|---|---|"]
    for p in result["shape_sweep"]:
        r, t = p["ratio"], p["tokens_prefilled"]
        lines.append(f"| {p['context']} | {p['max_new']} | {_ratio(r)} | "
                     f"{t['daskflow-kv']:,.0f} / {t['local']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile-from", default="benchmarks/results/bench_full.json")
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/simulation_32w_whatif")
    args = ap.parse_args(argv)
    profile = fitted_profile(args.profile_from)
    t0 = time.perf_counter()
    gate_sweep, best = [], []
    for rate in RATES:
        points = {g: point(profile, args.workers, args.seeds, rate, g) for g in GATES}
        gate_sweep += points.values()
        best.append({"rate_per_worker": rate} | each_at_its_best({g: p["rows"] for g, p in points.items()}))
    shapes = [(c, 16) for c in CONTEXTS] + [(1024, m) for m in MAX_NEW if m != 16]
    shape_sweep = [point(profile, args.workers, args.seeds, 36.0, 4, c, m) for c, m in shapes]
    result = {"label": "MODELED", "command": "python benchmarks/sim_whatif.py " + " ".join(argv or sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "profile": profile.source, "workers": args.workers,
              "seeds": args.seeds, "gate_sweep": gate_sweep, "best_gates": best, "shape_sweep": shape_sweep,
              "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(provenance.stamp(result), indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')} in {result['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
