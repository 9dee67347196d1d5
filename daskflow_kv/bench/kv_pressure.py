"""Exp 7 under KV memory pressure: both systems behind the same hard per-worker budget.

For each stream kind (Zipf, uniform) and each budget (a fraction of the documents' KV, per
worker, never below what the largest workflow level needs alone: ``load.budget_bytes``),
``reps`` repetitions of one stream, ``local`` and daskflow-kv side by side in each (order
alternating), both starting cold. ``local`` holds its budget as a hard pool (running groups
and cache together, ``local_pool``); daskflow-kv as its scheduler-side budget (admission,
eviction, spilling idle pinned blocks, preemption as a last resort). Every row is exp 7's
(``load.measure_row``) with the pressure evidence: idle worker seconds while work waited, peak KV
held per worker, tokens prefilled by why (``load.prefill_split``), blocks spilled and read
back, evictions, preemptions.

``summarize`` pairs the two systems rep by rep: the ratios (daskflow-kv / ``local``) of
throughput, tokens prefilled and p95 latency, their medians and ranges, against the targets
of the memory-pressure issue (throughput >= 1.3x, tokens <= 1x, p95 <= 1x, idle <= 5 %).
"""

from __future__ import annotations

import random
import statistics
import time

from .common import log

# ``over_budget_blocks``: the budget's own promise (a worker passes it by at most one block).
TARGETS = {"throughput": 1.3, "tokens": 1.0, "p95": 1.0, "idle_share": 0.05, "over_budget_blocks": 1.0}


def run(b, streams, fractions, n: int, rate: float, docs: int, context: int, max_new: int, reps: int,
        say=log) -> list[dict]:
    from distributed import Client

    from ..runtime.kv_runtime import KVRuntime
    from . import load as L
    from . import systems as S
    from .load_stream import doc_sequence, documents, schedule

    rt = b.rt
    texts = documents(rt.tokenizer, docs, context)
    working_set = docs * context * rt.facts.bytes_per_token
    second = Client(rt.client.scheduler.address, set_as_default=False)
    rows: list[dict] = []
    try:
        rt2 = KVRuntime(second, rt.spec.model, dtype=rt.spec.dtype, block_size=rt.block_size)
        benches = [b, S.Bench(rt2, b.workers, b.router)]
        for kind in streams:
            doc_of = doc_sequence(n, docs, kind, seed=7)
            salt = f"pressure-{kind}-{random.randrange(1 << 30)}"
            S.reset_caches(b)
            ref_records = L.run_stream(benches, "text", schedule(n, rate, doc_of, seed=1), texts, salt, max_new)
            ref = {r["index"]: r["tokens"] for r in ref_records if "error" not in r}
            text_tokens = sum(r["prefilled"] for r in ref_records if "error" not in r)
            say(f"{kind}: text reference ({len(ref)}/{n} workflows)")
            for fraction in fractions:
                budget = L.budget_bytes(fraction, working_set, ref_records, rt.facts.bytes_per_token)
                for rep in range(reps):
                    arrivals = schedule(n, rate, doc_of, seed=int(rate * 1000) + rep)
                    order = ["local", "dkv"] if rep % 2 == 0 else ["dkv", "local"]
                    for system in order:
                        t0 = time.time()
                        row = L.measure_row(benches, system, f"{kind}-budget", rate, rep, arrivals, texts, salt, max_new,
                                     ref, text_tokens, budget, None)
                        row.update(budget_fraction=fraction, working_set_bytes=working_set, stream_kind=kind)
                        rows.append(row)
                        say(f"{kind} budget {fraction:g} ({budget >> 20} MiB) rep {rep} {system}: "
                            f"{row['completed_per_min']:.1f}/min, p95 {row['latency_p95_s']:.1f}s, prefilled "
                            f"{row['tokens_prefilled']}, idle {row['pressure']['idle_waiting_share']:.1%}, failed "
                            f"{row['failed']}, exact {row['agree']} ({time.time() - t0:.0f}s)")
    finally:
        second.close()
    for x in benches:
        from . import local_engine as le

        x.retain_bytes = le.DEFAULT_RETAIN
    S.reset_caches(b)
    return rows


def _ratio(a, b):
    return a / b if a and b else None


def _spread(values: list) -> dict:
    vals = sorted(v for v in values if v is not None)
    return {"median": statistics.median(vals) if vals else None, "min": vals[0] if vals else None,
            "max": vals[-1] if vals else None, "n": len(vals)}


