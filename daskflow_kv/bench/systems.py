"""The systems compared, each run on the same cluster, model and prompts.

text       text replay / dense prefill: every agent prefills its whole prompt
           (``KVRuntime.generate_text``, what text passing between agents costs).
hf         the Hugging Face prefix-cache recipe: per worker process, prefill the shared
           prompt once into a DynamicCache, ``copy.deepcopy`` it per branch, ``generate``.
local      local prefix reuse per worker: each worker prefills the shared prefix once and
           resumes its branches from it (a serving engine's local prefix cache); nothing
           crosses workers.
dkv        daskflow-kv: materialize once, fork, ``resume_many(policy="auto")`` (the cost
           model decides per destination worker whether to transfer or recompute).
dkv-transfer / dkv-recompute   the same with the policy forced (optional).

Branches are spread round-robin over the workers by every system (the KV runtime's planner
does the same, holder first). Each ``run_*`` returns a ``SystemRun``: per-agent tokens and
first-token times, model seconds per worker, bytes moved between workers, memory peaks.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from ..runtime import tasks
from . import worker_tasks as wt
from .workload import Workload

SYSTEMS = ("text", "hf", "local", "dkv")
OPTIONAL_SYSTEMS = ("dkv-transfer", "dkv-recompute")
LABELS = {
    "text": "text replay (dense prefill)",
    "hf": "HF prefix-cache recipe (deepcopy)",
    "local": "local prefix reuse per worker",
    "dkv": "daskflow-kv (auto)",
    "dkv-transfer": "daskflow-kv (transfer)",
    "dkv-recompute": "daskflow-kv (recompute)",
}


@dataclass
class AgentRun:
    index: int
    worker: str
    tokens: list[int]
    first_token_at: float  # absolute time.time() of the first generated token
    prefill_s: float  # this agent's own prefill (its suffix, or its whole prompt for text)
    decode_s: float


@dataclass
class SystemRun:
    system: str
    start: float  # time.time() when the workflow started
    wall_s: float
    agents: list[AgentRun]
    worker_compute_s: dict[str, float]  # model seconds per worker (prefills, copies, loads, decode)
    shared_prefill_s: float = 0.0  # the shared prefix's prefill(s), summed over workers
    tokens_prefilled: int = 0  # prompt tokens run through the model, all workers
    kv_bytes_copied: int = 0  # prefix bytes copied into per-branch caches (deepcopy / load)
    bytes_transferred: int = 0  # KV bytes moved worker to worker (transfer logs)
    decisions: dict[str, int] = field(default_factory=dict)  # dkv: action -> destinations
    memory: dict = field(default_factory=dict)  # per-worker sampler results
    kv_accounted_bytes: int = 0  # KV bytes live at peak, by accounting (not sampling)
    notes: str = ""

    def ttfts(self) -> list[float]:
        return [a.first_token_at - self.start for a in self.agents]

    @property
    def generated_tokens(self) -> int:
        return sum(len(a.tokens) for a in self.agents)

    @property
    def busiest_compute_s(self) -> float:
        return max(self.worker_compute_s.values(), default=0.0)

    @property
    def overhead_s(self) -> float:
        """Omega: wall time not spent in model compute on the busiest worker."""
        return self.wall_s - self.busiest_compute_s

    @property
    def prefill_s(self) -> float:
        return self.shared_prefill_s + sum(a.prefill_s for a in self.agents)

    @property
    def decode_s(self) -> float:
        return sum(a.decode_s for a in self.agents)

    def tokens(self) -> list[list[int]]:
        return [a.tokens for a in sorted(self.agents, key=lambda a: a.index)]


def workers_of(client) -> list[str]:
    return sorted(client.scheduler_info(n_workers=-1)["workers"])


def _task_starts(client, since: float) -> dict[str, float]:
    """key -> compute start (worker clock) from Dask's task stream."""
    out = {}
    for rec in client.get_task_stream(start=since - 1.0):
        for ss in rec.get("startstops", ()):
            if ss.get("action") == "compute":
                out[str(rec["key"])] = ss["start"]
    return out


