"""What a stream under a KV budget did, second by second: busy and idle workers, waiting work, KV held.

Every worker samples itself every ``INTERVAL_S`` on a thread of its own (``worker_start``):
its step loops' busy seconds (the same counter as ``process_load``), requests running and
waiting in them, the KV blocks Dask holds in its memory (daskflow-kv's blocks, replicas and
prefill outputs; ``worker_tasks.held_kv_bytes``), the ``local`` baseline's pool (blocks cached,
bytes reserved for running groups, groups waiting for room) and the KV the step loops hold
while requests run (their working copy of prefixes and lanes, the same mechanism in both
systems). The scheduler samples what it holds back: per worker, KV tasks parked by the
budget's admission and ready to go (their inputs exist), and the runs waiting at the
workflow gate. All clocks are ``time.time()`` on one host.

From the samples (``summarize``), per worker:

* ``idle_waiting_s``: seconds the worker's step loops were idle while work waited for it -
  a parked task planned there, a ``local`` group waiting for room there, a request waiting
  to join its loop, or any run waiting at the gate (it may go to any worker);
* ``busy_s`` and ``span_s``: the loops' busy seconds and the sampled span;
* ``peak_kv_bytes``: the most KV blocks held at once (daskflow-kv: Dask's memory; ``local``:
  the pool's cache plus what it reserved for running groups), and ``peak_loop_kv_bytes``.
"""

from __future__ import annotations

import threading
import time

INTERVAL_S = 0.1  # how often a worker samples itself
KV_EVERY = 2  # walk Dask's KV keys every this many samples (it holds the GIL ~0.3 ms per 60 keys)
_STATE: dict = {}  # this process's sampler: {"stop": Event, "thread": Thread, "samples": list}
_SCHED: dict = {}  # the scheduler's sampler: {"callback": PeriodicCallback, "samples": list}


# -- the workers' side -------------------------------------------------------------------------------
def _loops() -> tuple[float, int, int, int]:
    """(busy seconds, running requests, waiting requests, working KV bytes) of this process's step loops."""
    from ..runtime.step_worker import engine_gauges

    return engine_gauges()


def worker_start(dask_worker=None, interval: float = INTERVAL_S) -> bool:
    """Start sampling this worker (a previous sampler is dropped)."""
    from . import local_engine as le
    from .worker_tasks import held_kv_bytes

    worker_stop()
    stop, samples = threading.Event(), []

    def loop():
        tick, kv = 0, 0
        while not stop.is_set():
            busy, running, waiting, loop_kv = _loops()
            if dask_worker is not None and tick % KV_EVERY == 0:
                kv = held_kv_bytes(dask_worker)
            pool = le.pool_gauges()
            samples.append((time.time(), busy, running, waiting, loop_kv, kv, *pool))
            tick += 1
            stop.wait(interval)

    th = threading.Thread(target=loop, name="daskflow-bench-pressure", daemon=True)
    _STATE.update(stop=stop, thread=th, samples=samples)
    th.start()
    return True


WORKER_FIELDS = ("t", "busy_s", "running", "waiting", "loop_kv", "dask_kv", "pool_cached", "pool_reserved",
                 "pool_waiting")


def worker_stop(dask_worker=None) -> list:
    """Stop sampling; the samples (tuples in ``WORKER_FIELDS`` order)."""
    if not _STATE:
        return []
    _STATE["stop"].set()
    _STATE["thread"].join(timeout=2)
    out = list(_STATE["samples"])
    _STATE.clear()
    return out


# -- the scheduler's side ----------------------------------------------------------------------------
def scheduler_start(dask_scheduler=None, interval: float = INTERVAL_S) -> bool:
    from tornado.ioloop import PeriodicCallback

    from ..keys import PLUGIN_NAME

    scheduler_stop(dask_scheduler)
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    samples: list = []

    def sample():
        if plugin is None or plugin.budget is None:
            return
        samples.append((time.time(), plugin.budget.parked_by_worker(), plugin.gate.waiting_runs(),
                        plugin.budget.counted_by_worker(), plugin.budget.waiting_heads()))

    cb = PeriodicCallback(sample, interval * 1000)
    _SCHED.update(callback=cb, samples=samples)
    cb.start()
    return True


