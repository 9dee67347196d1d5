"""The ``local`` baseline on a worker: one ``Engine`` per worker process, kept between runs.

That is what one vLLM or SGLang instance gives on its own: an automatic prefix cache (the
engine's ``PrefixIndex``: a prompt reuses the longest prefix any earlier request left in
this process), batched decode of the branches it serves together (``resume_forks``: one
copy of the prefix), and continuous batching: its prefills and decodes run in the worker's
step loop (``runtime.step_worker``), the same one daskflow-kv's tasks use, so groups from
different workflows share forward steps there. Nothing crosses workers:
a worker without the prefix prefills it itself. Its KV lives in a hard pool of
``retain_bytes`` (``local_pool``): running groups and the prefix cache together, a group
admitted when what it can write fits, least recently used cache evicted first, as a
serving engine's KV pool.

Functions here run inside Dask tasks (``run_group``) or through ``client.run`` (``clear``,
``cached_bytes``); the client side that routes groups to workers is ``bench.router``.
"""

from __future__ import annotations

import functools
import threading
import time

from ..engine import Engine
from ..model.sampling import GREEDY
from ..runtime import step_worker, tasks
from .local_pool import KVPool, group_need

DEFAULT_RETAIN = 2 << 30  # bytes of K/V one worker's engine holds (its pool) when no budget is set

_POOLS: dict[tasks.ModelSpec, KVPool] = {}
_LOCK = threading.Lock()


def _pool(spec: tasks.ModelSpec, pool_bytes: int = DEFAULT_RETAIN) -> KVPool:
    """This process's engine for ``spec``, behind its KV pool of ``pool_bytes``."""
    with _LOCK:
        p = _POOLS.get(spec)
        if p is None:
            runner = tasks.get_runner(spec)
            engine = Engine(runner=runner, steps=functools.partial(step_worker.run, runner))
            p = _POOLS[spec] = KVPool(engine, pool_bytes)
        p.budget = int(pool_bytes)
        return p


def clear(dask_worker=None) -> int:
    """Empty every engine's cache in this process (a cold start); returns bytes freed."""
    freed = 0
    with _LOCK:
        for p in _POOLS.values():
            before = p.engine.store.nbytes
            p.clear()
            freed += before - p.engine.store.nbytes
    from .worker_tasks import malloc_trim

    malloc_trim()
    return freed


def stats(dask_worker=None) -> dict:
    """What this process's engines evicted for their budget (``client.run``)."""
    with _LOCK:
        return {"evicted_states": sum(p.evicted_states for p in _POOLS.values()),
                "evicted_bytes": sum(p.evicted_bytes for p in _POOLS.values())}


def cached_bytes(dask_worker=None) -> int:
    with _LOCK:
        return sum(p.engine.store.nbytes for p in _POOLS.values())


def pool_gauges() -> tuple[int, int, int]:
    """This process's pools together: (bytes in their stores, bytes reserved, groups waiting)."""
    with _LOCK:
        pools = list(_POOLS.values())
    gauges = [p.gauges() for p in pools]
    return tuple(sum(g[i] for g in gauges) for i in range(3))


def run_group(spec: tasks.ModelSpec, prefix: list[int], branches: list[tuple[int, list[int]]], max_new_tokens: int,
              retain_bytes: int = DEFAULT_RETAIN) -> dict:
    """``prefix`` from this engine's cache (prefilling what it lacks), then every (index,
    suffix) branch decoded as one batch, once the pool (``retain_bytes``) has room for all
    the group can write. Times are wall clock (``time.time()``); ``start`` is when it was
    admitted, ``arrived`` when it asked."""
    from .worker_tasks import address_or_local

    pool = _pool(spec, retain_bytes)
    eng = pool.engine
    arrived = time.time()
    ticket = pool.admit(prefix, [len(s) for _, s in branches], max_new_tokens, eng.runner.bytes_per_token)
    made = []
    try:
        start = time.time()
        root = eng.materialize(list(prefix))
        made.append(root)
        prefix_ready = time.time()
        detail = dict(root.lineage[-1].detail)
        pool.published(ticket, group_need(len(prefix), int(detail.get("tokens_reused", 0)), [], 0, eng.block_size,
                                          eng.runner.bytes_per_token))
        gens = eng.resume_forks(root, [list(s) for _, s in branches], max_new_tokens, GREEDY,
                                streams=[i for i, _ in branches])
        made += [g.state for g in gens]
        stop = time.time()
    finally:
        pool.finish(ticket, *made)  # a failed group's states are cached too: the pool frees them by LRU
    stats = gens.stats
    out = [{"index": i, "tokens": list(g.tokens), "first_token_at": g.metrics.first_token_at,
            "prefill_s": g.metrics.prefill_s, "decode_s": g.metrics.decode_s, "tokens_computed": len(s)}
           for (i, s), g in zip(branches, gens)]
    return {
        "worker": address_or_local(), "arrived": arrived, "start": start, "stop": stop, "prefix_ready_at": prefix_ready,
        "prefix_tokens_computed": int(detail.get("tokens_computed", 0)),
        "prefix_tokens_reused": int(detail.get("tokens_reused", 0)),
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
