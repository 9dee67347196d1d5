"""The summary of a bench run: medians per point, the best baseline, the targets. Pure.

Medians over repetitions per (experiment, point, system, phase), with the spread (min and
max). A system whose tokens differed from text replay's at a point gets no speed there:
its timing cells are blank and the summary says MISMATCH. A cold row whose mean TTFT lies
before its shared context was ready (``ttft_mean_s < shared_prefill_wall_s``) is a timing
bug, not a result: its speed is refused the same way (INVALID). So is an overhead (Omega)
whose busiest worker computed for longer than the workflow's wall (``overhead_invalid``):
requests batched together were summed (runs before ``common.busy_seconds``). ``targets``
checks the benchmark issue's targets against the summary. Rows of different commits or
hosts (their ``origin``, ``provenance.tag_rows``) are not summarized together unless the
caller allows it: the medians of a mix would hide what moved.
"""

from __future__ import annotations

import math

from . import provenance
from .common import median

BASELINES = ("text", "hf", "local")
SUBJECT = "dkv"
SPEED_FIELDS = ("wall_s", "ttft_mean_s", "ttft_p50_s", "ttft_min_s", "ttft_max_s", "throughput_tok_s",
                "busiest_compute_s", "omega_s", "omega_frac", "prefill_s", "decode_s", "shared_prefill_s",
                "shared_prefill_wall_s", "engine_ttft_mean_s", "completed_per_min", "latency_p50_s",
                "latency_p95_s", "latency_mean_s")
MEDIAN_FIELDS = SPEED_FIELDS + ("tokens_prefilled", "kv_bytes_copied", "bytes_transferred", "kv_accounted_bytes",
                                "rss_peak_delta_bytes", "dask_kv_peak_bytes", "generated_tokens", "prompt_tokens",
                                "prefix_tokens", "offered_per_min", "completed", "failed", "hit_rate", "transfers",
                                "evictions", "evictions_regretted", "repeat_prefill_tokens", "plan_error_median_s")
OVERHEAD_FIELDS = ("busiest_compute_s", "omega_s", "omega_frac")  # refused together (overhead_invalid)
SPREAD_FIELDS = ("wall_s", "ttft_mean_s", "completed_per_min", "latency_p95_s", "tokens_prefilled")  # min and max over repetitions too
POINT_KEY = {"exp1": "context", "exp2": "k", "exp6": "workflow", "exp7": "point"}  # exp7: "<stream> <rate>/min"
PHASES = ("cold", "warm", "stream")


def summarize(runs: list[dict], across_commits: bool = False, across_hosts: bool = False) -> list[dict]:
    """Medians per point. Raises ``provenance.IncomparableResults`` (one line) for rows of
    different commits or hosts, unless ``across_commits`` / ``across_hosts``."""
    provenance.check_rows(runs, across_commits, across_hosts)
    groups: dict[tuple, list[dict]] = {}
    order = list(dict.fromkeys(r["system"] for r in runs))  # systems in the order they were given
    for r in runs:
        if r["exp"] == "exp7" and "point" not in r:  # a run from before exp7 had stream kinds
            r = {**r, "point": r["rate"], "stream": "uniform"}
        groups.setdefault((r["exp"], r[POINT_KEY[r["exp"]]], r["system"], r.get("phase", "cold")), []).append(r)

    def sort_key(kv):
        exp, point, system, phase = kv[0]
        return exp, str(type(point)), point, PHASES.index(phase) if phase in PHASES else 9, order.index(system)

    out = []
    for (exp, point, system, phase), rs in sorted(groups.items(), key=sort_key):
        errors = [r["error"] for r in rs if r.get("error")]
        rs = [r for r in rs if not r.get("error")]
        head = {"exp": exp, POINT_KEY[exp]: point, "system": system, "phase": phase}
        if not rs:
            out.append({**head, "reps": 0, "agree": None, "errors": errors})
            continue
        agree = None if any(r["agree"] is None for r in rs) else all(r["agree"] for r in rs)
        checks = [r.get("ttft_invariant_ok") for r in rs if r.get("ttft_invariant_ok") is not None]
        row = {**head, "reps": len(rs), "agree": agree, "agents": rs[0].get("agents"),
               "ttft_invariant_ok": all(checks) if checks else None}
        for f in ("stream", "rate", "kv_budget_bytes"):  # exp7's point, spelled out
            if f in rs[0]:
                row[f] = rs[0][f]
        for f in MEDIAN_FIELDS:
            row[f] = median([r.get(f) for r in rs])
        for f in SPREAD_FIELDS:
            xs = [r[f] for r in rs if isinstance(r.get(f), (int, float)) and not math.isnan(r[f])]
            row[f + "_min"], row[f + "_max"] = (min(xs), max(xs)) if xs else (None, None)
        if any("round_ttft_s" in r for r in rs):
            n = max(len(r.get("round_ttft_s") or []) for r in rs)
            row["round_ttft_s"] = [median([(r.get("round_ttft_s") or [math.nan] * n)[i] for r in rs])
                                   for i in range(n)]
        if any(r.get("busiest_compute_s", 0) > 1.01 * r.get("wall_s", math.inf) for r in rs):
            for f in OVERHEAD_FIELDS:  # more compute than wall on one worker: overlapping requests summed
                row[f] = None
            row["overhead_invalid"] = True
        if agree is False or row["ttft_invariant_ok"] is False:
            for f in (*SPEED_FIELDS, *(f + s for f in SPREAD_FIELDS for s in ("_min", "_max")), "round_ttft_s"):
                row[f] = None
            row["invalid"] = "MISMATCH" if agree is False else "INVALID"
        decisions: dict[str, int] = {}
        for r in rs:
            for a, n in (r.get("decisions") or {}).items():
                decisions[a] = decisions.get(a, 0) + n
        row["decisions"] = decisions
        if errors:
            row["errors"] = errors
        out.append(row)
    return out


