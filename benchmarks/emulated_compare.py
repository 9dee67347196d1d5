"""Exp 7 rows of emulated engines set beside others: the emulator's fidelity, and its scale runs.

    # item 2 of issue 53: the emulator against the real model, same flags, same host
    python benchmarks/emulated_compare.py fidelity benchmarks/results/bench_emu_fidelity_real.json \\
        benchmarks/results/bench_emu_fidelity_emulated.json --out benchmarks/results/emu_fidelity.json
    # item 3: dkv against local at each worker count (one bench JSON per count)
    python benchmarks/emulated_compare.py scale benchmarks/results/bench_emu_h100_w4.json ... \\
        --out benchmarks/results/emu_scale.json

Every figure is a median over the repetitions with its min-max spread; every ratio is of
medians. Figures are the bench rows' own (one definition each, ``bench.load``): throughput
``completed_per_min``, ``latency_p95_s``, ``tokens_prefilled``, ...; CPU seconds of the
client process (its scheduler inside it: ``LocalCluster``) and of the workers, from the rows'
``cpu_s``; the workers' step-loop busy seconds from ``step_busy_s``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from daskflow_kv.bench import provenance

FIGURES = ("completed_per_min", "tokens_prefilled", "latency_p95_s", "latency_p50_s", "ttft_mean_s",
           "bytes_transferred", "evictions", "failed")
TOLERANCE = 0.10  # item 2: the emulator within +-10 % of the real row


def _derived(r: dict) -> dict:
    """Per-row sums the rows keep by process: CPU of the client and the workers, step-loop busy seconds."""
    cpu = r.get("cpu_s") or {}
    workers = cpu.get("workers") or {}
    return {"client_cpu_s": cpu.get("client"), "scheduler_cpu_s": cpu.get("scheduler"),
            "workers_cpu_s": sum(workers.values()) if workers else None,
            "step_busy_s": sum((r.get("step_busy_s") or {}).values()), "wall_s": r.get("wall_s")}


def summarize(rows: list[dict]) -> dict:
    """{figure: {median, min, max, reps}} over ``rows`` (the reps of one system at one point)."""
    out = {}
    for name in FIGURES + ("client_cpu_s", "scheduler_cpu_s", "workers_cpu_s", "step_busy_s", "wall_s"):
        vals = [v for r in rows if (v := (r.get(name) if name in FIGURES else _derived(r)[name])) is not None]
        if vals:
            out[name] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "reps": len(vals)}
    return out


def points(doc: dict) -> dict[tuple, dict]:
    """{(stream, rate, system): summary} of a bench JSON's exp 7 rows."""
    by: dict[tuple, list] = {}
    for r in doc.get("runs") or ():
        if r.get("exp") == "exp7":
            by.setdefault((r["stream"], r["rate"], r["system"]), []).append(r)
    return {k: summarize(v) | {"agree": all(r.get("agree") for r in v)} for k, v in by.items()}


def _origin(path: Path, doc: dict) -> dict:
    prov = doc.get("provenance") or {}
    return {"file": str(path), "command": doc.get("command"), "commit": prov.get("commit"),
            "dirty_files": prov.get("dirty_files"), "host": prov.get("host"),
            "emulated": (doc.get("model") or {}).get("emulated", {}).get("label")}


def _ratio(a: dict, b: dict, name: str) -> float | None:
    x, y = a.get(name, {}).get("median"), b.get(name, {}).get("median")
    return x / y if x is not None and y else None


def fidelity(real_path: Path, emu_path: Path) -> dict:
    real, emu = json.loads(real_path.read_text()), json.loads(emu_path.read_text())
    rp, ep = points(real), points(emu)
    rows = []
    for key in sorted(set(rp) & set(ep)):
        ratios = {n: _ratio(ep[key], rp[key], n) for n in ("completed_per_min", "tokens_prefilled", "latency_p95_s",
                                                           "latency_p50_s", "ttft_mean_s", "step_busy_s",
                                                           "workers_cpu_s", "client_cpu_s")}
        within = {n: ratios[n] is not None and abs(ratios[n] - 1) <= TOLERANCE
                  for n in ("completed_per_min", "tokens_prefilled", "latency_p95_s")}
        rows.append({"stream": key[0], "rate": key[1], "system": key[2], "real": rp[key], "emulated": ep[key],
                     "emulated_over_real": ratios, "within_10pct": within})
    return {"what": "issue 53 item 2: exp 7 rows, emulated (cpu-smollm2) over real SmolLM2, medians of reps",
            "real": _origin(real_path, real), "emulated": _origin(emu_path, emu), "rows": rows}


