"""Exp 7: streams of workflows on one cluster, from two clients, at several arrival rates.

The streams (``load_stream``): documents in turn (``uniform``), drawn from a Zipf law
(``zipf``), and the Zipf stream under a per-worker KV budget that holds only part of the
working set - but at least one workflow's whole KV, so every workflow can fit - (``zipf-budget``;
``local``'s engines retain the same bytes; concurrent workflows must wait in line for room). The same
workflows at every rate and repetition (only the arrival times change), so text replay -
run once per stream kind - is the token reference of all of them. Each system starts every
stream with every cache empty; what the stream leaves cached is what serving lives on.

Per (stream, rate, repetition, system) a row: completed workflows per minute (first
arrival to last completion), p50/p95 latency (arrival to completion), mean TTFT, tokens
prefilled and the hit rate (1 - prefilled / text replay's prompt tokens), transfers,
evictions, failures, the CPU each process spent (``process_load``) - and the evidence of
where prefill went: tokens by operation and by worker, doc-level prefills of a document the
system had already prefilled in the stream (``repeat_prefill_tokens``: an eviction's regret,
or a copy rebuilt instead of moved), each placement's action, and how far each placement's
predicted finish was from the real one.
"""

from __future__ import annotations

import math
import random
import statistics
import os
import threading
import time

import dask.config

from ..flow.compiler import compile_workflow, group_by_prefix
from ..flow.executor import run_state_mode, run_text_mode
from ..flow.prompts import prompt_tokens
from ..keys import PREFILL_TOPIC
from ..stats import percentile
from . import local_engine as le
from .local_pool import group_need
from . import pressure_trace, process_load
from . import systems as S
from .common import Progress, log
from .exp7_why import rebuild_reasons
from .load_stream import build, doc_sequence, documents, gate_label, schedule
from .multiround import run_local_mode
from .prefill_ledger import ledger

SYSTEMS = ("local", "dkv")  # text replay runs once per stream kind, as the reference
STREAMS = ("uniform", "zipf", "zipf-budget")
SATURATED = 0.8  # completions / offered rate below this: the system is saturated
# the scheduler's counters a row records (``lineage_recomputes``: blocks Dask made again from
# lineage, e.g. evicted between a lookup that found them and the task that read them)
COUNTERS = ("transfers", "bytes_transferred", "evictions", "bytes_evicted", "evictions_regretted", "preemptions",
            "lineage_recomputes", "tokens_computed", "spills", "bytes_spilled", "bytes_read_back")


def peak_level_tokens(cw, outputs: dict[str, str], tokenizer, block_size: int) -> int:
    """The most KV tokens one level of a workflow holds at once when run alone: per group of
    agents sharing a prefix, the prefix once, then each agent's copy of the prefix's partial
    last block, its suffix and its answer (what both systems reserve: ``local_pool.group_need``,
    ``runtime.submit.Submitter.out_bytes``), and one block more per agent: a continuation of an
    earlier level's state copies that state's partial last block while the state itself stays
    pinned (a level 0.1 % over a floor without it was preempted until it gave up). No system can
    run the workflow in less; a budget below it fails the workflow (``outputs``: every agent's
    text, from a run of it)."""
    wf, most = cw.workflow, 0
    for names in cw.levels:
        prompts = {n: prompt_tokens(wf, wf.agents[n], outputs, tokenizer) for n in names}
        need = sum(group_need(g.prefix_len, 0, [len(prompts[m]) - g.prefix_len for m in g.members],
                              max(wf.agents[m].max_new_tokens for m in g.members), block_size, 1)
                   for g in group_by_prefix(prompts, block_size))
        most = max(most, need + block_size * len(names))
    return most


