"""Exp 7: a stream of workflows on one cluster, from two clients, at several arrival rates.

``n`` workflows over ``docs`` shared documents arrive as a Poisson process of ``rate``
workflows per minute (the same seeded schedule for every system), alternately from two
clients, each workflow in its own thread as soon as it arrives. Even-numbered workflows
are RAG (3 readers, then a synthesizer), odd ones a debate (2 debaters x 2 rounds, then a
moderator). Every prompt starts with the same system line and its document, then the
workflow's own question, so workflows over one document share that prefix and nothing
more. Each system starts the stream with every cache empty; what the stream itself leaves
cached is what serving systems live on.

Per (system, rate): completed workflows per minute (from the first arrival to the last
completion), p50/p95 workflow latency (arrival to completion), mean TTFT (an agent's first
token from its workflow's arrival), tokens prefilled. Rates go up until a system saturates
(completions fall under ``SATURATED`` of the offered rate); later rates skip it. The
workflows are the same at every rate (only the schedule changes), so text replay's tokens
at the first rate are the reference at all of them.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from dataclasses import dataclass

from ..flow.compiler import compile_workflow
from ..flow.executor import run_state_mode, run_text_mode
from ..flow.workflow import Workflow
from ..workflows.common import corpus_document
from . import systems as S
from .common import Progress, log
from .multiround import run_local_mode

SYSTEMS = ("text", "local", "dkv")
SATURATED = 0.8  # completions / offered rate below this: the system is saturated
ASPECTS = ["costs", "risks", "the main claim", "what to measure"]


@dataclass
class Arrival:
    index: int  # workflow number
    at: float  # seconds after the stream's start
    client: int  # 0 or 1
    doc: int  # which shared document


def schedule(n: int, rate_per_min: float, docs: int, seed: int = 0) -> list[Arrival]:
    """Poisson arrivals (exponential gaps), the first at 0; clients and documents alternate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(Arrival(i, t, i % 2, i % docs))
        t += rng.expovariate(rate_per_min / 60.0)
    return out


def documents(tokenizer, docs: int, context: int) -> list[str]:
    return [corpus_document(context, tokenizer, start=5 * j) for j in range(docs)]


def build(a: Arrival, doc: str, salt: str, max_new: int) -> Workflow:
    wf = Workflow(f"load{a.index}", system=f"Session {salt}. You are one of several agents working on a shared document.")
    wf.context("document", doc, title="Document")
    tag = f"Request {a.index}."
    if a.index % 2 == 0:  # RAG: readers, then a synthesizer
        readers = []
        for r in range(3):
            readers.append(wf.agent(f"reader{r}", f"{tag} Answer from the document, focusing on {ASPECTS[r]}.",
                                    reads=["document"], max_new_tokens=max_new))
        wf.agent("synthesizer", f"{tag} Combine the answers into one.", reads=["document", *readers], merge="text",
                 max_new_tokens=max_new)
    else:  # debate: two rounds of two debaters, then a moderator
        said: list[str] = []
        for r in range(2):
            now = [wf.agent(f"d{d}_r{r}", f"{tag} Round {r + 1}: argue {'for' if d == 0 else 'against'} the "
                            "document's main claim.", reads=["document", *said], max_new_tokens=max_new)
                   for d in range(2)]
            said += now
        wf.agent("moderator", f"{tag} Who argued better?", reads=["document", *said], merge="text",
                 max_new_tokens=max_new)
    return wf


def _run_one(b: S.Bench, system: str, wf) -> dict:
    rt = b.rt
    cw = compile_workflow(wf, rt.tokenizer, rt.facts.max_positions, rt.block_size)
    if system == "text":
        res = run_text_mode(cw, rt)
    elif system == "dkv":
        res = run_state_mode(cw, rt)
    else:
        out = run_local_mode(cw, b)
        return {"tokens": {n: a["tokens"] for n, a in out["agents"].items()},
                "first": [a["first_token_at"] for a in out["agents"].values()], "prefilled": sum(out["level_tokens"])}
    return {"tokens": {n: a.tokens for n, a in res.agents.items()},
            "first": [a.first_token_at for a in res.agents.values()], "prefilled": sum(res.level_tokens_computed)}


