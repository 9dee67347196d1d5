"""What the workflow gate did in an exp 7 run with ``--exp7-gates``: each system behind the
gate against itself without it, repetition by repetition (the same arrivals, side by side),
and the daskflow-kv / ``local`` ratio with and without it; beside it what the simulator
predicted for the same rows (MODELED, the bench's ``exp7_modeled``), where the run has it.

``python -m daskflow_kv.bench.gate_effect benchmarks/results/bench_X.json [--out F.md]``
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METRICS = (("completed_per_min", "workflows/min"), ("latency_p95_s", "p95 s"), ("tokens_prefilled", "tokens"))
NAMES = {"dkv": "daskflow-kv"}


def _by_cell(rows) -> dict:
    """(stream, system, gate, rep) -> row."""
    return {(r["stream"], NAMES.get(r["system"], r["system"]), r.get("workflow_gate"), r.get("rep", 0)): r
            for r in rows}


def _span(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def effect(measured: list[dict], modeled: list[dict] | None = None) -> list[dict]:
    """Per stream and system: each metric's gated / ungated ratio over the repetitions
    (measured, and MODELED where ``modeled`` rows are given), and the medians of each."""
    cells = _by_cell(measured)
    sims = {k: {m: r[m]["simulated"] for m, _ in METRICS} for k, r in _by_cell(modeled or []).items()}
    gates = sorted({k[2] for k in cells if k[2] is not None})
    out = []
    for stream in sorted({k[0] for k in cells}):
        for system in sorted({k[1] for k in cells}):
            for gate in gates:
                reps = sorted(k[3] for k in cells if k[:3] == (stream, system, gate) and (stream, system, None, k[3])
                              in cells)
                if not reps:
                    continue
                row = {"stream": stream, "system": system, "gate": gate, "reps": len(reps)}
                for m, _ in METRICS:
                    on = [cells[(stream, system, gate, r)][m] for r in reps]
                    off = [cells[(stream, system, None, r)][m] for r in reps]
                    row[m] = {"gated": _span(on), "ungated": _span(off),
                              "ratio": _span([a / b for a, b in zip(on, off) if b])}
                    pairs = [(sims[(stream, system, gate, r)][m], sims[(stream, system, None, r)][m]) for r in reps
                             if (stream, system, gate, r) in sims and (stream, system, None, r) in sims]
                    if pairs:
                        row[m]["modeled_ratio"] = _span([a / b for a, b in pairs if b])
                out.append(row)
    return out


def ratios(measured: list[dict], a: str = "daskflow-kv", b: str = "local") -> list[dict]:
    """Per stream and gate (None: none): ``a``'s throughput over ``b``'s, repetition by repetition."""
    cells = _by_cell(measured)
    out = []
    for stream, gate in sorted({(k[0], k[2]) for k in cells}, key=str):
        reps = sorted(k[3] for k in cells if k[0] == stream and k[1] == a and k[2] == gate
                      and (stream, b, gate, k[3]) in cells)
        vals = [cells[(stream, a, gate, r)]["completed_per_min"] / cells[(stream, b, gate, r)]["completed_per_min"]
                for r in reps]
        if vals:
            out.append({"stream": stream, "gate": gate, "throughput_ratio": _span(vals)})
    return out


def _fmt(s: dict, f: str = "{:.2f}") -> str:
    return f"{f.format(s['median'])} [{f.format(s['min'])}-{f.format(s['max'])}]"


def markdown(doc: dict) -> str:
    runs = [r for r in doc.get("runs", []) if r.get("exp") == "exp7"]
    modeled = (doc.get("exp7_modeled") or {}).get("rows")
    rows = effect(runs, modeled)
    lines = ["| stream | system | gate / worker | " + " | ".join(f"{n}: gated / ungated (MODELED)" for _, n in METRICS)
             + " | p95 s gated vs ungated |", "|---|---|---|" + "---|" * (len(METRICS) + 1)]
    for r in rows:
        cells = [_fmt(r[m]["ratio"]) + (f" ({_fmt(r[m]['modeled_ratio'])})" if "modeled_ratio" in r[m] else "")
                 for m, _ in METRICS]
        p95 = r["latency_p95_s"]
        lines.append(f"| {r['stream']} | {r['system']} | {r['gate']:g} | " + " | ".join(cells)
                     + f" | {p95['gated']['median']:.1f} vs {p95['ungated']['median']:.1f} |")
    lines += ["", "| stream | gate / worker | daskflow-kv / `local` throughput |", "|---|---|---|"]
    for r in ratios(runs):
        gate = "none" if r["gate"] is None else f"{r['gate']:g}"
        lines.append(f"| {r['stream']} | {gate} | {_fmt(r['throughput_ratio'])} |")
    return "\n".join(["Median [min-max] over the repetitions, each gated row over the same repetition's "
                      "ungated row (the same arrivals, run side by side).", ""] + lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m daskflow_kv.bench.gate_effect", description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--out", help="write the table here too")
    args = ap.parse_args(argv)
    text = markdown(json.loads(Path(args.bench_json).read_text()))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