def _run_one(b: S.Bench, system: str, wf) -> dict:
    rt = b.rt
    cw = compile_workflow(wf, rt.tokenizer, rt.facts.max_positions, rt.block_size)
    if system == "local":
        out = run_local_mode(cw, b)
        return {"tokens": {n: a["tokens"] for n, a in out["agents"].items()},
                "first": [a["first_token_at"] for a in out["agents"].values()], "prefilled": sum(out["level_tokens"]),
                "prefills": out["prefills"], "decisions": {}, "gate_wait_s": out["gate_wait_s"]}
    res = run_text_mode(cw, rt) if system == "text" else run_state_mode(cw, rt)
    peak = peak_level_tokens(cw, {n: a.text for n, a in res.agents.items()}, rt.tokenizer, rt.block_size) \
        if system == "text" else None
    decisions: dict[str, int] = {}
    for a in res.agents.values():
        decisions[a.decision] = decisions.get(a.decision, 0) + 1
    return {"tokens": {n: a.tokens for n, a in res.agents.items()},
            "first": [a.first_token_at for a in res.agents.values()], "prefilled": sum(res.level_tokens_computed),
            "prefills": res.prefills, "decisions": decisions, "gate_wait_s": res.gate_wait_s,
            "redone": res.redone_tokens, "peak_level_tokens": peak,
            "plan_errors": [a.planned_finish_at - a.finished_at for a in res.agents.values() if a.planned_finish_at]}


def run_stream(benches: list[S.Bench], system: str, arrivals, docs: list[str], salt: str, max_new: int,
               timeout: float = 3600, build=build, run_one=None) -> list[dict]:
    """Every arrival in its own thread at its time; one record per workflow. ``build(arrival,
    document, salt, max_new)`` makes its workflow, ``run_one(bench, system, workflow)`` runs it
    (exp 7's own by default; ``bench.agent_tools`` gives its own)."""
    run_one = run_one or _run_one
    records: list[dict | None] = [None] * len(arrivals)
    t0 = time.time()

    def work(a):
        delay = t0 + a.at - time.time()
        if delay > 0:
            time.sleep(delay)
        arrived = time.time()
        try:
            out = run_one(benches[a.client], system, build(a, docs[a.doc], salt, max_new))
            records[a.index] = {"index": a.index, "doc": a.doc, "arrived": arrived, "done": time.time(), **out}
        except Exception as e:  # noqa: BLE001 -- recorded; the stream goes on
            records[a.index] = {"index": a.index, "doc": a.doc, "arrived": arrived, "done": math.nan,
                                "error": f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=work, args=(a,), name=f"exp7-wf{a.index}", daemon=True) for a in arrivals]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=max(1.0, t0 + timeout - time.time()))
    return [r if r is not None else {"index": a.index, "doc": a.doc, "error": "timeout"}
            for r, a in zip(records, arrivals)]


def evidence(records: list[dict]) -> dict:
    """Where the stream's prefill went: by operation, by worker, and doc-level prefills of a
    document already prefilled earlier in the stream (in arrival order of completion)."""
    by_op: dict[str, int] = {}
    by_worker: dict[str, int] = {}
    by_worker_op: dict[str, dict[str, int]] = {}  # beside each worker's ``prompt_by_op`` (process_load)
    seen: set[int] = set()
    repeat = 0
    for r in sorted((r for r in records if "error" not in r), key=lambda r: r["done"]):
        for p in r.get("prefills", ()):
            by_op[p["op"]] = by_op.get(p["op"], 0) + p["tokens"]
            by_worker[str(p["worker"])] = by_worker.get(str(p["worker"]), 0) + p["tokens"]
            ops = by_worker_op.setdefault(str(p["worker"]), {})
            ops[p["op"]] = ops.get(p["op"], 0) + p["tokens"]
            if p["op"] in ("materialize", "recompute") and p["level"] == 0:
                if r["doc"] in seen:
                    repeat += p["tokens"]
        seen.add(r["doc"])
    return {"prefill_by_op": by_op, "prefill_by_worker": by_worker, "prefill_by_worker_op": by_worker_op,
            "repeat_prefill_tokens": repeat}


def point(kind: str, rate: float, gate: float | None = None) -> str:
    """An exp 7 row's point: its stream and rate, and the workflow gate where there was one."""
    return f"{kind} {rate:g}/min" + gate_label(gate)