def upgrade(summary: list[dict]) -> list[dict]:
    """A summary stored by a run from before exp7 had stream kinds, keyed as this one is."""
    return [{**r, "point": r["rate"], "stream": "uniform"} if r["exp"] == "exp7" and "point" not in r else r
            for r in summary]


def usable(row: dict | None) -> bool:
    return bool(row) and bool(row.get("reps")) and not row.get("invalid")


def value(row: dict | None, metric: str) -> float | None:
    if not usable(row):
        return None
    v = row.get(metric)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def best_baseline(summary: list[dict], exp: str, point, phase: str, metric: str, higher_better=False):
    """(system, value) of the best baseline at a point; a warm point counts text replay's
    cold value (it has no cache to warm)."""
    key = POINT_KEY[exp]
    cands = []
    for r in summary:
        if r["exp"] != exp or r[key] != point or r["system"] not in BASELINES:
            continue
        if r["phase"] == phase or (phase == "warm" and r["system"] == "text" and r["phase"] == "cold"):
            v = value(r, metric)
            if v is not None:
                cands.append((r["system"], v))
    if not cands:
        return None, None
    return (max if higher_better else min)(cands, key=lambda c: c[1])


def gain(summary, exp, point, phase, metric, higher_better=False):
    """Best baseline over daskflow-kv (>1: daskflow-kv better), the baseline's name."""
    key = POINT_KEY[exp]
    subj = next((r for r in summary if r["exp"] == exp and r[key] == point and r["system"] == SUBJECT
                 and r["phase"] == phase), None)
    name, base = best_baseline(summary, exp, point, phase, metric, higher_better)
    v = value(subj, metric)
    if v is None or base is None or v == 0:
        return None, name
    return (v / base if higher_better else base / v), name


def exp3_errors(rows: list[dict], lo: int = 512, hi: int = 4096) -> dict:
    """Prediction errors and correct choices of exp 3 (the planner issue's targets)."""
    errs = []
    for r in rows:
        if not lo <= r["context"] <= hi:
            continue
        for col, what in (("err_transfer", "transfer"), ("err_recompute", "recompute")):
            v = r.get(col)
            if v is not None and not math.isnan(v):
                errs.append((abs(v), v, what, r["label"], r["context"]))
    worst = max(errs, default=None)
    correct = {}
    for col in ("model_correct", "runtime_correct", "probe_model_correct"):
        got = [bool(r[col]) for r in rows if r.get(col) is not None]
        ties = [bool(r[col]) for r in rows if r.get(col) is not None and r.get("near_tie")]
        correct[col] = {"right": sum(got), "of": len(got), "near_tie_right": sum(ties), "near_tie_of": len(ties)}
    return {"worst": worst, "within_25": sum(e[0] <= 0.25 for e in errs), "of": len(errs), "correct": correct}