# -- the systems -----------------------------------------------------------------------------
def run_text(rt, wl: Workload, workers: list[str]) -> SystemRun:
    t0 = time.time()
    futs = [rt.generate_text(p, wl.max_new_tokens, stream=i, worker=workers[i % len(workers)])
            for i, p in enumerate(wl.prompts)]
    results = rt.client.gather(futs)
    wall = time.time() - t0
    starts = _task_starts(rt.client, t0)
    agents, compute = [], {}
    for i, (f, r) in enumerate(zip(futs, results)):
        m = r.metrics
        start = starts.get(str(f.key), t0)
        agents.append(AgentRun(i, r.worker, list(r.generated), start + m["ttft_s"], m["ttft_s"], m["decode_s"]))
        compute[r.worker] = compute.get(r.worker, 0.0) + m["load_s"] + m["prefill_s"] + m["decode_s"] + m["export_s"]
    bpt = rt.facts.bytes_per_token
    per_worker: dict[str, int] = {}
    for a, p in zip(agents, wl.prompts):
        per_worker[a.worker] = max(per_worker.get(a.worker, 0), bpt * (len(p) + wl.max_new_tokens))
    return SystemRun("text", t0, wall, agents, compute, 0.0, sum(len(p) for p in wl.prompts),
                     kv_accounted_bytes=sum(per_worker.values()))


def _per_worker(workers: list[str], wl: Workload) -> dict[str, list[tuple[int, list[int]]]]:
    groups: dict[str, list] = {}
    for i, s in enumerate(wl.suffixes):
        groups.setdefault(workers[i % len(workers)], []).append((i, s))
    return groups


def _run_per_worker(rt, wl: Workload, workers: list[str], fn, name: str) -> SystemRun:
    t0 = time.time()
    futs = [rt.client.submit(fn, rt.spec, wl.prefix, branches, wl.max_new_tokens, workers=[w],
                             allow_other_workers=False, pure=False)
            for w, branches in _per_worker(workers, wl).items()]
    outs = rt.client.gather(futs)
    wall = time.time() - t0
    agents, compute, shared, copied, kv = [], {}, 0.0, 0, 0
    for out in outs:
        w = out["worker"]
        shared += out["prefix_prefill_s"]
        kv += out["peak_kv_bytes"]
        busy = out["prefix_prefill_s"]
        for b in out["branches"]:
            agents.append(AgentRun(b["index"], w, b["tokens"], b["first_token_at"],
                                   b["prefill_s"] + b.get("load_s", 0.0) + b.get("copy_s", 0.0), b["decode_s"]))
            busy += b["stop"] - b["start"]
            copied += b["copied_bytes"]
        compute[w] = compute.get(w, 0.0) + busy
    agents.sort(key=lambda a: a.index)
    tokens = len(wl.prefix) * len(outs) + sum(len(s) for s in wl.suffixes)
    return SystemRun(name, t0, wall, agents, compute, shared, tokens, kv_bytes_copied=copied,
                     kv_accounted_bytes=kv)


def run_hf(rt, wl: Workload, workers: list[str]) -> SystemRun:
    return _run_per_worker(rt, wl, workers, wt.hf_recipe, "hf")


def run_local(rt, wl: Workload, workers: list[str]) -> SystemRun:
    return _run_per_worker(rt, wl, workers, wt.local_prefix, "local")


def run_dkv(rt, wl: Workload, workers: list[str], policy: str = "auto", name: str = "dkv") -> SystemRun:
    client = rt.client
    t0 = time.time()
    prefix = rt.materialize(wl.prefix)
    rt.wait([prefix])  # as the executor does: branches are planned against placed blocks
    branches = rt.fork(prefix, wl.agents)
    gens = rt.resume_many(list(zip(branches, wl.suffixes)), wl.max_new_tokens, policy=policy)
    wall = time.time() - t0
    starts = _task_starts(client, t0)
    events = _prefill_events(client, t0)
    by_sid = {e["state_id"]: (ts, e) for ts, e in events}
    agents, decisions, compute = [], {}, {}
    shared = 0.0
    for ts, e in events:
        compute[e["worker"]] = compute.get(e["worker"], 0.0) + e["task_seconds"]
        if e["op"] in ("materialize", "recompute"):
            shared += e["seconds"] + e.get("load_seconds", 0.0)
    tokens = sum(e["new_tokens"] for _, e in events)
    for i, g in enumerate(gens):
        m = g.metrics
        sid = g.state.state_id
        start = starts.get(f"kvprefill-resume-{sid}")
        if start is None and sid in by_sid:  # event logged when the run ended
            ts, e = by_sid[sid]
            start = ts - e["task_seconds"]
        agents.append(AgentRun(i, g.worker, list(g.tokens), (start or t0) + m["ttft_s"], m["ttft_s"], m["decode_s"]))
        if g.placement.first:
            decisions[g.placement.action] = decisions.get(g.placement.action, 0) + 1
    for g in gens:
        rt.release(g.state)
    for b in branches:
        rt.release(b)
    rt.release(prefix)
    del gens, branches, prefix
    gc.collect()
    return SystemRun(name, t0, wall, agents, compute, shared, tokens, decisions=decisions)