def _row(kind: str, rate: float, rep: int, system: str, records: list[dict], ref: dict | None, arrivals,
         text_tokens: int | None, counters: dict, budget: int | None, gate: float | None = None) -> dict:
    n = len(arrivals)
    ok = [r for r in records if "error" not in r]
    lat = sorted(r["done"] - r["arrived"] for r in ok)
    first = min((r["arrived"] for r in ok), default=math.nan)
    span = max((r["done"] for r in ok), default=math.nan) - first
    ttfts = [f - r["arrived"] for r in ok for f in r["first"]]
    offered = n / (arrivals[-1].at / 60.0) if arrivals[-1].at > 0 else math.inf
    per_min = len(ok) / span * 60.0 if span > 0 else math.nan
    wrong = None if ref is None else sum(r["tokens"] != ref.get(r["index"]) for r in ok)  # outputs that came back different
    agree = None if ref is None else wrong == 0 and len(ok) == n  # a failed workflow leaves nothing to vouch for
    prefilled = sum(r["prefilled"] for r in ok)
    decisions: dict[str, int] = {}
    for r in ok:
        for a, k in r.get("decisions", {}).items():
            decisions[a] = decisions.get(a, 0) + k
    plan = [abs(e) for r in ok for e in r.get("plan_errors", ())]
    return {
        "exp": "exp7", "point": point(kind, rate, gate), "stream": kind, "rate": rate, "rep": rep, "system": system,
        "workflow_gate": gate,  # running workflows per worker at most (None: no gate)
        # a block Dask keeps only as released lineage is prefilled again, planned, under a fresh
        # key (keys.rebuilt_key); rows without the field ran before that (Dask reran its producer)
        "released_blocks": "rebuilt",
        "gate_wait_mean_s": statistics.fmean([r.get("gate_wait_s", 0.0) for r in ok]) if ok else math.nan,
        "phase": "stream", "agree": agree, "wrong": wrong, "workflows": n, "completed": len(ok), "failed": n - len(ok),
        "errors": [r["error"] for r in records if "error" in r], "kv_budget_bytes": budget,
        "offered_per_min": offered, "completed_per_min": per_min,
        "saturated": bool(per_min < SATURATED * offered) if not math.isnan(per_min) else None,
        "wall_s": span, "latency_p50_s": percentile(lat, 0.5), "latency_p95_s": percentile(lat, 0.95),
        "latency_mean_s": statistics.fmean(lat) if lat else math.nan,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else math.nan,
        "shared_prefill_wall_s": None,  # workflows overlap and share contexts: no single start
        "tokens_prefilled": prefilled,
        "tokens_redone": sum(r.get("redone", 0) for r in ok),
        "hit_rate": _hit_rate(prefilled, text_tokens) if len(ok) == n else None,
        "decisions": decisions, "plan_error_median_s": statistics.median(plan) if plan else None,
        **{c: counters.get(c) for c in COUNTERS}, **evidence(records),
    }


def prefill_split(row: dict) -> dict:
    """A row's prefilled tokens by why they were prefilled, the same way for every system:
    ``repeat``: level-0 prefills of a document the stream had prefilled before (its copy was
    evicted, or rebuilt on another worker rather than moved); ``redone``: what attempts the
    budget preempted (or Dask failed) had prefilled, prefilled again; ``lineage``: tasks Dask
    ran again for blocks it had lost (``prefill_ledger``); ``first_time``: the rest."""
    repeat = int(row.get("repeat_prefill_tokens") or 0)
    redone = int(row.get("tokens_redone") or 0)
    lineage = sum((row.get("prefill_ledger") or {}).get("again", {}).values())
    total = int(row.get("tokens_prefilled") or 0)
    return {"first_time": max(0, total - repeat - redone - lineage), "repeat": repeat, "redone": redone,
            "lineage": lineage}


def _hit_rate(prefilled: int, text_tokens: int | None) -> float | None:
    """The share of text replay's prompt tokens a system did not prefill (None: no reference)."""
    return 1 - prefilled / text_tokens if text_tokens else None


