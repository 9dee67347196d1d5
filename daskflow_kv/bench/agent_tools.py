"""Issue 55's stream: agents that call tools and decide what comes next, under a KV budget.

Arrival i runs one of three workflows over one of ``docs`` shared documents (in turn):
i even: ReAct (``workflows.react_tools``: ``calls`` tool calls, then an answer - each call the
model's own when it wrote one in the format, else the workload's next one, so every ReAct
makes the same number of calls in every system); i % 4 == 1: a debate until the judge agrees
(``debate_until``: 2 debaters, at most 2 rounds); i % 4 == 3: a tree of thought with pruning
(``tot_pruned``: 2 ways, the best 1 kept by a scoring agent, depth 2). Every tool call waits
an EMULATED latency drawn uniformly from [lo, hi] s, seeded by the call (the same in every
system), before its real answer (a calculator, BM25 over the corpus).

Systems, on the same cluster, the same arrivals (Poisson, ``load_stream.schedule``):
text    text replay: every agent prefills its whole prompt (``run_text_mode``);
local   per-worker prefix-caching engines behind the cache-aware router (``bench.local_engine``,
        ``multiround.run_local_mode``): the baseline; it keeps what its LRU cache holds;
dkv     daskflow-kv state mode; a conversation waiting on a tool has its KV kept, spilled
        to the store and prefetched, or dropped by ``policy.kv_wait``.
Tools run as Dask tasks in every system. Under the budget, dkv's per-worker KV budget and
local's retained bytes are the same number.

The budget: ``budget_fraction`` of a working set - the documents and four workflows' prompts
(text replay's mean per workflow) - and never less than one workflow's whole KV as text
replay holds it (exp 7's rule), so every workflow fits alone and a stream does not.

Per (system, rep) a row: mean / p95 workflow latency (arrival to completion), tokens
prefilled, agents whose tokens differ from text replay's, the wait decisions, evictions.
"""

from __future__ import annotations

import math
import statistics
import time
from types import SimpleNamespace

from ..flow.executor import run_state_mode, run_text_mode
from ..flow.growing import for_run
from ..flow.steps import ToolCall, parse_action
from ..stats import percentile
from ..workflows import debate_until, react_tools, tot_pruned
from ..workflows.tool_latency import Latency
from . import local_engine as le
from . import systems as S
from .load import run_stream
from .load_stream import schedule
from .multiround import run_local_mode

SYSTEMS = ("text", "local", "dkv")
KINDS = {0: "react", 1: "debate-until", 2: "react", 3: "tot-pruned"}
QUERIES = ["30 * 3 * 64 * 2 * 4", "transfer or recompute", "46080 * 512", "eviction under memory pressure"]


class ScheduledCalls:
    """A ReAct agent's calls in the stream: ``calls`` of them, each the model's own when its
    output holds one in the format, else the workload's next query (one of ``QUERIES``)."""

    def __init__(self, calls: int, offset: int):
        self.calls, self.offset = calls, offset

    def __call__(self, step: int, text: str) -> ToolCall | None:
        if step >= self.calls:
            return None
        own = parse_action(text, ["calculator", "search"])
        if own is not None:
            return own
        q = QUERIES[(self.offset + step) % len(QUERIES)]
        return ToolCall("calculator" if q[0].isdigit() else "search", q)


def _own_calls(taken: list[str]) -> int:
    """Tool calls a run's ReAct agents wrote themselves (not one of the workload's queries)."""
    return sum(1 for line in taken if ": calls " in line and not any(f"[{q}]" in line for q in QUERIES))


def workflow(index: int, document: str, salt: str, max_new: int, calls: int, latency: tuple[float, float],
             seed: int):
    """Arrival ``index``'s workflow (its kind by ``KINDS``), over ``document``."""
    kind = KINDS[index % 4]
    name = f"{kind}-{index}"
    if kind == "react":
        wf = react_tools.build(max_steps=calls + 1, max_new_tokens=max_new, name=name, document=document,
                               propose=ScheduledCalls(calls, index), latency=Latency(seed * 100_003 + index, *latency))
    elif kind == "debate-until":
        wf = debate_until.build(agents=2, max_rounds=2, max_new_tokens=max_new, name=name, document=document)
    else:
        wf = tot_pruned.build(branch=2, keep=1, depth=2, max_new_tokens=max_new, name=name, document=document)
    wf.system = f"Session {salt}. {wf.system}"  # no stream reuses another's blocks
    return wf


