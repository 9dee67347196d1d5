"""The scheduler lost mid-stream, then the stream resumed by a new cluster over the same store.

The cluster runs in a process of its own (a LocalCluster: scheduler in that process, workers
under nannies), so the scenario can SIGKILL the scheduler as a crash would. A client streams
workflows (RAG and debate over shared documents, ``load_stream.build``) in state mode with a
persistent store written through. Once ``kill_after_done`` workflows have finished, the
scheduler's process is SIGKILLed (its orphaned workers are left to notice). Recorded:

* every call in flight at the kill and the next calls (an RPC, a submit): how long after the
  kill each failed, the error's type and message, whether it names the lost scheduler - the
  target is every one within 30 s, none hanging;
* a new cluster over the same store, a new runtime: the workflows not finished are run
  again; for each, its first level's shared context: how many of its leading tokens the
  store held (the contexts of the workflows finished before the kill), how many were read
  from the store, how many prefilled - and of those, how many the store held (the target: 0);
* every workflow's tokens (finished before the kill, or after) against text replay on the
  new cluster.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from ..flow.compiler import compile_workflow, group_by_prefix
from ..flow.executor import run_state_mode
from ..flow.prompts import prompt_tokens
from ..state.blocks import common_prefix_len
from . import cluster_process
from .chaos import agent_tokens, run_flow
from .load_stream import Arrival, build, doc_sequence, documents

SALT = "scheduler-lost"  # the same prompts on both clusters: the store's keys match


def _context(wf, rt) -> tuple[str, list[int]]:
    """(an agent of the first level's first prefix group, that group's shared context as token ids)."""
    cw = compile_workflow(wf, rt.tokenizer, rt.facts.max_positions, rt.block_size)
    prompts = {n: prompt_tokens(wf, wf.agents[n], {}, rt.tokenizer) for n in cw.levels[0]}
    group = group_by_prefix(prompts, rt.block_size)[0]
    return group.members[0], prompts[group.members[0]][: group.prefix_len]


def _level0(res, agent: str) -> tuple[int, int, int]:
    """(tokens prefilled for ``agent``'s shared context, tokens read from the store, its length)."""
    ev = next(e for e in res.lineage[agent] if e["op"] == "materialize")
    return ev["tokens_computed"], ev.get("tokens_from_store", 0), ev["tokens_computed"] + ev["tokens_reused"]


def stored_prefix(ctx: list[int], stored: list[list[int]], block_size: int) -> int:
    """Leading tokens of ``ctx`` a store holding the contexts ``stored`` has: whole blocks of
    the longest common prefix, or all of it when it is one of them (its partial last block too)."""
    best = 0
    for other in stored:
        n = common_prefix_len(ctx, other)
        best = max(best, n if n == len(ctx) == len(other) else n // block_size * block_size)
    return best


def _failure(fn, killed_at: float, address: str) -> dict:
    """Run ``fn`` (a call after the kill); how long it took to fail and what it said."""
    try:
        fn()
        return {"failed": False, "after_kill_s": time.time() - killed_at}
    except Exception as e:  # noqa: BLE001 -- what the user would see
        return {"failed": True, "after_kill_s": time.time() - killed_at, "error": type(e).__name__,
                "message": str(e)[:300], "names_scheduler": address.split("://")[-1] in str(e)}


def run_scheduler_lost(store: str, model: str = "tiny-llama", workflows: int = 8, docs: int = 2,
                       context: int = 256, max_new: int = 8, kill_after_done: int = 3, workers: int = 2,
                       hang_s: float = 120.0, log=print, runtime_setup=None) -> dict:
    from distributed import Client

    from ..runtime.kv_runtime import KVRuntime

    setup = runtime_setup or (lambda rt: None)  # e.g. a what-if prefill rate (tests, tiny model)
    proc, address = cluster_process.start(workers, lambda m: log(f"scheduler-lost: {m}"))
    client = Client(address)
    rt = KVRuntime(client, model, block_size=16, kv_store=store)
    setup(rt)
    texts = documents(rt.tokenizer, docs, context)
    order = doc_sequence(workflows, docs, "uniform", seed=0)
    flows = [build(Arrival(i, 0.0, 0, order[i]), texts[order[i]], SALT, max_new) for i in range(workflows)]
    contexts = [_context(wf, rt) for wf in flows]
    done: dict[int, dict] = {}
    in_flight: dict[int, dict] = {}
    killed = threading.Event()

    def stream() -> None:
        for i, wf in enumerate(flows):
            if killed.is_set():
                return
            t = time.time()
            try:
                res = run_flow(rt, wf, "state")
                done[i] = {"tokens": agent_tokens(res), "level0": _level0(res, contexts[i][0]),
                           "latency_s": time.time() - t}
            except Exception as e:  # noqa: BLE001 -- the call in flight at the kill
                in_flight[i] = {"error": type(e).__name__, "message": str(e)[:300], "at": time.time(),
                                "names_scheduler": address.split("://")[-1] in str(e)}
                return

    th = threading.Thread(target=stream, daemon=True)
    th.start()
    while len(done) < kill_after_done and th.is_alive():
        time.sleep(0.05)
    flushed = set(done)  # a workflow finishing after this flush may not be stored: not counted as stored
    rt.flush_store(60)  # what finished is stored (a crash loses only writes in flight)
    os.kill(proc.pid, signal.SIGKILL)  # the scheduler's process: workers are left orphaned
    killed_at = time.time()
    killed.set()
    log(f"scheduler-lost: scheduler SIGKILLed after {len(done)} workflows")
    th.join(timeout=hang_s)
    hung = th.is_alive()
    for r in in_flight.values():
        r["after_kill_s"] = r.pop("at") - killed_at
    next_calls = {"rpc (counters)": _failure(rt.counters, killed_at, address),
                  "submit (materialize)": _failure(lambda: rt.wait([rt.materialize(rt.encode("after the kill"))],
                                                                   timeout=hang_s), killed_at, address)}
    client.close(timeout=5)
    cluster_process.end(proc)

    log("scheduler-lost: a new cluster over the same store resumes the stream")
    proc, address2 = cluster_process.start(workers, lambda m: log(f"scheduler-lost: {m}"))
    resumed: dict[int, dict] = {}
    try:
        with Client(address2) as client2:
            rt2 = KVRuntime(client2, model, block_size=16, kv_store=store)
            setup(rt2)
            for i, wf in enumerate(flows):
                if i in done:
                    continue
                t = time.time()
                res = run_state_mode(compile_workflow(wf, rt2.tokenizer, rt2.facts.max_positions, rt2.block_size), rt2)
                computed, from_store, length = _level0(res, contexts[i][0])
                held = stored_prefix(contexts[i][1], [contexts[j][1] for j in flushed], rt2.block_size)
                resumed[i] = {"tokens": agent_tokens(res), "latency_s": time.time() - t, "context": length,
                              "stored": held, "computed": computed, "from_store": from_store,
                              # what it prefilled although the store held it (the target: 0)
                              "prefilled_stored": max(0, computed - (length - held))}
            ref = {i: agent_tokens(run_flow(rt2, wf, "text")) for i, wf in enumerate(flows)}
    finally:
        cluster_process.end(proc)
    finished = {**done, **resumed}
    return {
        "workflows": workflows, "docs": docs, "context": context, "model": model, "workers": workers,
        "finished_before_kill": len(done), "in_flight_at_kill": list(in_flight.values()), "hung": hung,
        "next_calls": next_calls,
        "failures_within_30s": all(r["after_kill_s"] <= 30 for r in [*in_flight.values(), *next_calls.values()])
        and all(r["failed"] for r in next_calls.values()) and not hung,
        "resumed": len(resumed),
        "resumed_contexts": {i: {k: r[k] for k in ("context", "stored", "from_store", "computed", "prefilled_stored")}
                             for i, r in resumed.items()},
        "context_tokens_stored_before": sum(r["stored"] for r in resumed.values()),
        "context_tokens_from_store": sum(r["from_store"] for r in resumed.values()),
        "stored_tokens_prefilled_again": sum(r["prefilled_stored"] for r in resumed.values()),
        "resumed_latency_s": [round(r["latency_s"], 3) for r in resumed.values()],
        "latency_before_kill_s": [round(r["latency_s"], 3) for r in done.values()],
        "lost": workflows - len(finished),
        "wrong": sum(1 for i, r in finished.items() if r["tokens"] != ref[i]),
    }


