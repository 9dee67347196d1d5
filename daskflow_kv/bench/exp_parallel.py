"""Experiment 8: parallel materialize - one cold prefill over W workers against one.

materialize  wall time of ``KVRuntime.materialize`` until every block is in worker memory,
             for each W in ``widths`` and each context, all widths on the same tokens in
             turn within a repetition (order rotated per repetition, KV cache drained before
             each), then a short greedy resume from the state: its tokens must equal text
             mode's (``agree``). Also per run: the chunk spans, the K/V bytes handed over,
             the mean per-layer hand-off transit, and the time chunks spent waiting.
exp1p        cold Exp 1 (``agents`` agents on one shared context) with daskflow-kv's
             materialize held to one worker ("dkv-w1") and left to the planner
             ("dkv-par", ``parallel="auto"``), beside the baselines, on the same prompts.

Rows keep the summary style of the other experiments (exp, system, context, agree, wall_s).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import dask

from ..keys import PREFILL_TOPIC
from . import experiments as E
from . import systems as S
from .common import Progress, log, write_csv
from .workload import build_workload

BASELINES = ("text", "hf", "local")
PARALLEL_SYSTEMS = {"dkv-w1": 1, "dkv-par": "auto"}  # label -> daskflow-kv.parallel.materialize


def _chunk_events(rt, sid: str) -> list[dict]:
    deadline = time.time() + 2.0
    while True:
        evs = [e for _, e in rt.client.get_events(PREFILL_TOPIC)
               if isinstance(e, dict) and e.get("state_id") == sid]
        if evs or time.time() > deadline:
            return evs


def materialize_run(rt, tokens: list[int], suffix: list[int], width, max_new: int, reference: list[int]) -> dict:
    """One cold materialize at ``width`` (after a drain), timed to all blocks in memory, then checked."""
    S.drain_kv(rt, timeout=20)
    t0 = time.perf_counter()
    st = rt.materialize(tokens, parallel=width)
    rt.wait([st])
    wall = time.perf_counter() - t0
    got = rt.resume(st, suffix, max_new_tokens=max_new)
    events = _chunk_events(rt, st.state_id)
    chunks = sorted((e for e in events if "chunk" in e), key=lambda e: e["chunk"])
    row = {
        "width": st.state.lineage[-1].as_dict().get("parallel", 1),
        "agree": list(got.tokens) == list(reference),
        "wall_s": wall,
        "compute_s": [round(e["seconds"], 4) for e in events],
        "wait_s": sum(e.get("wait_seconds", 0.0) for e in chunks),
        "chunk_tokens": [e["new_tokens"] for e in chunks],
        "relayed": all(e.get("relayed", True) for e in chunks),
        "handoff_bytes": sum(e.get("handoff_bytes_sent", 0) for e in chunks),
        "handoff_transit_ms": 1e3 * max((e.get("handoff_transit_s", 0.0) for e in chunks), default=0.0),
        "workers": sorted({e["worker"] for e in events}),
    }
    rt.release(got.state)
    rt.release(st)
    return row


def materialize_sweep(rt, contexts, widths, reps: int, max_new: int, progress: Progress | None = None) -> list[dict]:
    rows = []
    for n in contexts:
        for rep in range(reps):
            rng = random.Random(1000 * n + rep)
            tokens = [rng.randrange(3, rt.facts.vocab_size) for _ in range(n)]
            suffix = [rng.randrange(3, rt.facts.vocab_size) for _ in range(8)]
            reference = rt.generate_text(tokens + suffix, max_new).result().generated
            order = list(widths)[rep % len(widths):] + list(widths)[: rep % len(widths)]
            for w in order:
                try:
                    r = materialize_run(rt, tokens, suffix, w, max_new, reference)
                except Exception as e:  # noqa: BLE001 -- one failed run must not lose the others
                    log(f"  !! materialize W={w} at {n} tokens failed: {type(e).__name__}: {e}")
                    r = {"agree": None, "error": f"{type(e).__name__}: {e}"}
                rows.append({"exp": "parallel", "system": f"dkv-w{w}", "context": n, "rep": rep, "asked": w, **r})
                if progress:
                    note = "FAILED" if r.get("error") else "%.2fs W=%d" % (r["wall_s"], r["width"])
                    progress.step(f"parallel {n} tok W={w} rep{rep} {note}")
    S.drain_kv(rt, timeout=20)
    return rows


def exp1_parallel(rt, contexts, agents: int, max_new: int, workers, reps: int,
                  progress: Progress | None = None) -> list[dict]:
    """Cold Exp 1 with daskflow-kv's materialize on one worker and left to the planner."""
    systems = list(BASELINES) + list(PARALLEL_SYSTEMS)
    b = S.make_bench(rt, workers)
    rows = []
    for ctx in contexts:
        for rep in range(reps):
            wl = build_workload(rt.tokenizer, ctx, agents, max_new, f"exp1p-{ctx}-r{rep}-{random.randrange(1 << 30)}",
                                rt.facts.max_positions)
            rot = rep % len(systems)
            order = ["text"] + [s for s in systems[rot:] + systems[:rot] if s != "text"]  # the reference first
            runs = {}
            for name in order:
                try:
                    S.reset_caches(b, timeout=20)  # cold: every system starts with nothing cached
                    if name in PARALLEL_SYSTEMS:
                        with dask.config.set({"daskflow-kv.parallel.materialize": PARALLEL_SYSTEMS[name]}):
                            run = S.measured_run(b, "dkv", wl, sample_memory=False)
                        run.system = name
                    else:
                        run = S.measured_run(b, name, wl, sample_memory=False)
                    runs[name] = run
                    note = f"{run.wall_s:.2f}s"
                except Exception as e:  # noqa: BLE001
                    log(f"  !! {name} failed at exp1p {ctx} rep {rep}: {type(e).__name__}: {e}")
                    rows.append({"exp": "exp1p", "context": ctx, "rep": rep, "system": name, "agree": None,
                                 "error": f"{type(e).__name__}: {e}"})
                    note = "FAILED"
                if progress:
                    progress.step(f"exp1p {ctx} rep{rep} {name} {note}")
            ref = runs["text"].tokens() if "text" in runs else None
            for name in systems:
                if name in runs:
                    agree = None if ref is None else runs[name].tokens() == ref
                    rows.append(E.run_row("exp1p", {"context": ctx}, rep, runs[name], wl, agree))
    S.drain_kv(rt, timeout=20)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Medians per (exp, context, system); W=2 / W=1 and daskflow-kv / best-baseline ratios."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["exp"], r["context"], r["system"]), []).append(r)
    out = []
    for (exp, ctx, system), rs in sorted(groups.items()):
        ok = [r for r in rs if not r.get("error")]
        agree = None if not ok or any(r["agree"] is None for r in ok) else all(r["agree"] for r in ok)
        walls = [r["wall_s"] for r in ok]
        out.append({"exp": exp, "context": ctx, "system": system, "reps": len(ok), "agree": agree,
                    "wall_s": statistics.median(walls) if walls and agree is not False else None,
                    "width": max((r.get("width", 1) for r in ok), default=None) if exp == "parallel" else None})
    by = {(r["exp"], r["context"], r["system"]): r for r in out}
    for r in out:
        if r["exp"] == "parallel" and r["system"] != "dkv-w1":
            one = by.get(("parallel", r["context"], "dkv-w1"))
            if one and one["wall_s"] and r["wall_s"]:
                r["time_vs_w1"] = r["wall_s"] / one["wall_s"]
        if r["exp"] == "exp1p" and r["system"] in PARALLEL_SYSTEMS:
            base = [by[("exp1p", r["context"], b)]["wall_s"] for b in BASELINES
                    if ("exp1p", r["context"], b) in by and by[("exp1p", r["context"], b)]["wall_s"]]
            if base and r["wall_s"]:
                r["best_baseline_wall_s"] = min(base)
                r["speedup_vs_best_baseline"] = min(base) / r["wall_s"]
    return out