def _count_computed(row: dict, text_tokens: int | None) -> None:
    """A daskflow-kv row's ``tokens_prefilled`` as its workers computed them, the definition
    every system's figure shares (``local`` counts what its workers feed: checked equal in
    the step loops' counts); what the workflows counted - the prefills they planned - stays
    as ``tokens_counted``. The two part by what Dask ran again from lineage (a block evicted,
    then read, reruns its whole producer task), the tokens lone parallel chunks computed
    twice, and requests cancelled mid-way (``prefill_ledger``, ``prompt_by_op``)."""
    if row.get("tokens_computed") is None:
        return
    dropped = sum(n for w in (row.get("prompt_by_op") or {}).values() for n in w.get("dropped", {}).values())
    row["tokens_counted"] = row["tokens_prefilled"]
    row["tokens_prefilled"] = row["tokens_computed"] + dropped
    if row.get("hit_rate") is not None:
        row["hit_rate"] = _hit_rate(row["tokens_prefilled"], text_tokens)


def _ledger(client, since: float) -> dict:
    """``prefill_ledger.ledger`` of the prefill events since ``since``; ``complete``: False
    when the scheduler's event log (a bounded deque) may have dropped some of them."""
    events = S.prefill_events(client, since)
    kept = client.get_events(PREFILL_TOPIC)
    full = len(kept) >= dask.config.get("distributed.admin.low-level-log-length")
    return ledger(events) | {"complete": not (full and kept[0][1].get("done_at", 0.0) >= since)}


def _counters(rt) -> dict:
    return dict(rt.counters()["counters"])


def _local_evictions(client) -> dict:
    return {"evictions": sum(c["evicted_states"] for c in client.run(le.stats).values()),
            "bytes_evicted": sum(c["evicted_bytes"] for c in client.run(le.stats).values())}


def budget_bytes(fraction: float, working_set: int, text_records: list[dict], bytes_per_token: int) -> int:
    """A stream's per-worker KV budget: ``fraction`` of its documents' KV, but never less than
    what its largest workflow level needs on its own (``peak_level_tokens``, from the text
    reference run): a workflow larger than the whole budget could never run, and would rightly fail."""
    one = max((r.get("peak_level_tokens") or 0 for r in text_records if "error" not in r), default=0)
    return max(int(fraction * working_set), one * bytes_per_token)


def exp7(b: S.Bench, rates, n: int, docs: int, context: int, max_new: int, systems, reps: int = 1,
         streams=STREAMS, budget_fraction: float = 0.25, zipf_s: float = 1.1, gates=(None,),
         progress: Progress | None = None) -> list[dict]:
    """Every stream kind at each rate (ascending, up to saturation), ``reps`` times per rate;
    each system once per workflow gate of ``gates`` (running workflows per worker, None: no
    gate), side by side in the same repetition."""
    from distributed import Client

    from ..runtime.kv_runtime import KVRuntime

    rt = b.rt
    systems = [s for s in SYSTEMS if s in systems]
    texts = documents(rt.tokenizer, docs, context)
    working_set = docs * context * rt.facts.bytes_per_token
    second = Client(rt.client.scheduler.address, set_as_default=False)
    rows: list[dict] = []
    # Only a run asked to compare gates sets the gate (and clears it after): otherwise the
    # cluster's own setting stands, whatever it is.
    manage_gate = any(g is not None for g in gates)
    try:
        rt2 = KVRuntime(second, rt.spec.model, dtype=rt.spec.dtype, block_size=rt.block_size)
        benches = [b, S.Bench(rt2, b.workers, b.router)]  # one router in front of both clients
        for kind in streams:
            doc_of = doc_sequence(n, docs, kind.removesuffix("-budget"), seed=7, s=zipf_s)
            salt = f"exp7-{kind}-{random.randrange(1 << 30)}"  # the same workflows at every rate and rep
            S.reset_caches(b)  # the reference: text replay, once per kind
            records = run_stream(benches, "text", schedule(n, min(rates), doc_of, seed=1), texts, salt, max_new)
            ref = {r["index"]: r["tokens"] for r in records if "error" not in r}
            text_tokens = sum(r["prefilled"] for r in records if "error" not in r)
            budget = budget_bytes(budget_fraction, working_set, records, rt.facts.bytes_per_token) \
                if kind.endswith("-budget") else None
            if progress:
                progress.step(f"exp7 {kind} text reference ({len(ref)}/{n} workflows)")
            for rate in sorted(rates):
                saturated = set()
                for rep in range(reps):
                    arrivals = schedule(n, rate, doc_of, seed=int(rate * 1000) + rep)
                    order = [(s, g) for s in systems for g in gates]
                    for system, gate in order if rep % 2 == 0 else order[::-1]:
                        rows.append(measure_row(benches, system, kind, rate, rep, arrivals, texts, salt, max_new, ref,
                                         text_tokens, budget, progress, gate, manage_gate))
                        if rows[-1]["saturated"]:
                            saturated.add(system)
                if saturated >= set(systems):
                    break  # every system saturated at this rate: higher rates add nothing
    finally:
        second.close()
    for x in benches:
        x.retain_bytes = le.DEFAULT_RETAIN
    rt.configure(unset_budget=True)
    S.reset_caches(b)
    return rows


