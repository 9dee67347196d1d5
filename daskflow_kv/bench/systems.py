"""The systems compared, each run on the same cluster, model and prompts.

text       text replay / dense prefill: every agent prefills its whole prompt
           (``KVRuntime.generate_text``, what text passing between agents costs).
hf         the Hugging Face prefix-cache recipe, plain: per worker process, prefill the
           shared prompt once into a DynamicCache, ``copy.deepcopy`` it per branch and
           ``generate`` the branches one after another. Branches go round-robin.
local      what one vLLM/SGLang instance per worker gives: a per-worker engine with an
           automatic prefix cache and batched decode of the branches it serves together
           (``bench.local_engine``), behind a cache-aware router (``bench.router``). Nothing
           crosses workers: a worker that lacks the prefix prefills it.
dkv        daskflow-kv: materialize once, fork, ``resume_many(policy="auto")`` (the planner
           places branches by earliest finish: reuse, transfer or recompute per worker).
dkv-transfer / dkv-recompute   the same with the policy forced (optional).

Every system is timed the same way: TTFT is the agent's first sampled token (the worker's
``time.time()``) minus the workflow's start (the client's ``time.time()``, same host, same
clock), so queueing and any shared prefill are inside it. ``shared_ready_at`` is when the
first copy of the shared context existed to resume from (the workflow's start when it was
already cached); for text replay, which never holds the context alone, the end of the
first prompt prefill. In a cold run no first token can precede it.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field

from ..dask_internals import worker_addresses
from ..keys import PREFILL_TOPIC, holds_kv
from . import local_engine as le
from .common import busy_seconds
from . import worker_tasks as wt
from .router import CacheAwareRouter
from .workload import Workload

LOST_WORKER_POLL_S = 2.0  # how often a routed group's wait checks that its worker still lives
SYSTEMS = ("text", "hf", "local", "dkv")
OPTIONAL_SYSTEMS = ("dkv-transfer", "dkv-recompute")
LABELS = {
    "text": "text replay (dense prefill)",
    "hf": "HF prefix-cache recipe (deepcopy, sequential)",
    "local": "per-worker prefix cache + batched decode",
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
    shared_ready_at: float | None = None  # time.time() when the first copy of the shared context existed
    batched_branches: int = 1  # most branches one worker decoded together in one batch
    phase: str = "cold"  # cold | warm
    notes: str = ""

    def ttfts(self) -> list[float]:
        return [a.first_token_at - self.start for a in self.agents]

    @property
    def shared_prefill_wall_s(self) -> float:
        return math.nan if self.shared_ready_at is None else max(0.0, self.shared_ready_at - self.start)

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


@dataclass
class Bench:
    """What every runner needs: the runtime, the workers in order, the local router."""

    rt: object  # KVRuntime
    workers: list[str]
    router: CacheAwareRouter
    retain_bytes: int = le.DEFAULT_RETAIN  # K/V bytes each local engine keeps for reuse (its cache budget)

    @property
    def client(self):
        return self.rt.client


def make_bench(rt, workers: list[str]) -> Bench:
    """The bench context, its router fed with the runtime's measured prefill profiles."""
    view = rt.view()
    return Bench(rt, list(workers), CacheAwareRouter(workers, {w: view.profile(w) for w in workers}))


def refresh_router(b: Bench) -> None:
    view = b.rt.view()
    b.router.profiles = {w: view.profile(w) for w in b.workers}


def workers_of(client) -> list[str]:
    return worker_addresses(client)


