"""Dask's own spill-to-disk as the middle KV tier, on a worker whose memory limit is below
the working set: KV blocks spill, come back bit-exact, show as "spilled" in the catalog,
and the KV budget counts only the blocks still in memory."""

import logging

import dask
import pytest
import torch
from conftest import CONTEXT, SUFFIXES, make_engine, wait_until
from distributed import Client

from daskflow_kv import dask_internals as di
from daskflow_kv.runtime.cluster import local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime

MEMORY_LIMIT = 384 * 1024  # bytes per worker; the managed-memory target is half of it
# Spill by Dask's managed-memory target only: the process itself (torch, the model) is far
# above this limit, so the RSS-based spill/pause/terminate thresholds are switched off.
SPILL_ONLY = {"distributed.worker.memory.target": 0.5, "distributed.worker.memory.spill": False,
              "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": False}


@pytest.fixture(scope="module")
def spilling():
    with dask.config.set(SPILL_ONLY):
        cluster = local_cluster(n_workers=1, threads_per_worker=1, memory_limit=MEMORY_LIMIT, dashboard_address=":0",
                                silence_logs=logging.ERROR)
    with cluster, Client(cluster) as client:
        yield client



def _kv_memory(dask_worker):
    """(KV bytes in memory, KV bytes spilled) as the worker itself sees them."""
    fast = di.in_memory(dask_worker)
    slow = set(di.spilled_keys(dask_worker))
    nbytes = {k: ts.nbytes for k, ts in dask_worker.state.tasks.items() if str(k).startswith("kvblock-")}
    return sum(n for k, n in nbytes.items() if k in fast), sum(n for k, n in nbytes.items() if k in slow)


def test_blocks_spill_come_back_exact_and_the_budget_counts_memory_only(spilling):
    client = spilling
    [worker] = client.scheduler_info()["workers"]
    rt = KVRuntime(client, "tiny-llama", block_size=16, kv_budget_bytes="64MiB")  # a budget that evicts nothing
    engine = make_engine("tiny-llama", block_size=16)
    contexts = [rt.encode(f"Spill case {i}. " + " ".join([CONTEXT] * 4)) for i in range(3)]
    states = [rt.materialize(ctx) for ctx in contexts]
    rt.wait(states)
    working_set = sum(s.nbytes for s in states)
    assert working_set > MEMORY_LIMIT  # the blocks cannot all stay in memory

    assert wait_until(lambda: client.run(_kv_memory)[worker][1] > 0)  # some KV blocks went to disk
    rows = lambda: rt.catalog().to_pylist()  # noqa: E731
    assert wait_until(lambda: {"spilled", "memory"} <= {r["tier"] for r in rows()}), {r["tier"] for r in rows()}

    # The budget counts what is in memory, not what Dask moved to disk.
    def counted_equals_memory():
        in_memory, spilled = client.run(_kv_memory)[worker]
        return rt.counters()["kv_bytes"][worker] == in_memory and spilled > 0

    assert wait_until(counted_equals_memory)
    assert rt.counters()["kv_bytes"][worker] < working_set

    # Spilled blocks come back bit-exact (read from the spill file), and resume from them.
    for ctx, s in zip(contexts, states):
        ref = engine.materialize(ctx)
        assert ref.block_keys == s.state.block_keys
        got = client.gather(list(s.futures))
        assert all(torch.equal(g, engine.store.get(k)) for g, k in zip(got, ref.block_keys))
        g = rt.resume(s, rt.encode(SUFFIXES[3]), max_new_tokens=5, policy="pin")
        assert g.tokens == engine.generate_text(ctx + rt.encode(SUFFIXES[3]), 5).tokens
        engine.release(ref)
    for s in states:
        rt.release(s)
