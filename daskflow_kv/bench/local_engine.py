"""The ``local`` baseline on a worker: one ``Engine`` per worker process, kept between runs.

That is what one vLLM or SGLang instance gives on its own: an automatic prefix cache (the
engine's ``PrefixIndex``: a prompt reuses the longest prefix any earlier request left in
this process), batched decode of the branches it serves together (``resume_forks``: one
copy of the prefix), and continuous batching: its prefills and decodes run in the worker's
step loop (``runtime.step_worker``), the same one daskflow-kv's tasks use, so groups from
different workflows share forward steps there. Nothing crosses workers:
a worker without the prefix prefills it itself. States are kept for reuse, least recently
used first out, under a byte budget (``retain_bytes``), as a serving engine's cache does.

Functions here run inside Dask tasks (``run_group``) or through ``client.run`` (``clear``,
``cached_bytes``); the client side that routes groups to workers is ``bench.router``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..engine import Engine
from ..model.sampling import GREEDY
from ..runtime import step_worker, tasks

DEFAULT_RETAIN = 2 << 30  # bytes of K/V one worker's engine keeps for reuse


@dataclass(slots=True)
class LocalCache:
    """One worker's engine and the states it keeps for reuse."""

    engine: Engine  # shares the worker's loaded model (``tasks.get_runner``)
    kept: OrderedDict  # state id -> KVState, least recently used first
    retain_bytes: int  # evict past this many block bytes
    evicted_states: int = 0  # states dropped for the budget since start
    evicted_bytes: int = 0  # block bytes those drops freed

    def keep(self, *states) -> None:
        for st in states:
            self.kept[st.state_id] = st
            self.kept.move_to_end(st.state_id)
        while len(self.kept) > 1 and self.engine.store.nbytes > self.retain_bytes:
            _, old = self.kept.popitem(last=False)
            self.evicted_states += 1
            self.evicted_bytes += self.engine.release(old)

    def clear(self) -> None:
        while self.kept:
            self.engine.release(self.kept.popitem()[1])


_CACHES: dict[tasks.ModelSpec, LocalCache] = {}
_LOCK = threading.Lock()


def _cache(spec: tasks.ModelSpec, retain_bytes: int = DEFAULT_RETAIN) -> LocalCache:
    with _LOCK:
        c = _CACHES.get(spec)
        if c is None:
            runner = tasks.get_runner(spec)
            engine = Engine(runner=runner, steps=functools.partial(step_worker.run, runner))
            c = _CACHES[spec] = LocalCache(engine, OrderedDict(), retain_bytes)
        c.retain_bytes = retain_bytes
        return c


def clear(dask_worker=None) -> int:
    """Empty every engine's cache in this process (a cold start); returns bytes freed."""
    freed = 0
    with _LOCK:
        for c in _CACHES.values():
            before = c.engine.store.nbytes
            c.clear()
            freed += before - c.engine.store.nbytes
    from .worker_tasks import malloc_trim

    malloc_trim()
    return freed


def stats(dask_worker=None) -> dict:
    """What this process's engines evicted for their budget (``client.run``)."""
    with _LOCK:
        return {"evicted_states": sum(c.evicted_states for c in _CACHES.values()),
                "evicted_bytes": sum(c.evicted_bytes for c in _CACHES.values())}


def cached_bytes(dask_worker=None) -> int:
    with _LOCK:
        return sum(c.engine.store.nbytes for c in _CACHES.values())


def run_group(spec: tasks.ModelSpec, prefix: list[int], branches: list[tuple[int, list[int]]], max_new_tokens: int,
              retain_bytes: int = DEFAULT_RETAIN) -> dict:
    """``prefix`` from this engine's cache (prefilling what it lacks), then every (index,
    suffix) branch decoded as one batch. Times are wall clock (``time.time()``)."""
    from .worker_tasks import _worker_address

    c = _cache(spec, retain_bytes)
    eng = c.engine
    start = time.time()
    root = eng.materialize(list(prefix))
    prefix_ready = time.time()
    made = dict(root.lineage[-1].detail)
    gens = eng.resume_forks(root, [list(s) for _, s in branches], max_new_tokens, GREEDY,
                            streams=[i for i, _ in branches])
    stop = time.time()
    with _LOCK:  # groups of other workflows finish on other threads of this process
        c.keep(root, *(g.state for g in gens))
    stats = gens.stats
    out = [{"index": i, "tokens": list(g.tokens), "first_token_at": g.metrics.first_token_at,
            "prefill_s": g.metrics.prefill_s, "decode_s": g.metrics.decode_s, "tokens_computed": len(s)}
           for (i, s), g in zip(branches, gens)]
    return {
        "worker": _worker_address(), "start": start, "stop": stop, "prefix_ready_at": prefix_ready,
        "prefix_tokens_computed": int(made.get("tokens_computed", 0)),
        "prefix_tokens_reused": int(made.get("tokens_reused", 0)),
        "prefix_prefill_s": prefix_ready - start, "batch_load_s": stats.load_s if stats else 0.0,
        "peak_kv_bytes": eng.store.nbytes + (stats.kv_bytes if stats else 0), "branches": out,
    }


def engine_reference(spec: tasks.ModelSpec, prefix: list[int], suffixes: list[list[int]], max_new_tokens: int) -> dict:
    """The yardstick of warm TTFT: an in-process ``Engine`` resume of these branches (one
    batch) over ``prefix`` already materialized in this process. Only the resume is timed."""
    eng = Engine(runner=tasks.get_runner(spec))  # its own store: nothing shared with the local baseline
    root = eng.materialize(list(prefix))
    t0 = time.time()
    gens = eng.resume_forks(root, [list(s) for s in suffixes], max_new_tokens, GREEDY)
    ttfts = [g.metrics.first_token_at - t0 for g in gens]
    stats = gens.stats
    return {"ttfts": ttfts, "load_s": stats.load_s, "prefill_s": stats.prefill_s, "wall_s": time.time() - t0}