def measure_row(benches, system, kind, rate, rep, arrivals, texts, salt, max_new, ref, text_tokens, budget, progress,
         gate=None, manage_gate=False):
    b = benches[0]
    rt = b.rt
    S.reset_caches(b)
    for x in benches:
        x.retain_bytes = budget if budget is not None else le.DEFAULT_RETAIN
    if budget is not None:
        rt.configure(kv_budget_bytes=budget)
    if manage_gate:
        rt.set_workflow_gate(gate)  # for both clients: the gate is the cluster's
    before = _counters(rt) if system == "dkv" else _local_evictions(b.client)
    for x in benches:  # the row's own plans only (the bench's runtimes: nothing else reads this log)
        x.rt.decisions.clear()
    load_before = process_load.snapshot(b.client)
    pressure_trace.start(b.client)
    t0 = time.time()
    records = run_stream(benches, system, arrivals, texts, salt, max_new)
    trace = pressure_trace.stop(b.client)
    load_after = process_load.snapshot(b.client)
    load = process_load.delta(load_before, load_after)
    if os.environ.get("DASKFLOW_KV_BENCH_STEP_SHAPES") == "1":
        load |= process_load.step_shapes(b.client, load_before, load_after)
    after = _counters(rt) if system == "dkv" else _local_evictions(b.client)
    if budget is not None:
        rt.configure(unset_budget=True)
    if manage_gate:
        rt.set_workflow_gate(None)
    delta = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in after}
    row = _row(kind, rate, rep, system, records, ref, arrivals, text_tokens, delta, budget, gate) | load
    row["pressure"] = pressure_trace.summarize(trace, budget, rt.block_size * rt.facts.bytes_per_token)
    if os.environ.get("DASKFLOW_KV_BENCH_TRACE"):  # the raw samples, for a look at one row's seconds
        row["pressure_trace"] = trace
    if system == "local":  # what the router priced with (refreshed at exp 7's start): a replay needs it
        row["router_profiles"] = b.router.priced_by()
    if system == "dkv":
        row["rebuild_reasons"] = rebuild_reasons(d for x in benches for d in list(x.rt.decisions))
        # what the workers reported computing, beside what the workflows counted
        row["prefill_ledger"] = _ledger(b.client, t0)
        _count_computed(row, text_tokens)
    row["prefill_split"] = prefill_split(row)
    if row["wrong"]:  # failures have their own line below
        log(f"  !! {system} outputs differ from text replay in exp7 {kind} at {rate:g}/min rep {rep}")
    if row["errors"]:
        log(f"  !! {system} {kind} {rate:g}/min rep {rep}: {len(row['errors'])} workflows failed: {row['errors'][0]}")
    if progress:
        progress.step(f"exp7 {row['point']} r{rep} {system} {row['completed_per_min']:.1f}/min "
                      f"p95 {row['latency_p95_s']:.1f}s prefilled {row['tokens_prefilled']} ({time.time() - t0:.0f}s)")
    return row