def run_one(b: S.Bench, system: str, wf) -> dict:
    """One workflow in ``system``: its agents' tokens, what it prefilled, its tools and decisions."""
    rt = b.rt
    cw, grow = for_run(wf, rt, "state" if system == "dkv" else system)
    if system == "local":
        out = run_local_mode(cw, b, grow)
        res = SimpleNamespace(tokens={n: a["tokens"] for n, a in out["agents"].items()},
                              first=[a["first_token_at"] for a in out["agents"].values()],
                              prefilled=sum(out["level_tokens"]), tools={})
    else:
        r = run_state_mode(cw, rt, grow=grow) if system == "dkv" else run_text_mode(cw, rt, grow=grow)
        res = SimpleNamespace(tokens={n: a.tokens for n, a in r.agents.items()},
                              first=[a.first_token_at for a in r.agents.values()],
                              prefilled=sum(r.level_tokens_computed), tools={})
    grow.finish(res)
    return {"tokens": res.tokens, "first": res.first, "prefilled": res.prefilled, "levels": len(cw.levels),
            "tool_waits": [t["waited_s"] for t in res.tools.values()], "own_calls": _own_calls(cw.taken),
            "wait_decisions": list(grow.wait.decisions) if grow.wait is not None else [],
            "kind": wf.name.rsplit("-", 1)[0]}


def _row(system: str, rep: int, records: list[dict], ref: dict | None, budget: int | None, counters: dict) -> dict:
    ok = [r for r in records if "error" not in r]
    lat = sorted(r["done"] - r["arrived"] for r in ok)
    wrong = None if ref is None else sum(r["tokens"] != ref.get(r["index"]) for r in ok)
    decisions: dict[str, int] = {}
    for r in ok:
        for d in r.get("wait_decisions", ()):
            decisions[d["action"]] = decisions.get(d["action"], 0) + 1
    by_kind: dict[str, list[float]] = {}
    for r in ok:
        by_kind.setdefault(r["kind"], []).append(r["done"] - r["arrived"])
    return {
        "system": system, "rep": rep, "workflows": len(records), "completed": len(ok),
        "errors": [r["error"] for r in records if "error" in r], "wrong": wrong,
        "agree": None if ref is None else wrong == 0 and len(ok) == len(records),
        "latency_mean_s": statistics.fmean(lat) if lat else math.nan,
        "latency_p50_s": percentile(lat, 0.5), "latency_p95_s": percentile(lat, 0.95),
        "latency_mean_by_kind_s": {k: statistics.fmean(v) for k, v in by_kind.items()},
        "tokens_prefilled": sum(r["prefilled"] for r in ok),
        "tool_calls": sum(len(r["tool_waits"]) for r in ok),
        "tool_calls_the_model_wrote": sum(r["own_calls"] for r in ok),
        "tool_wait_mean_s": statistics.fmean([w for r in ok for w in r["tool_waits"]]) if ok else math.nan,
        "wait_decisions": decisions, "kv_budget_bytes": budget, **counters,
        "records": [{k: r.get(k) for k in ("index", "kind", "arrived", "done", "prefilled", "levels", "tool_waits",
                                           "wait_decisions", "error")} for r in records],
    }


def _counters(b: S.Bench, system: str) -> dict:
    if system == "dkv":
        c = b.rt.counters()["counters"]
        return {k: c.get(k) for k in ("evictions", "bytes_evicted", "preemptions", "transfers", "lineage_recomputes")}
    if system == "local":
        st = b.client.run(le.stats).values()
        return {"evictions": sum(x["evicted_states"] for x in st), "bytes_evicted": sum(x["evicted_bytes"] for x in st)}
    return {}