def _over_budget(row: dict) -> float | None:
    """The most KV blocks any worker held past the budget in a row (sampled: ``pressure_trace``)."""
    per = (row.get("pressure") or {}).get("per_worker") or {}
    vals = [v.get("peak_over_budget_blocks") for v in per.values() if v.get("peak_over_budget_blocks") is not None]
    return max(vals) if vals else None


def summarize(rows: list[dict]) -> list[dict]:
    """Per (stream, budget): each measure's ratio daskflow-kv / ``local`` rep by rep, with the
    median and range, both systems' idle shares, failures and exactness, and which targets hold."""
    points: dict[tuple, dict] = {}
    for r in rows:
        points.setdefault((r["stream_kind"], r["budget_fraction"]), {}).setdefault(r["rep"], {})[r["system"]] = r
    out = []
    for (kind, fraction), reps in sorted(points.items()):
        pairs = [(p["dkv"], p["local"]) for p in reps.values() if "dkv" in p and "local" in p]
        tp = [_ratio(d["completed_per_min"], l["completed_per_min"]) for d, l in pairs]
        tok = [_ratio(d["tokens_prefilled"], l["tokens_prefilled"]) for d, l in pairs]
        p95 = [_ratio(d["latency_p95_s"], l["latency_p95_s"]) for d, l in pairs]
        idle = {s: _spread([p[i]["pressure"]["idle_waiting_share"] for p in pairs]) for i, s in ((0, "dkv"), (1, "local"))}
        row = {"stream": kind, "budget_fraction": fraction, "kv_budget_bytes": pairs[0][0]["kv_budget_bytes"] if pairs else None,
               "reps": len(pairs), "throughput_ratio": _spread(tp), "tokens_ratio": _spread(tok), "p95_ratio": _spread(p95),
               "idle_share": idle,
               "workflows_per_min": {s: _spread([p[i]["completed_per_min"] for p in pairs]) for i, s in ((0, "dkv"), (1, "local"))},
               "peak_over_budget_blocks": {s: _spread([_over_budget(p[i]) for p in pairs])
                                           for i, s in ((0, "dkv"), (1, "local"))},
               "failed": sum(d["failed"] + l["failed"] for d, l in pairs),
               "exact": all(d["agree"] and l["agree"] for d, l in pairs)}
        med = lambda k: row[k]["median"]  # noqa: E731
        row["targets"] = {
            "throughput": med("throughput_ratio") is not None and med("throughput_ratio") >= TARGETS["throughput"],
            "tokens": med("tokens_ratio") is not None and med("tokens_ratio") <= TARGETS["tokens"],
            "p95": med("p95_ratio") is not None and med("p95_ratio") <= TARGETS["p95"],
            "idle": idle["dkv"]["median"] is not None and idle["dkv"]["median"] <= TARGETS["idle_share"],
            "budget_held": (row["peak_over_budget_blocks"]["dkv"]["max"] or 0) <= TARGETS["over_budget_blocks"],
            "failed": row["failed"] == 0, "exact": row["exact"]}
        out.append(row)
    return out


def report(summary: list[dict]) -> str:
    """A markdown table of ``summarize``'s rows (medians of the reps [min-max])."""
    def cell(s, fmt="{:.2f}"):
        if s["median"] is None:
            return "-"
        return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"

    lines = ["| stream | budget (per worker) | workflows/min, dkv / local | throughput ratio | tokens ratio | "
             "p95 ratio | idle while work waits, dkv / local | most blocks past the budget, dkv / local | failed | "
             "exact |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        wpm, over = r["workflows_per_min"], r["peak_over_budget_blocks"]
        lines.append(f"| {r['stream']} | {r['budget_fraction']:g} ({(r['kv_budget_bytes'] or 0) / 2**20:.0f} MiB) | "
                     f"{cell(wpm['dkv'], '{:.1f}')} / {cell(wpm['local'], '{:.1f}')} | {cell(r['throughput_ratio'])} | "
                     f"{cell(r['tokens_ratio'])} | {cell(r['p95_ratio'])} | "
                     f"{cell(r['idle_share']['dkv'], '{:.1%}')} / {cell(r['idle_share']['local'], '{:.1%}')} | "
                     f"{cell(over['dkv'], '{:.1f}')} / {cell(over['local'], '{:.1f}')} | "
                     f"{r['failed']} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)
