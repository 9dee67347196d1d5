"""Tiers from the workers' own reports, through the real plugin and a worker's real
SpillBuffer: a spilled block is shown as spilled and no longer counts against the budget;
a store write report marks a block persisted and counts it."""

from __future__ import annotations

import asyncio

from distributed.utils_test import gen_cluster

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import REPORT_OP
from daskflow_kv.store import worker_io
from plugin_kit import kv_config, login, start_plugin, submit_block, until

SPILLING = {"memory_limit": "1 GiB"}  # a worker with a memory limit keeps its data in a SpillBuffer


def _rows(rows: list[dict]) -> dict[str, dict]:
    return {r["block_key"]: r for r in rows}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, worker_kwargs=SPILLING,
             config=kv_config(**{"workers.report-interval": "50ms"}))
async def test_tiers_follow_the_workers_reports(c, s, a, b):
    plugin = await start_plugin(s, evict_interval="50ms")
    token = await login(c)
    first = submit_block(c, token, a.address, 3000)
    second = submit_block(c, token, a.address, 500, start=4, parent=first.key)
    await asyncio.gather(first, second)
    rows = _rows(await c.scheduler.kv_catalog(session=token))
    assert (rows[first.key]["tier"], rows[second.key]["tier"]) == ("memory", "memory")

    for _ in range(100):  # SpillBuffer.evict(): the least recently used key goes to disk
        if first.key in di.spilled_keys(a) or a.data.evict() < 0:
            break
    assert first.key in di.spilled_keys(a) and second.key not in di.spilled_keys(a)
    await until(lambda: plugin.tiers.spilled_on(first.key, a.address), what="a's report of its spilled block")
    rows = _rows(await c.scheduler.kv_catalog(session=token))
    assert (rows[first.key]["tier"], rows[second.key]["tier"]) == ("spilled", "memory")
    snap = await c.scheduler.kv_snapshot(session=token)
    assert snap["workers"][a.address]["kv_bytes"] == 500  # the budget counts memory, not the spill disk

    # a report from anyone but the worker is dropped: a client's, on its own stream, naming a; one
    # without a's token, on a's stream; then a store write as the worker's store writer reports it
    forged = {"op": REPORT_OP, "spilled": [second.key],
              "events": [{"op": "write", "written": True, "key": first.key, "nbytes": 1}]}
    di.send_on_stream(c, {**forged, "worker": a.address, "client": None, "token": None})
    di.send_to_scheduler_stream(a, {**forged, "token": "0" * 32})
    worker_io.report({"op": "write", "written": True, "key": second.key, "nbytes": 500})
    await until(lambda: plugin.catalog.blocks[second.key].persisted, what="the worker's own report")
    assert plugin.tiers.spilled_on(first.key, a.address) and not plugin.tiers.spilled_on(second.key, a.address)
    rows = _rows(await c.scheduler.kv_catalog(session=token))
    assert rows[second.key]["tier"] == "memory" and rows[second.key]["persisted"]
    assert not rows[first.key]["persisted"]
    counters = (await c.scheduler.kv_counters(session=token))["counters"]
    assert (counters["store_writes"], counters["store_bytes_written"]) == (1, 500)

    assert await first is not None  # the client's read, as a peer's, leaves it on a's disk
    assert first.key in di.spilled_keys(a)
    # and a peer asks for one key a message: a's spilled blocks are loaded to be sent one at a time
    await until(lambda: all(w.state.transfer_message_bytes_limit == 1 for w in (a, b)), what="the worker plugin")
    assert await c.submit(lambda kv: kv is not None, first, workers=[a.address], pure=False)
    # a task on a read it back: back in memory, and the next report says so
    await until(lambda: not plugin.tiers.spilled_on(first.key, a.address), what="a's report after the read")
    assert _rows(await c.scheduler.kv_catalog(session=token))[first.key]["tier"] == "memory"


def test_a_block_an_admitted_task_reads_back_counts_in_memory_until_it_is_read():
    from daskflow_kv.plugins.kv_tiers import TierTracker

    tiers = TierTracker(catalog=None, events=None)
    tiers.report("w", spilled=["k", "j"])
    tiers.mark_loaded("w", ["k"])  # admitted: its room is taken now
    tiers.report("w", spilled=["k", "j"])  # sent before the task read k: k must not count as on disk again
    assert not tiers.spilled_on("k", "w") and tiers.spilled_on("j", "w")
    tiers.report("w", spilled=["j"])  # read back
    tiers.report("w", spilled=["k", "j"])  # on disk again later (Dask's own spilling): believed
    assert tiers.spilled_on("k", "w")

    tiers.mark_loaded("w", ["j"])
    tiers.done_loading("w", ["j"])  # its reader left without reading it: the next report decides
    tiers.report("w", spilled=["k", "j"])
    assert tiers.spilled_on("j", "w")
    tiers.mark_loaded("w", ["k"])
    tiers.mark_spilled("w", ["k"])  # spilled again by the budget before it was read
    tiers.report("w", spilled=["k", "j"])
    assert tiers.spilled_on("k", "w")


def test_a_block_two_admitted_tasks_read_back_counts_in_memory_until_both_leave():
    from daskflow_kv.plugins.kv_tiers import TierTracker

    tiers = TierTracker(catalog=None, events=None)
    tiers.report("w", spilled=["k"])
    tiers.mark_loaded("w", ["k"])  # the first reader admitted
    assert tiers.loading_of("w", ["k", "j"]) == ["k"]
    tiers.mark_loaded("w", tiers.loading_of("w", ["k"]))  # a second one joins it
    tiers.done_loading("w", ["k"])  # the first left before it read k (preempted)
    tiers.report("w", spilled=["k"])  # a report sent before the second read it
    assert not tiers.spilled_on("k", "w")  # still the second reader's: its room is not given away
    tiers.done_loading("w", ["k"])
    tiers.report("w", spilled=["k"])
    assert tiers.spilled_on("k", "w") and tiers.loading_of("w", ["k"]) == []