def stream(b: S.Bench, n: int, rate: float, docs: list[str], max_new: int, calls: int, latency: tuple[float, float],
           reps: int, budget_fraction: float, systems=SYSTEMS, log=print, warmup: int = 4) -> dict:
    """``warmup`` workflows in each system first (not recorded: a run without it had every
    workflow of the first daskflow-kv stream 1.5-2x slower, tools or not). Then per rep: text
    replay first (that rep's token reference; the first one sizes the budget), then the other
    systems in alternating order, each from empty caches. Each rep has its own session salt:
    nothing a rep cached or stored is another rep's hit. -> {"rows", ...}."""
    rt = b.rt
    doc_of = [i % len(docs) for i in range(n)]
    bench = [b, b]
    rows, budget, reference = [], None, []
    if warmup:  # every system's code paths, connections and kernels warmed first; nothing recorded
        def warm(a, doc, salt_, max_new_):
            return workflow(a.index, doc, salt_, max_new_, calls, (0.1, 0.2), 0)

        for system in systems:
            S.reset_caches(b)
            run_stream(bench, system, schedule(warmup, 60.0, doc_of[:warmup], seed=99), docs, f"warmup-{system}",
                       max_new, build=warm, run_one=run_one)
        log(f"warmed up: {warmup} workflows in each system")
    def builder(a, doc, salt_, max_new_):
        return workflow(a.index, doc, salt_, max_new_, calls, latency, 1)

    for rep in range(reps):
        salt = f"agent-tools-{rep}-{time.time_ns() % (1 << 30)}"
        arrivals = schedule(n, rate, doc_of, seed=10 + rep)
        others = [s for s in systems if s != "text"]
        ref = None
        for system in ["text"] + (others if rep % 2 == 0 else others[::-1]):
            S.reset_caches(b)
            if budget is not None:
                b.retain_bytes = budget
                rt.configure(kv_budget_bytes=budget)
            before = _counters(b, system)
            t0 = time.time()
            try:
                records = run_stream(bench, system, arrivals, docs, salt, max_new, build=builder, run_one=run_one)
            finally:
                rt.configure(unset_budget=True)
                b.retain_bytes = le.DEFAULT_RETAIN
            if system == "text":
                failed = [r["error"] for r in records if "error" in r]
                if failed:
                    raise RuntimeError(f"text replay failed: {failed[0]}")
                ref = {r["index"]: r["tokens"] for r in records}
                reference.append(sum(r["prefilled"] for r in records))
                if budget is None:  # part of the working set, never less than one workflow's whole KV
                    bpt = rt.facts.bytes_per_token
                    one = max(r["prefilled"] + max_new * len(r["tokens"]) for r in records)
                    working = sum(len(rt.tokenizer(d)["input_ids"]) for d in docs) \
                        + sum(r["prefilled"] for r in records) // n * 4
                    budget = max(int(budget_fraction * working * bpt), one * bpt)
                    log(f"budget {budget / 2**20:.1f} MiB per worker (the first text replay ran without one)")
            after = _counters(b, system)
            delta = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in after}
            rows.append(_row(system, rep, records, ref, budget if system != "text" or rep else None, delta))
            r = rows[-1]
            log(f"  rep {rep} {system:<5} mean latency {r['latency_mean_s']:6.2f}s p95 {r['latency_p95_s']:6.2f}s "
                f"prefilled {r['tokens_prefilled']:6d} wrong {r['wrong']} errors {len(r['errors'])} "
                f"waits {r['wait_decisions']} evictions {r.get('evictions')} ({time.time() - t0:.0f}s)")
    return {"rows": rows, "budget_bytes": budget, "reference_tokens_prefilled": reference}


def summary(rows: list[dict]) -> dict:
    """Per rep, dkv's mean latency over local's and its tokens over text replay's; medians and ranges."""
    by = {(r["system"], r["rep"]): r for r in rows}
    reps = sorted({r["rep"] for r in rows})
    lat = [by["dkv", k]["latency_mean_s"] / by["local", k]["latency_mean_s"] for k in reps
           if ("dkv", k) in by and ("local", k) in by]
    tok = [by["dkv", k]["tokens_prefilled"] / by["text", k]["tokens_prefilled"] for k in reps
           if ("dkv", k) in by and ("text", k) in by]
    tok_local = [by["local", k]["tokens_prefilled"] / by["text", k]["tokens_prefilled"] for k in reps
                 if ("local", k) in by and ("text", k) in by]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "latency_dkv_over_local": {"median": med(lat), "reps": lat},
        "tokens_dkv_over_text": {"median": med(tok), "reps": tok},
        "tokens_local_over_text": {"median": med(tok_local), "reps": tok_local},
        "all_exact": all(r["agree"] for r in rows if r["agree"] is not None),
        "targets": {"latency <= 0.6x local": med(lat) is not None and med(lat) <= 0.6,
                    "tokens <= 0.5x text replay": med(tok) is not None and med(tok) <= 0.5},
    }