def targets(doc: dict, summary: list[dict]) -> list[dict]:
    """The issue's targets, each {"target", "ok" (True/False/None: not measured), "detail"}."""
    out = []
    cold = []
    for exp in ("exp1", "exp2", "exp6"):
        key = POINT_KEY[exp]
        for p in sorted({r[key] for r in summary if r["exp"] == exp and r["phase"] == "cold"}, key=str):
            g, name = gain(summary, exp, p, "cold", "wall_s")
            if g is not None:
                cold.append((g, exp, p, name))
    worst = min(cold, default=None)
    out.append({"target": "daskflow-kv wall >= 0.95x the best baseline at every cold point",
                "ok": None if worst is None else worst[0] >= 0.95,
                "detail": "not measured" if worst is None else
                f"worst {worst[0]:.2f}x at {worst[1]} {POINT_KEY[worst[1]]}={worst[2]} (vs {worst[3]})"})
    e6 = [(gain(summary, "exp6", p, "cold", "wall_s"), p) for p in
          sorted({r["workflow"] for r in summary if r["exp"] == "exp6"})]
    e6 = [(g, name, p) for (g, name), p in e6 if g is not None]
    out.append({"target": "exp 6: daskflow-kv wall >= 1.5x the best baseline",
                "ok": None if not e6 else all(g >= 1.5 for g, _, _ in e6),
                "detail": "; ".join(f"{p}: {g:.2f}x vs {n}" for g, n, p in e6) or "not measured"})
    out += exp7_targets(summary)
    warm = []
    for r in summary:
        e = value(r, "engine_ttft_mean_s")
        t = value(r, "ttft_mean_s")
        if r["system"] == SUBJECT and r["phase"] == "warm" and e and t:
            warm.append((t / e, r["exp"], r[POINT_KEY[r["exp"]]], t, e))
    w = max(warm, default=None)
    out.append({"target": "warm per-agent TTFT within 2x of an in-process Engine resume of the same shapes",
                "ok": None if w is None else w[0] <= 2.0,
                "detail": "not measured (run with --warm)" if w is None else
                f"worst {w[0]:.2f}x at {w[1]} {POINT_KEY[w[1]]}={w[2]} ({w[3]:.3f} s vs {w[4]:.3f} s)"})
    e3 = exp3_errors(doc.get("exp3") or [])
    if e3["worst"]:
        a, v, what, label, ctx = e3["worst"]
        out.append({"target": "exp 3: every prediction within +-25% at 512-4,096 tokens",
                    "ok": e3["within_25"] == e3["of"],
                    "detail": f"{e3['within_25']}/{e3['of']} within; worst {v:+.0%} ({what}, {label}, {ctx} tokens)"})
    c = e3["correct"]["runtime_correct"]
    if c["of"]:
        out.append({"target": "exp 3: >= 95% correct choices including near ties (the runtime's plan)",
                    "ok": c["right"] >= 0.95 * c["of"],
                    "detail": f"{c['right']}/{c['of']} ({c['near_tie_right']}/{c['near_tie_of']} near ties)"})
    return out




PUBLISHED_EXP7 = {"dkv": 13.6, "local": 15.5}  # saturation workflows/min of the run before continuous batching


def saturation(summary: list[dict], stream: str) -> dict[str, dict]:
    """Per system, the exp7 row of ``stream`` with the most completed workflows per minute."""
    best: dict[str, dict] = {}
    for r in summary:
        if r["exp"] == "exp7" and r.get("stream") == stream and value(r, "completed_per_min") is not None:
            if r["system"] not in best or r["completed_per_min"] > best[r["system"]]["completed_per_min"]:
                best[r["system"]] = r
    return best


def exp7_targets(summary: list[dict]) -> list[dict]:
    """The load issue's targets (daskflow-kv against local, side by side) and the batching issue's."""
    out = []
    for stream, need in (("zipf-budget", 1.3), ("uniform", 1.1)):
        sat = saturation(summary, stream)
        d, l = sat.get(SUBJECT), sat.get("local")
        if d is None or l is None:
            continue
        ratio = d["completed_per_min"] / l["completed_per_min"]
        out.append({"target": f"exp 7 {stream}: saturation throughput >= {need}x local's", "ok": ratio >= need,
                    "detail": f"{d['completed_per_min']:.1f} vs {l['completed_per_min']:.1f} workflows/min: "
                              f"{ratio:.2f}x"})
        out.append({"target": f"exp 7 {stream}: tokens prefilled <= local's, p95 latency <= local's",
                    "ok": d["tokens_prefilled"] <= l["tokens_prefilled"] and d["latency_p95_s"] <= l["latency_p95_s"],
                    "detail": f"tokens {d['tokens_prefilled']:.0f} vs {l['tokens_prefilled']:.0f}; p95 "
                              f"{d['latency_p95_s']:.1f} s vs {l['latency_p95_s']:.1f} s (at {d['point']} / {l['point']})"})
    failed = [(r["point"], r["system"], r["failed"]) for r in summary
              if r["exp"] == "exp7" and r["system"] == SUBJECT and r.get("failed")]
    if any(r["exp"] == "exp7" and r["system"] == SUBJECT for r in summary):
        out.append({"target": "exp 7: no daskflow-kv workflow fails", "ok": not failed,
                    "detail": "none failed" if not failed else "; ".join(f"{p}: {n:g}" for p, _, n in failed)})
    sat = saturation(summary, "uniform")
    for system, before in PUBLISHED_EXP7.items():
        if system in sat:
            v = sat[system]["completed_per_min"]
            out.append({"target": f"exp 7 uniform: {system} saturation throughput >= 1.5x the published {before}",
                        "ok": v >= 1.5 * before, "detail": f"{v:.1f} workflows/min ({v / before:.2f}x); the "
                        "published run had 4 documents, this one as configured"})
    return out