def _prefill_events(client, since: float) -> list[tuple[float, dict]]:
    """Prefill timings the workers reported (runtime.tasks.PREFILL_TOPIC) since ``since``."""
    deadline = time.time() + 2.0
    while True:
        evs = [(ts, e) for ts, e in client.get_events(tasks.PREFILL_TOPIC) if ts >= since - 0.5]
        if evs or time.time() > deadline:
            return evs
        time.sleep(0.05)


RUNNERS = {
    "text": run_text,
    "hf": run_hf,
    "local": run_local,
    "dkv": lambda rt, wl, ws: run_dkv(rt, wl, ws, "auto", "dkv"),
    "dkv-transfer": lambda rt, wl, ws: run_dkv(rt, wl, ws, "transfer", "dkv-transfer"),
    "dkv-recompute": lambda rt, wl, ws: run_dkv(rt, wl, ws, "recompute", "dkv-recompute"),
}


# -- measurement wrapper ------------------------------------------------------------------------
def measured_run(rt, system: str, wl: Workload, workers: list[str], sample_memory: bool = True) -> SystemRun:
    """Run ``system`` with transfer logs cleared and memory samplers on; fills bytes and memory."""
    client = rt.client
    client.run(wt.clear_transfer_log)
    if sample_memory:
        client.run(wt.start_sampler)
    try:
        run = RUNNERS[system](rt, wl, workers)
    finally:
        mem = client.run(wt.stop_sampler) if sample_memory else {}
    logs = client.run(wt.transfer_log)
    moved = 0
    for entries in logs.values():
        for e in entries:
            moved += sum(v for k, v in e["keys"].items() if k.startswith(wt.KV_KEY_PREFIXES))
    run.bytes_transferred = moved
    run.memory = mem
    if system.startswith("dkv"):
        # Dask-held blocks (sampled) plus each worker's largest working cache inside a task
        peak_dask = sum(m.get("peak_kv", 0) for m in mem.values())
        bpt = rt.facts.bytes_per_token
        work: dict[str, int] = {}
        for a in run.agents:
            work[a.worker] = max(work.get(a.worker, 0), bpt * (len(wl.prompts[a.index]) + wl.max_new_tokens))
        run.kv_accounted_bytes = peak_dask + sum(work.values())
    return run


def drain_kv(rt, timeout: float = 40.0) -> bool:
    """Evict every cached KV block (budget 0 until the workers hold none), then lift the budget.

    Blocks a lookup leased stay pinned for the plugin's lease; ``shorten_lease`` makes that
    wait short for benchmarking. Returns whether all KV bytes were gone before ``timeout``.
    """
    gc.collect()
    rt.configure(kv_budget_bytes=0)
    deadline = time.time() + timeout
    ok = False
    try:
        while time.time() < deadline:
            if not any(rt.counters()["kv_bytes"].values()):
                ok = True
                break
            time.sleep(0.1)
    finally:
        rt.configure(unset_budget=True)
    return ok


def shorten_lease(client, seconds: float = 0.5) -> bool:
    """Benchmark-only: make the scheduler plugin's lookup lease short, so drains are quick."""

    def _set(dask_scheduler, seconds=seconds):
        plugin = dask_scheduler.plugins.get("daskflow-kv")
        if plugin is None or not hasattr(plugin, "lease_seconds"):
            return False
        plugin.lease_seconds = seconds
        return True

    try:
        return bool(client.run_on_scheduler(_set))
    except Exception:  # noqa: BLE001 -- an optional speed-up for drains; never fatal
        return False