def _busy(spans: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Model seconds per worker: the union of its requests' compute (batched ones overlap)."""
    return {w: busy_seconds(v) for w, v in spans.items()}


def first_ready(start: float, per_worker: list[dict]) -> float | None:
    """When the first copy of the prefix existed: the start if a worker already held it."""
    times = [start if o.get("prefix_tokens_computed", 1) == 0 else o["prefix_ready_at"] for o in per_worker]
    return min(times) if times else None


# -- the systems -----------------------------------------------------------------------------
def run_text(b: Bench, wl: Workload) -> SystemRun:
    rt, workers = b.rt, b.workers
    t0 = time.time()
    futs = [rt.generate_text(p, wl.max_new_tokens, stream=i, worker=workers[i % len(workers)])
            for i, p in enumerate(wl.prompts)]
    results = rt.client.gather(futs)
    wall = time.time() - t0
    agents, spans = [], {}
    for i, r in enumerate(results):
        m = r.metrics
        agents.append(AgentRun(i, r.worker, list(r.generated), m["first_token_at"], m["ttft_s"], m["decode_s"]))
        spans.setdefault(r.worker, []).append((m["first_token_at"] - m["load_s"] - m["prefill_s"],
                                               m["first_token_at"] + m["decode_s"] + m["export_s"]))
    compute = _busy(spans)
    bpt = rt.facts.bytes_per_token
    per_worker: dict[str, int] = {}
    for a, p in zip(agents, wl.prompts):
        per_worker[a.worker] = max(per_worker.get(a.worker, 0), bpt * (len(p) + wl.max_new_tokens))
    # Text replay never holds the context alone: its first copy exists when the first
    # prompt prefill (which contains it) ends, i.e. at the earliest first token.
    return SystemRun("text", t0, wall, agents, compute, 0.0, sum(len(p) for p in wl.prompts),
                     kv_accounted_bytes=sum(per_worker.values()),
                     shared_ready_at=min(a.first_token_at for a in agents))


def run_hf(b: Bench, wl: Workload) -> SystemRun:
    """The plain recipe: branches round-robin over the workers, decoded one after another."""
    rt, workers = b.rt, b.workers
    groups: dict[str, list] = {}
    for i, s in enumerate(wl.suffixes):
        groups.setdefault(workers[i % len(workers)], []).append((i, s))
    t0 = time.time()
    calls = [(w, (wt.hf_recipe, rt.spec, wl.prefix, branches, wl.max_new_tokens)) for w, branches in groups.items()]
    futs = [rt.client.submit(*args, workers=[w], allow_other_workers=False, pure=False) for w, args in calls]
    outs = [_result(b, w, f, args) for (w, args), f in zip(calls, futs)]
    wall = time.time() - t0
    agents, spans, shared, copied, kv, tokens = [], {}, 0.0, 0, 0, 0
    for out in outs:
        w = out["worker"]
        shared += out["prefix_prefill_s"]
        kv += out["peak_kv_bytes"]
        spans.setdefault(w, []).append((out["start"], out["prefix_ready_at"]))
        tokens += out["prefix_tokens_computed"]
        for br in out["branches"]:
            agents.append(AgentRun(br["index"], w, br["tokens"], br["first_token_at"], br["prefill_s"] + br["copy_s"],
                                   br["decode_s"]))
            spans[w].append((br["start"], br["stop"]))
            copied += br["copied_bytes"]
            tokens += br["tokens_computed"]
    compute = _busy(spans)
    agents.sort(key=lambda a: a.index)
    return SystemRun("hf", t0, wall, agents, compute, shared, tokens, kv_bytes_copied=copied, kv_accounted_bytes=kv,
                     shared_ready_at=first_ready(t0, outs))


def submit_local(b: Bench, prefix: list[int], suffixes: list[list[int]], max_new: int) -> list[tuple]:
    """Route one group over the local engines; [(worker, member indices, predicted s, future)]."""
    routes = b.router.route(prefix, suffixes, max_new)
    out = []
    for w, (idxs, predicted) in routes.items():
        args = (le.run_group, b.rt.spec, list(prefix), [(i, list(suffixes[i])) for i in idxs], max_new, b.retain_bytes)
        # strict: a loose restriction would let Dask's work stealing move a routed group
        fut = b.client.submit(*args, workers=[w], allow_other_workers=False, pure=False)
        out.append((w, idxs, predicted, fut, args))
    return out


def _result(b: Bench, w: str | None, fut, args) -> dict:
    """``fut``'s result; if its worker ``w`` leaves first (Dask's nanny restarts a worker past 95 % of
    its memory, under a new address), the group again on any live worker, its cache cold
    there. Pinned to the gone address, such a group waited forever and hung the stream
    (2026-12-06)."""
    while True:
        try:
            return fut.result(timeout=LOST_WORKER_POLL_S)
        except TimeoutError:
            if w is not None and w not in b.client.scheduler_info()["workers"]:
                fut.cancel()
                fut, w = b.client.submit(*args, pure=False), None  # unpinned now: wait for it as it is


def finish_local(b: Bench, prefix: list[int], suffixes: list[list[int]], submitted: list[tuple]) -> list[dict]:
    """Gather routed groups; tell the router what each worker now caches."""
    outs = []
    for w, idxs, predicted, fut, args in submitted:
        out = _result(b, w, fut, args)
        seqs = [list(prefix) + list(suffixes[br["index"]]) + br["tokens"][:-1] for br in out["branches"]]
        b.router.done(w, predicted, seqs)
        outs.append(out)
    return outs


def run_local(b: Bench, wl: Workload) -> SystemRun:
    t0 = time.time()
    outs = finish_local(b, wl.prefix, wl.suffixes, submit_local(b, wl.prefix, wl.suffixes, wl.max_new_tokens))
    wall = time.time() - t0
    agents, spans, shared, kv, tokens = [], {}, 0.0, 0, 0
    for out in outs:
        w = out["worker"]
        shared += out["prefix_prefill_s"]
        kv += out["peak_kv_bytes"]
        tokens += out["prefix_tokens_computed"]
        spans.setdefault(w, []).append((out["start"], out["stop"]))
        for br in out["branches"]:
            agents.append(AgentRun(br["index"], w, br["tokens"], br["first_token_at"], br["prefill_s"], br["decode_s"]))
            tokens += br["tokens_computed"]
    agents.sort(key=lambda a: a.index)
    return SystemRun("local", t0, wall, agents, _busy(spans), shared, tokens,
                     kv_bytes_copied=b.rt.facts.bytes_per_token * len(wl.prefix) * len(outs), kv_accounted_bytes=kv,
                     shared_ready_at=first_ready(t0, outs), batched_branches=max(len(o["branches"]) for o in outs))


def run_dkv(b: Bench, wl: Workload, policy: str = "auto", name: str = "dkv") -> SystemRun:
    rt = b.rt
    t0 = time.time()
    prefix = rt.materialize(wl.prefix)  # not waited for: the planner places branches meanwhile
    made = prefix.state.lineage[-1].as_dict()
    branches = rt.fork(prefix, wl.agents)
    gens = rt.resume_many(list(zip(branches, wl.suffixes)), wl.max_new_tokens, policy=policy)
    wall = time.time() - t0
    need_event = made.get("tokens_computed", 0) > 0
    events = prefill_events(rt.client, t0, prefix.state_id if need_event else None)
    agents, decisions, spans = [], {}, {}
    for e in events:
        spans.setdefault(e["worker"], []).append((e["done_at"] - e["task_seconds"], e["done_at"]))
    compute = _busy(spans)
    context = [e for e in events if e["state_id"] == prefix.state_id or e["op"] == "recompute"]
    shared = sum(e["seconds"] + e.get("load_seconds", 0.0) for e in context)
    ready = made_at(context)
    if not need_event:
        ready.append(t0)  # every token of the context was cached before the workflow started
    tokens = sum(e["new_tokens"] for e in events)
    for i, g in enumerate(gens):
        m = g.metrics
        agents.append(AgentRun(i, g.worker, list(g.tokens), m["first_token_at"], m["ttft_s"], m["decode_s"]))
        if m.get("tokens_reused", len(wl.prefix)) < len(wl.prefix):  # it prefilled the context itself
            ready.append(m["first_token_at"])
        if g.placement.first:
            decisions[g.placement.action] = decisions.get(g.placement.action, 0) + 1
    for g in gens:
        rt.release(g.state)
    for br in branches:
        rt.release(br)
    rt.release(prefix)
    del gens, branches, prefix
    gc.collect()
    batched = max((e.get("branches", 1) for e in events if e["op"] == "resume"), default=1)
    return SystemRun(name, t0, wall, agents, compute, shared, tokens, decisions=decisions,
                     shared_ready_at=min(ready) if ready else None, batched_branches=batched)


def made_at(events: list[dict]) -> list[float]:
    """When each state these prefill events made existed: its event's end, or for a parallel
    materialize (one event per chunk) its last chunk's."""
    done: dict[str, float] = {}
    for e in events:
        key = e["state_id"] if "chunk" in e else id(e)
        done[key] = max(done.get(key, 0.0), e["done_at"])
    return list(done.values())


def prefill_events(client, since: float, need: str | None = None, timeout: float = 5.0) -> list[dict]:
    """Prefill timings the workers reported (keys.PREFILL_TOPIC) that ended after
    ``since`` (their own wall clock), waiting until the event of state ``need`` is in."""
    deadline = time.time() + timeout
    while True:
        evs = [e for _, e in client.get_events(PREFILL_TOPIC)
               if e.get("op") != "calibrate" and e.get("done_at", 0.0) >= since]
        mine = [e for e in evs if e["state_id"] == need]
        # a parallel materialize reports once per chunk: wait for all of them
        done = mine and len(mine) >= mine[0].get("chunks", 1)
        if (need is None and evs) or done or time.time() > deadline:
            return evs
        time.sleep(0.05)


RUNNERS = {
    "text": run_text,
    "hf": run_hf,
    "local": run_local,
    "dkv": lambda b, wl: run_dkv(b, wl, "auto", "dkv"),
    "dkv-transfer": lambda b, wl: run_dkv(b, wl, "transfer", "dkv-transfer"),
    "dkv-recompute": lambda b, wl: run_dkv(b, wl, "recompute", "dkv-recompute"),
}


def reset_caches(b: Bench, timeout: float = 10.0) -> bool:
    """All caches empty, every system's (a cold start): KV blocks, local engines, HF prompts."""
    b.client.run(le.clear)
    b.client.run(wt.clear_hf)
    b.router.forget()
    return drain_kv(b.rt, timeout=timeout)


def prime(b: Bench, system: str, wl: Workload) -> None:
    """An earlier workflow over the same shared context (other questions, one token each):
    leaves the context cached wherever ``system`` itself would keep it."""
    if system != "text":
        RUNNERS[system](b, wl.primer())


# -- measurement wrapper ------------------------------------------------------------------------
def measured_run(b: Bench, system: str, wl: Workload, sample_memory: bool = True) -> SystemRun:
    """Run ``system`` with transfer logs cleared and memory samplers on; fills bytes and memory."""
    rt, client = b.rt, b.client
    client.run(wt.clear_transfer_log)
    if sample_memory:
        client.run(wt.start_sampler)
    try:
        run = RUNNERS[system](b, wl)
    finally:
        mem = client.run(wt.stop_sampler) if sample_memory else {}
    logs = client.run(wt.transfer_log)
    moved = 0
    for entries in logs.values():
        for e in entries:
            moved += sum(v for k, v in e["keys"].items() if holds_kv(k))
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
        settings = getattr(plugin, "settings", None)
        if settings is None or not hasattr(settings, "lease_seconds"):
            return False
        settings.lease_seconds = seconds  # the lease book reads it at each acquisition
        return True

    try:
        return bool(client.run_on_scheduler(_set))
    except Exception:  # noqa: BLE001 -- an optional speed-up for drains; never fatal
        return False
