"""Per-worker KV byte budget on a real 2-process LocalCluster: eviction and recompute."""

import time

from conftest import CONTEXT, SUFFIXES, make_engine, wait_until

from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.transport.serialization import _SIZEOF_OVERHEAD
from daskflow_kv.keys import content_key, short_key

NEW = 4


def _worker_kv_bytes(client) -> dict[str, int]:
    """KV block bytes each worker holds, from the workers' own task states (not our counters)."""

    def held(dask_worker):
        return sum(ts.nbytes for key, ts in dask_worker.state.tasks.items()
                   if str(key).startswith("kvblock-") and ts.state == "memory")

    return client.run(held)


def _in_memory(client, keys) -> dict[str, bool]:
    return client.run_on_scheduler(
        lambda dask_scheduler, keys: {k: (k in dask_scheduler.tasks and dask_scheduler.tasks[k].state == "memory")
                                      for k in keys}, keys=list(keys))


def test_budget_evicts_released_states_keeps_live_ones_and_recomputes_identically(client):
    rt = KVRuntime(client, "tiny-llama", block_size=16)
    engine = make_engine("tiny-llama", block_size=16)
    a, b = sorted(client.scheduler_info()["workers"])
    block = 16 * rt.facts.bytes_per_token + _SIZEOF_OVERHEAD
    # A context and its continuation fit, even when the resume is planned before the context's
    # blocks are known and counts the whole prompt as new; all six contexts do not.
    budget = 14 * block
    rt.configure(kv_budget_bytes=budget)

    live = rt.materialize(rt.encode("Live state: keep me."), worker=a)  # referenced all along
    rt.wait([live])
    contexts = [rt.encode(f"Context number {i}. " + CONTEXT) for i in range(6)]  # ~6 blocks each
    outputs = {}
    for i, ctx in enumerate(contexts):
        s = rt.materialize(ctx, worker=(a, b)[i % 2])
        g = rt.resume(s, rt.encode(SUFFIXES[i % 4]), max_new_tokens=NEW, policy="pin")
        outputs[i] = g.tokens
        if i == 0:
            first_keys = s.state.block_keys
        rt.release(s)
        rt.release(g.state)
    total = sum(len(c) for c in contexts) * rt.facts.bytes_per_token
    assert total > 2 * budget  # the cached states really exceed the budget

    deadline = time.time() + 15
    while time.time() < deadline and max(_worker_kv_bytes(client).values()) > budget + block:
        time.sleep(0.1)
    held = _worker_kv_bytes(client)
    assert all(v <= budget + block for v in held.values()), (held, budget, block)
    # A live state is never evicted (its lookup lease expired long ago; its futures pin it).
    assert all(_in_memory(client, live.state.block_keys).values())
    counters = rt.counters()["counters"]
    assert counters["evictions"] > 0 and counters["bytes_evicted"] > 0
    evicts = [m for _, m in client.get_events("daskflow-kv") if isinstance(m, dict) and m.get("op") == "evict"]
    assert evicts and not {short_key(k) for k in live.state.block_keys} & {m["key"] for m in evicts}

    # An evicted prefix needed again is recomputed, and the output does not change.
    gone = [k for k, there in _in_memory(client, first_keys).items() if not there]
    assert gone, "the oldest context should have lost blocks to eviction"
    again = rt.materialize(contexts[0])
    ev = again.state.lineage[-1].as_dict()
    assert ev["tokens_computed"] > 0
    # Same content addresses as before; a block whose old key Dask still keeps as released
    # lineage (a cached continuation read it) comes back under a fresh key of that content.
    assert [content_key(k) for k in again.state.block_keys] == [content_key(k) for k in first_keys]
    g = rt.resume(again, rt.encode(SUFFIXES[0]), max_new_tokens=NEW)
    assert g.tokens == outputs[0] == engine.generate_text(contexts[0] + rt.encode(SUFFIXES[0]), NEW).tokens
    regretted = rt.counters()["counters"]["evictions_regretted"]
    assert regretted >= len(gone)  # each evicted block made again is an eviction the budget regrets
    rt.release(again)
    rt.release(g.state)

    deadline = time.time() + 15
    while time.time() < deadline and max(_worker_kv_bytes(client).values()) > budget + block:
        time.sleep(0.1)
    assert all(v <= budget + block for v in _worker_kv_bytes(client).values())
    rt.configure(unset_budget=True)


def _task_states(client, keys) -> dict:
    return client.run_on_scheduler(
        lambda dask_scheduler, keys: {k: (dask_scheduler.tasks[k].state if k in dask_scheduler.tasks else None)
                                      for k in keys}, keys=list(keys))


def test_a_block_dask_keeps_only_as_lineage_is_rebuilt_by_a_planned_prefill_under_a_fresh_key(client):
    """The context's partial last block is read by its continuation's prefill but listed by no
    live state: a flush lets it go, and Dask keeps it released (its reader's output is still
    needed). Materializing the context again prefills only that block's tokens, under a fresh
    Dask key of the same content - not Dask's rerun of the whole context's prefill."""
    rt = KVRuntime(client, "tiny-llama", block_size=16)
    engine = make_engine("tiny-llama", block_size=16)
    ctx = rt.encode(CONTEXT)
    assert len(ctx) % 16, "the context must end in a partial block"
    doc = rt.materialize(ctx)
    child = rt.extend(doc, rt.encode(SUFFIXES[0]))  # reads doc's partial block, lists a longer one
    rt.wait([child])
    tail = doc.state.block_keys[-1]
    assert tail not in child.state.block_keys
    rt.release(doc)
    before = rt.counters()["counters"]
    rt.configure(kv_budget_bytes=0)  # a flush: the cache lets go of every block no live state lists
    assert wait_until(lambda: _task_states(client, [tail])[tail] == "released"), _task_states(client, [tail])
    rt.configure(unset_budget=True)

    again = rt.materialize(ctx)
    rt.wait([again])
    ev = again.state.lineage[-1].as_dict()
    assert ev["tokens_computed"] == len(ctx) % 16  # only the block Dask let go, planned
    assert again.state.block_keys[:-1] == doc.state.block_keys[:-1]  # still held: shared as they were
    rebuilt = again.state.block_keys[-1]
    assert rebuilt != tail and content_key(rebuilt) == tail
    states = _task_states(client, [tail, rebuilt])
    assert states == {tail: "released", rebuilt: "memory"}  # the old key was not run again
    after = rt.counters()["counters"]
    assert after["lineage_recomputes"] == before["lineage_recomputes"]
    g = rt.resume(again, rt.encode(SUFFIXES[1]), max_new_tokens=NEW)
    assert g.tokens == engine.generate_text(ctx + rt.encode(SUFFIXES[1]), NEW).tokens
    # A later lookup finds the rebuilt block by its content.
    third = rt.materialize(ctx)
    assert third.state.block_keys == again.state.block_keys
    assert third.state.lineage[-1].as_dict()["tokens_computed"] == 0
    for s in (child, again, third, g.state):
        rt.release(s)
