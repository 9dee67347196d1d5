"""Chaos during a stream: two clients stream workflows while worker processes are SIGKILLed.

A LocalCluster of worker processes under nannies (a killed worker is restarted by its
nanny, empty). Two clients, each with its own ``KVRuntime``, run RAG and debate workflows
over shared documents (``load_stream.build``), ``concurrency`` at a time each. A killer
thread SIGKILLs a random live worker every U(``kill_every``) seconds until the stream ends.

Every workflow is checked against text replay of the same workflow, run on the same
cluster before any kill. A workflow is *lost* if it raised, *wrong* if its tokens differ,
*hung* if it had not finished ``hang_s`` after it started (nothing may wait on a dead
worker). The record: per-workflow latency, the kills (when, which worker, what it held),
KV blocks lost and recomputed (the plugin's counters), and latency before vs after the
first kill.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass

from ..flow.compiler import compile_workflow
from ..flow.executor import run_state_mode, run_text_mode
from ..runtime.cluster import wait_for_restarts
from .load_stream import Arrival, build, doc_sequence, documents


@dataclass(frozen=True)
class ChaosConfig:
    workflows: int = 30  # per client
    docs: int = 3
    context: int = 160  # tokens per shared document
    max_new: int = 8
    concurrency: int = 4  # workflows in flight per client
    kill_every: tuple[float, float] = (5.0, 40.0)  # seconds between kills, uniform
    max_kills: int | None = None  # stop killing after this many (None: until the stream ends)
    hang_s: float = 180.0  # a workflow not done this long after it started counts as hung
    kill_after_done: int = 0  # the killer's clock starts once this many workflows finished (mid-stream)
    seed: int = 7


def agent_tokens(res) -> dict[str, list[int]]:
    return {n: list(a.tokens) for n, a in res.agents.items()}


def run_flow(rt, wf, mode: str):
    cw = compile_workflow(wf, rt.tokenizer, rt.facts.max_positions, rt.block_size)
    return run_text_mode(cw, rt) if mode == "text" else run_state_mode(cw, rt)


def _keys_held(dask_scheduler, a: str) -> int:
    ws = dask_scheduler.workers.get(a)
    return len(ws.has_what) if ws is not None else 0


class Killer(threading.Thread):
    """SIGKILLs a random worker process every U(lo, hi) seconds until stopped."""

    def __init__(self, client, every: tuple[float, float], max_kills: int | None, rng: random.Random):
        super().__init__(name="chaos-killer", daemon=True)
        self.client, self.every, self.max_kills, self.rng = client, every, max_kills, rng
        self.stop = threading.Event()
        self.go = threading.Event()  # set when the stream is far enough along to start killing
        self.kills: list[dict] = []
        self.errors: list[str] = []  # attempts that failed (workers restarting), for the record

    def run(self) -> None:
        t0 = time.time()
        while not self.go.wait(0.05):
            if self.stop.is_set():
                return
        while not self.stop.wait(self.rng.uniform(*self.every)):
            if self.max_kills is not None and len(self.kills) >= self.max_kills:
                return
            try:
                pids = self.client.run(os.getpid, wait=True)
                if len(pids) < 2:  # keep one worker alive: a cluster with none only waits
                    continue
                addr = self.rng.choice(sorted(pids))
                held = self.client.run_on_scheduler(_keys_held, a=addr)
                os.kill(pids[addr], signal.SIGKILL)
            except Exception as e:  # noqa: BLE001 -- workers restarting: try at the next tick
                self.errors.append(f"{type(e).__name__}: {e}"[:200])
                continue
            self.kills.append({"at_s": time.time() - t0, "worker": addr, "keys_held": held})


def run_chaos(cluster, clients: list, runtimes: list, cfg: ChaosConfig, log=print) -> dict:
    """The whole scenario on an existing cluster (``cluster.workers`` under nannies)."""
    rng = random.Random(cfg.seed)
    texts = documents(runtimes[0].tokenizer, cfg.docs, cfg.context)
    n = cfg.workflows * len(runtimes)
    docs = doc_sequence(n, cfg.docs, "zipf", seed=cfg.seed)
    arrivals = [Arrival(i, 0.0, i % len(runtimes), docs[i]) for i in range(n)]
    salt = f"chaos-{rng.randrange(1 << 30)}"
    flows = {a.index: build(a, texts[a.doc], salt, cfg.max_new) for a in arrivals}

    log(f"chaos: text replay of {n} workflows (the reference, no kills)")
    ref = {a.index: agent_tokens(run_flow(runtimes[a.client], flows[a.index], "text")) for a in arrivals}
    before = runtimes[0].counters()["counters"]

    killer = Killer(clients[0], cfg.kill_every, cfg.max_kills, rng)
    started: dict[int, dict] = {}  # index -> the workflow as it started (results: as it ended)
    t0 = time.time()
    killer.start()
    if cfg.kill_after_done <= 0:
        killer.go.set()
    log(f"chaos: streaming {n} workflows from {len(runtimes)} clients, killing a worker every "
        f"{cfg.kill_every[0]:g}-{cfg.kill_every[1]:g} s")

    def one(a: Arrival) -> dict:
        start = time.time()
        try:
            res = run_flow(runtimes[a.client], flows[a.index], "state")
            return {"index": a.index, "client": a.client, "start_s": start - t0, "latency_s": time.time() - start,
                    "agree": agent_tokens(res) == ref[a.index], "preemptions": res.preemptions,
                    "killed_worker_redos": res.killed_worker_redos}
        except Exception as e:  # noqa: BLE001 -- recorded: a lost workflow
            return {"index": a.index, "client": a.client, "start_s": start - t0, "latency_s": time.time() - start,
                    "error": f"{type(e).__name__}: {str(e)[:300]}"}

    # Daemon threads, ``concurrency`` per client: a hung workflow must not keep the process alive.
    results: dict[int, dict] = {}
    queues = [[a for a in arrivals if a.client == c] for c in range(len(runtimes))]
    lock = threading.Lock()

    def drain(queue: list[Arrival]) -> None:
        while True:
            with lock:
                if not queue:
                    return
                a = queue.pop(0)
                started[a.index] = {"index": a.index, "client": a.client, "start_s": time.time() - t0}
            out = one(a)
            with lock:
                results[a.index] = out
                if len(results) >= cfg.kill_after_done:
                    killer.go.set()

    threads = [threading.Thread(target=drain, args=(q,), daemon=True, name=f"chaos-client{c}-{j}")
               for c, q in enumerate(queues) for j in range(cfg.concurrency)]
    for th in threads:
        th.start()
    while any(th.is_alive() for th in threads):
        time.sleep(0.5)
        now = time.time() - t0
        with lock:
            stuck = [r for i, r in started.items() if i not in results and now - r["start_s"] > cfg.hang_s]
        if stuck:
            break  # a workflow waits past its budget: the scenario failed; the rest is reported as it stands
    killer.stop.set()
    wall = time.time() - t0
    waiting_on = _waiting_tasks(clients[0]) if len(results) < len(started) else []
    with lock:
        now = time.time() - t0
        for i, r in started.items():
            if i not in results:
                results[i] = {**r, "hung": now - r["start_s"] > cfg.hang_s,
                              "error": f"not done after {now - r['start_s']:.0f} s"}
        for a in arrivals:
            results.setdefault(a.index, {"index": a.index, "client": a.client, "error": "never started"})
    after = runtimes[0].counters()["counters"]
    out = summarize(list(results.values()), killer.kills, before, after, wall, cfg)
    out["waiting_on"] = waiting_on  # what the unfinished workflows' tasks were waiting on, if any
    out["kill_errors"] = killer.errors[:10]
    out["workers_back"] = wait_for_restarts(cluster)  # the cluster can close cleanly
    return out


def _waiting_tasks(client, most: int = 30) -> list[dict]:
    """The scheduler's unfinished KV tasks (state, restrictions, where they run or wait, whether
    admission holds them), then what admission holds and its last preemptions."""

    def look(dask_scheduler):
        from daskflow_kv.keys import HOLD_WORKER, PLUGIN_NAME

        plugin = dask_scheduler.plugins[PLUGIN_NAME]
        budget = plugin.budget
        alive = set(dask_scheduler.workers)
        rows = []
        for k, ts in dask_scheduler.tasks.items():
            if ts.state in ("memory", "released", "forgotten", "erred"):
                continue
            rows.append({"key": str(k)[:90], "state": ts.state,
                         "restrictions": sorted(ts.worker_restrictions or ()),
                         "restricted_to_dead": bool(ts.worker_restrictions) and HOLD_WORKER not in ts.worker_restrictions
                         and not (set(ts.worker_restrictions) & alive),
                         "loose": ts.loose_restrictions,
                         "admission": "held" if budget.is_held(k) else None,
                         "processing_on": ts.processing_on.address if ts.processing_on else None,
                         "waiting_on": [str(d.key)[:60] for d in (ts.waiting_on or ())][:3]})
        events = [e for e in plugin.event_log.events()
                  if e.get("op") in ("preempt", "relocate", "over-budget", "orphan-dropped")]
        held_kv = {}  # worker -> what KV it holds and who keeps it (a stalled budget's diagnosis)
        for addr, ws in dask_scheduler.workers.items():
            held_kv[addr] = [{"key": str(ts.key)[:70], "nbytes": ts.get_nbytes(),
                              "wanted_by": sorted(str(cs.client_key)[:24] for cs in ts.who_wants or ()),
                              "waiters": [str(w.key)[:60] for w in ts.waiters or ()][:3]}
                             for ts in ws.has_what if plugin.usage.is_kv(ts.key)][:40]
        return rows[:most] + [{"admission_snapshot": budget.snapshot(), "admission_events": events[-20:],
                               "kv_held": held_kv, "gate": plugin.gate.view()}]

    try:
        return client.run_on_scheduler(look)
    except Exception as e:  # noqa: BLE001 -- diagnostics only
        return [{"error": repr(e)}]


def summarize(records: list[dict], kills: list[dict], before: dict, after: dict, wall: float,
              cfg: ChaosConfig) -> dict:
    ok = [r for r in records if "error" not in r]
    first_kill = min((k["at_s"] for k in kills), default=None)
    calm = [r["latency_s"] for r in ok if first_kill is None or r["start_s"] + r["latency_s"] < first_kill]
    storm = [r["latency_s"] for r in ok if first_kill is not None and r["start_s"] + r["latency_s"] >= first_kill]

    def med(xs):
        return statistics.median(xs) if xs else None

    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("lineage_recomputes", "recomputes", "transfers",
                                                                "tokens_computed", "tokens_reused")}
    return {
        "config": {**cfg.__dict__, "kill_every": list(cfg.kill_every)},
        "workflows": len(records), "completed": len(ok),
        "wrong": sum(1 for r in ok if not r["agree"]),
        "lost": sum(1 for r in records if "error" in r and not r.get("hung")),
        "hung": sum(1 for r in records if r.get("hung")),
        "kills": kills, "wall_s": wall,
        "latency_median_s_before_first_kill": med(calm), "latency_median_s_after_first_kill": med(storm),
        "preemptions": sum(r.get("preemptions", 0) for r in ok),
        "killed_worker_redos": sum(r.get("killed_worker_redos", 0) for r in ok),
        "counters_delta": delta,
        "errors": sorted({r["error"] for r in records if "error" in r})[:10],
        "records": sorted(records, key=lambda r: r["index"]),
    }