def run_stream(benches: list[S.Bench], system: str, arrivals: list[Arrival], docs: list[str], salt: str,
               max_new: int, timeout: float = 1800) -> list[dict]:
    """Every arrival in its own thread at its time; one record per workflow."""
    records: list[dict] = [None] * len(arrivals)  # type: ignore[list-item]
    t0 = time.time()

    def work(a: Arrival):
        delay = t0 + a.at - time.time()
        if delay > 0:
            time.sleep(delay)
        arrived = time.time()
        try:
            out = _run_one(benches[a.client], system, build(a, docs[a.doc], salt, max_new))
            records[a.index] = {"index": a.index, "arrived": arrived, "done": time.time(), **out}
        except Exception as e:  # noqa: BLE001 -- recorded; the stream goes on
            records[a.index] = {"index": a.index, "arrived": arrived, "done": math.nan,
                                "error": f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=work, args=(a,), name=f"exp7-wf{a.index}", daemon=True) for a in arrivals]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=max(1.0, t0 + timeout - time.time()))
    return [r if r is not None else {"index": a.index, "error": "timeout"} for r, a in zip(records, arrivals)]


def _row(system: str, rate: float, n: int, records: list[dict], ref: dict | None, arrivals: list[Arrival]) -> dict:
    ok = [r for r in records if "error" not in r]
    lat = sorted(r["done"] - r["arrived"] for r in ok)
    first = min((r["arrived"] for r in ok), default=math.nan)
    span = max((r["done"] for r in ok), default=math.nan) - first
    ttfts = [f - r["arrived"] for r in ok for f in r["first"]]
    offered = n / (arrivals[-1].at / 60.0) if arrivals[-1].at > 0 else math.inf
    per_min = len(ok) / span * 60.0 if span > 0 else math.nan
    agree = None if ref is None else all(r["tokens"] == ref.get(r["index"]) for r in ok) and len(ok) == n
    return {
        "exp": "exp7", "rate": rate, "system": system, "phase": "stream", "agree": agree, "workflows": n,
        "completed": len(ok), "errors": [r["error"] for r in records if "error" in r],
        "offered_per_min": offered, "completed_per_min": per_min,
        "saturated": bool(per_min < SATURATED * offered) if not math.isnan(per_min) else None,
        "wall_s": span, "latency_p50_s": _pct(lat, 0.5), "latency_p95_s": _pct(lat, 0.95),
        "latency_mean_s": statistics.fmean(lat) if lat else math.nan,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else math.nan,
        "shared_prefill_wall_s": None,  # workflows overlap and share contexts: no single start
        "tokens_prefilled": sum(r["prefilled"] for r in ok),
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    i = q * (len(xs) - 1)
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def exp7(b: S.Bench, rates, n: int, docs: int, context: int, max_new: int, systems,
         progress: Progress | None = None) -> list[dict]:
    """The stream at each rate, for each system (text first: its tokens are the reference)."""
    from distributed import Client

    from ..runtime.kv_runtime import KVRuntime

    rt = b.rt
    systems = [s for s in ("text", "local", "dkv") if s in systems]
    texts = documents(rt.tokenizer, docs, context)
    second = Client(rt.client.scheduler.address, set_as_default=False)
    rows: list[dict] = []
    try:
        rt2 = KVRuntime(second, rt.spec.model, dtype=rt.spec.dtype, block_size=rt.block_size)
        benches = [b, S.Bench(rt2, b.workers, b.router)]  # one router in front of both clients
        saturated: set[str] = set()
        salt = f"exp7-{random.randrange(1 << 30)}"  # the same workflows at every rate: one reference
        ref = None
        for rate in sorted(rates):
            arrivals = schedule(n, rate, docs, seed=int(rate * 1000))
            for system in systems:
                if system in saturated:
                    continue
                S.reset_caches(b)
                t0 = time.time()
                records = run_stream(benches, system, arrivals, texts, salt, max_new)
                if system == "text" and ref is None:
                    ref = {r["index"]: r["tokens"] for r in records if "error" not in r}
                row = _row(system, rate, n, records, ref, arrivals)
                rows.append(row)
                if row["agree"] is False:
                    log(f"  !! {system} outputs differ from text replay in exp7 at rate {rate:g}/min")
                if row["errors"]:
                    log(f"  !! {system} at rate {rate:g}/min: {len(row['errors'])} workflows failed: {row['errors'][0]}")
                if row["saturated"]:
                    saturated.add(system)
                if progress:
                    progress.step(f"exp7 {rate:g}/min {system} {row['completed_per_min']:.1f}/min "
                                  f"p95 {row['latency_p95_s']:.1f}s ({time.time() - t0:.0f}s)")
    finally:
        second.close()
    S.reset_caches(b)
    return rows