def scale(paths: list[Path]) -> dict:
    out = []
    for path in paths:
        doc = json.loads(path.read_text())
        pts = points(doc)
        workers = (doc.get("config") or {}).get("workers")
        for (stream, rate, system), s in sorted(pts.items()):
            if system != "dkv" or (stream, rate, "local") not in pts:
                continue
            local = pts[(stream, rate, "local")]
            out.append({"workers": workers, "stream": stream, "rate": rate, "dkv": s, "local": local,
                        "dkv_over_local": {n: _ratio(s, local, n) for n in ("completed_per_min", "tokens_prefilled",
                                                                          "latency_p95_s", "latency_p50_s",
                                                                          "ttft_mean_s")},
                        "origin": _origin(path, doc)})
    return {"what": "issue 53 item 3: exp 7 on emulated workers, dkv beside local, medians of reps", "rows": out}


def _pct(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _cell(s: dict, name: str, fmt: str = "{:.1f}") -> str:
    f = s.get(name)
    if not f:
        return "-"
    return f"{fmt.format(f['median'])} ({fmt.format(f['min'])}-{fmt.format(f['max'])})"


def markdown(result: dict) -> str:
    lines = []
    for r in result["rows"]:
        if "real" in r:
            head = f"{r['system']} {r['stream']} {r['rate']:g}/min"
            for side in ("real", "emulated"):
                s = r[side]
                lines.append(f"| {head} | {side} | {_cell(s, 'completed_per_min')} | {_cell(s, 'tokens_prefilled', '{:.0f}')}"
                             f" | {_cell(s, 'latency_p95_s')} | {_cell(s, 'step_busy_s')} | {_cell(s, 'workers_cpu_s')} |")
            q = r["emulated_over_real"]
            lines.append(f"| {head} | emulated / real | {_pct(q['completed_per_min'])} | {_pct(q['tokens_prefilled'])}"
                         f" | {_pct(q['latency_p95_s'])} | {_pct(q['step_busy_s'])} | {_pct(q['workers_cpu_s'])} |")
        else:
            for side in ("local", "dkv"):
                s = r[side]
                lines.append(f"| {r['workers']} | {r['stream']} {r['rate']:g}/min | {side} | {_cell(s, 'completed_per_min')}"
                             f" | {_cell(s, 'latency_p50_s', '{:.2f}')} | {_cell(s, 'latency_p95_s', '{:.2f}')}"
                             f" | {_cell(s, 'ttft_mean_s', '{:.2f}')} | {_cell(s, 'tokens_prefilled', '{:.0f}')}"
                             f" | {_cell(s, 'bytes_transferred', '{:.0f}')} | {_cell(s, 'evictions', '{:.0f}')}"
                             f" | {_cell(s, 'failed', '{:.0f}')} | {_cell(s, 'client_cpu_s')} | {_cell(s, 'workers_cpu_s')} |")
            q = r["dkv_over_local"]
            lines.append(f"| {r['workers']} | | dkv / local | {_pct(q['completed_per_min'])} | {_pct(q['latency_p50_s'])}"
                         f" | {_pct(q['latency_p95_s'])} | {_pct(q['ttft_mean_s'])} | {_pct(q['tokens_prefilled'])}"
                         " | | | | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    f = sub.add_parser("fidelity")
    f.add_argument("real", type=Path)
    f.add_argument("emulated", type=Path)
    s = sub.add_parser("scale")
    s.add_argument("bench", type=Path, nargs="+")
    for p in (f, s):
        p.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    result = fidelity(args.real, args.emulated) if args.kind == "fidelity" else scale(args.bench)
    result["command"] = " ".join(["python", "benchmarks/emulated_compare.py", *(argv or sys.argv[1:])])
    args.out.write_text(json.dumps(provenance.stamp(result), indent=1) + "\n")
    print(markdown(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