def _num(x, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def markdown(summary: list[dict]) -> str:
    lines = ["", "## Experiment 8: parallel materialize", "",
             "Materialize wall time (median) per context and W; `time_vs_w1` < 1 is faster than one worker. "
             "`agree`: a greedy resume from the state gave text mode's tokens.", "",
             "| context | system | W used | wall s | time vs W=1 | agree |", "|---|---|---|---|---|---|"]
    for r in summary:
        if r["exp"] == "parallel":
            lines.append(f"| {r['context']} | {r['system']} | {r['width']} | {_num(r['wall_s'], '{:.2f}')} | "
                         f"{_num(r.get('time_vs_w1'), '{:.2f}x')} | {r['agree']} |")
    lines += ["", "Cold Exp 1 wall time (median); speedup = best baseline wall / daskflow-kv wall.", "",
              "| context | system | wall s | speedup vs best baseline | agree |", "|---|---|---|---|---|"]
    for r in summary:
        if r["exp"] == "exp1p":
            lines.append(f"| {r['context']} | {r['system']} | {_num(r['wall_s'], '{:.2f}')} | "
                         f"{_num(r.get('speedup_vs_best_baseline'), '{:.2f}x')} | {r['agree']} |")
    return "\n".join(lines) + "\n"


def run(rt, cfg: dict, workers, progress: Progress | None = None) -> dict:
    limit = rt.facts.max_positions - cfg["max_new_tokens"] - 8 - 8  # resume suffix and generation fit
    contexts = sorted({min(c, limit) for c in cfg["parallel_contexts"]})
    e1 = sorted({min(c, rt.facts.max_positions - cfg["max_new_tokens"] - 8) for c in cfg["parallel_exp1_contexts"]})
    log(f"exp8 parallel materialize: W {cfg['parallel_widths']} at {contexts}; cold exp1 at {e1}")
    rows = materialize_sweep(rt, contexts, cfg["parallel_widths"], cfg["reps"], cfg["max_new_tokens"], progress)
    rows += exp1_parallel(rt, e1, cfg["agents"], cfg["max_new_tokens"], workers, cfg["reps"], progress)
    return {"rows": rows, "summary": summarize(rows), "plans": [p.reason for p in rt.parallel_plans]}


def write(doc: dict, out_dir: Path, tag: str, summary_path: Path | None) -> list[Path]:
    """bench_<tag>_parallel.csv (runs), _parallel_summary.csv, and a section in the markdown summary."""
    part = doc.get("parallel")
    if not part:
        return []
    files = [write_csv(out_dir / f"bench_{tag}_parallel.csv", part["rows"]),
             write_csv(out_dir / f"bench_{tag}_parallel_summary.csv", part["summary"])]
    if summary_path is not None and summary_path.exists():
        with open(summary_path, "a") as f:
            f.write(markdown(part["summary"]))
    return files