def scheduler_stop(dask_scheduler=None) -> list:
    """Stop sampling; [(t, {worker: parked ready tasks}, runs waiting at the gate,
    {worker: (KV bytes the budget counts there, bytes reserved there)}, {worker: why its
    oldest waiting task waits})]."""
    if not _SCHED:
        return []
    _SCHED["callback"].stop()
    out = list(_SCHED["samples"])
    _SCHED.clear()
    return out


# -- both --------------------------------------------------------------------------------------------
def start(client) -> None:
    client.run(worker_start)
    client.run_on_scheduler(scheduler_start)


def stop(client) -> dict:
    return {"workers": client.run(worker_stop), "scheduler": client.run_on_scheduler(scheduler_stop)}


def _at(samples: list, t: float, i: int) -> tuple[int, object]:
    """Advance index ``i`` over time-sorted ``samples`` to the last one at or before ``t``."""
    while i + 1 < len(samples) and samples[i + 1][0] <= t:
        i += 1
    return i, samples[i] if samples and samples[i][0] <= t else None


def busy_spans(samples: list) -> list[tuple[float, float]]:
    """When the step loops were busy, from their busy-seconds counter: a loop adds a step's
    seconds when the step ends, so a rise of ``d`` seen at ``t`` is busy time ending by ``t``,
    taken as ``[t - d, t]`` (off by at most one sampling interval). Merged, time-sorted."""
    spans: list[list[float]] = []
    for prev, cur in zip(samples, samples[1:]):
        d = cur[1] - prev[1]
        if d <= 0:
            continue
        a, b = cur[0] - d, cur[0]
        if spans and a <= spans[-1][1]:
            spans[-1][0], spans[-1][1] = min(spans[-1][0], a), max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return [(a, b) for a, b in spans]


def uncovered(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    """Seconds of ``[a, b]`` no span covers."""
    covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans if y > a and x < b)
    return max(0.0, (b - a) - covered)


def summarize(trace: dict, budget: int | None = None, block_bytes: int | None = None) -> dict:
    """Per worker: idle seconds while work waited, busy seconds, span, peak KV held; and the
    whole row's idle share. ``budget``/``block_bytes``: also how far the peak went past the
    budget, in blocks (the budget's promise: by at most one)."""
    sched = sorted(trace.get("scheduler") or [], key=lambda s: s[0])
    out = {}
    for addr, samples in (trace.get("workers") or {}).items():
        samples = sorted(samples, key=lambda s: s[0])
        spans = busy_spans(samples)
        idle_waiting, j, k = 0.0, 0, 0
        for prev, cur in zip(samples, samples[1:]):
            if cur[0] <= prev[0]:
                continue
            j, s = _at(sched, prev[0], j)
            parked = 0 if s is None else s[1].get(addr, 0) + s[2]
            if parked + prev[3] + prev[8] > 0:
                while k < len(spans) and spans[k][1] < prev[0]:
                    k += 1  # spans end in time order: those before this interval are done with
                idle_waiting += uncovered(prev[0], cur[0], spans[k:k + 64])
        span = samples[-1][0] - samples[0][0] if samples else 0.0
        busy = samples[-1][1] - samples[0][1] if samples else 0.0
        peak_kv = max((max(s[5], s[6] + s[7]) for s in samples), default=0)
        row = {"idle_waiting_s": round(idle_waiting, 3), "busy_s": round(busy, 3), "span_s": round(span, 3),
               "peak_kv_bytes": int(peak_kv), "peak_loop_kv_bytes": int(max((s[4] for s in samples), default=0))}
        if budget and block_bytes:
            row["peak_over_budget_blocks"] = round(max(0, peak_kv - budget) / block_bytes, 2)
        out[addr] = row
    span = sum(r["span_s"] for r in out.values())
    return {"per_worker": out, "idle_waiting_share": round(sum(r["idle_waiting_s"] for r in out.values()) / span, 4)
            if span else None}
