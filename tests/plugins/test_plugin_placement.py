"""Placement through the real plugin on a real (in-process) scheduler and workers: the
queue the planner reads (busy seconds from predicted task times), a strict restriction to
a worker that died - or that stays paused - loosened so the task runs elsewhere, blocks only the cache wanted not
recomputed after their worker died, and the links of the ``kv_snapshot`` answer."""

from __future__ import annotations

import asyncio

import pytest
from distributed.utils_test import gen_cluster

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import PREFILL_TOPIC
from plugin_kit import (events, gate, kv_config, kv_value, login, passthrough, start_plugin, state_of,
                        submit_block, submit_compute, until, wait_at_gate, wanted_only_by_cache)

TWO_WORKERS = [("127.0.0.1", 1)] * 2


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_busy_seconds_are_the_predicted_times_of_the_kv_tasks_sent_to_a_worker(c, s, a, b):
    plugin = await start_plugin(s, evict_interval="50ms")
    token = await login(c)
    opened = gate("busy")
    try:
        first = submit_compute(c, token, a.address, wait_at_gate, "busy", predicted_s=5.0)
        second = submit_compute(c, token, a.address, kv_value, 10, predicted_s=3.0)
        await until(lambda: state_of(s, first.key) == state_of(s, second.key) == "processing",
                    what="both tasks to be sent to a")

        def busy(snap):
            return {w: snap["workers"][w]["busy_s"] for w in (a.address, b.address)}

        before = busy(await c.scheduler.kv_snapshot(session=token))
        assert 7.0 < before[a.address] <= 8.0  # 5 s + 3 s queued on its one thread, less what ran
        assert before[b.address] == 0.0
        await asyncio.sleep(0.3)
        later = busy(await c.scheduler.kv_snapshot(session=token))
        assert later[a.address] <= before[a.address] - 0.25  # time spent running comes off
        assert plugin.busy_seconds(a.address) == pytest.approx(later[a.address], abs=0.1)
    finally:
        opened.set()
    await asyncio.gather(first, second)
    await until(lambda: plugin.busy_seconds(a.address) == 0.0, what="a's queue to empty")


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_a_task_planned_for_a_worker_counts_there_while_it_waits_for_its_input(c, s, a, b):
    """A branch planned for b behind an input still being made on a is b's work already: the
    next plan must not see b as idle (and price a rebuild there as free compute)."""
    plugin = await start_plugin(s, evict_interval="50ms")
    token = await login(c)
    opened = gate("input")
    try:
        made = submit_compute(c, token, a.address, wait_at_gate, "input", predicted_s=1.0)
        waiting = submit_compute(c, token, b.address, kv_value, 10, made, predicted_s=4.0)
        await until(lambda: state_of(s, made.key) == "processing" and state_of(s, waiting.key) == "waiting",
                    what="the input to run on a and the branch to wait for it")
        assert plugin.busy_seconds(b.address) == pytest.approx(4.0)
        assert 0.0 < plugin.busy_seconds(a.address) <= 1.0
    finally:
        opened.set()
    await asyncio.gather(made, waiting)
    await until(lambda: plugin.busy_seconds(b.address) == 0.0, what="b's queue to empty")


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_a_strict_restriction_to_a_worker_that_died_is_loosened(c, s, a, b):
    plugin = await start_plugin(s, evict_interval="50ms")
    token = await login(c)
    opened = gate("dead")
    try:
        upstream = c.submit(wait_at_gate, "dead", nbytes=64, key="gate-dead", workers=[a.address], pure=False)
        placed = submit_compute(c, token, b.address, passthrough, upstream)
        await until(lambda: state_of(s, placed.key) == "waiting", what="the placed task to wait for its input")
        ts = s.tasks[placed.key]
        assert ts.worker_restrictions == {b.address} and di.is_strict(ts)  # no stealing while b lives

        await b.close()
        await until(lambda: b.address not in s.workers, what="the scheduler to remove b")
        assert not di.is_strict(ts)  # may now run anywhere
        [lost] = events(plugin, "worker-lost")
        assert lost["worker"] == b.address
    finally:
        opened.set()
    assert len(await placed) == 64  # without the plugin it would sit in no-worker for ever
    assert {ws.address for ws in s.tasks[placed.key].who_has} == {a.address}


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_blocks_only_the_cache_wanted_are_not_recomputed_when_their_worker_dies(c, s, a, b):
    plugin = await start_plugin(s, evict_interval="50ms")
    token = await login(c)
    kept = submit_block(c, token, b.address, 100)  # the client still holds this one
    cached = submit_block(c, token, b.address, 100)
    await asyncio.gather(kept, cached)
    cached_key = cached.key
    del cached
    await until(lambda: wanted_only_by_cache(s, cached_key), what="the client's release")

    await b.close()
    await until(lambda: events(plugin, "worker-lost"), what="the plugin to see b go")
    [lost] = events(plugin, "worker-lost")
    assert (lost["worker"], lost["dropped"]) == (b.address, 1)
    assert len(await kept) == 100  # wanted by the client: Dask recomputed it on a
    assert {ws.address for ws in s.tasks[kept.key].who_has} == {a.address}
    assert state_of(s, cached_key) in (None, "released", "forgotten")  # left in lineage, not recomputed
    assert cached_key not in a.data
    assert {e["key"] for e in events(plugin, "lost")} == {kept.key, cached_key}


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_the_snapshot_lists_links_with_their_probed_latency(c, s, a, b):
    await start_plugin(s, evict_interval="50ms")
    mine, theirs = await login(c, "mine"), await login(c, "theirs")
    x = c.submit(kv_value, 4_000_000, workers=[a.address], pure=False)  # over 1 MB: Dask measures it
    y = c.submit(len, x, workers=[b.address], pure=False)
    assert await y == 4_000_000
    await until(lambda: (a.address, b.address) in di.link_bandwidths(s), what="b's heartbeat with the bandwidth")
    measured = di.link_bandwidths(s)[(a.address, b.address)]
    await c.scheduler.kv_record_bandwidth(session=mine, src=b.address, dst=a.address, bandwidth=1e9, latency=0.002)

    snap = await c.scheduler.kv_snapshot(session=mine)
    assert sorted(map(tuple, snap["links"])) == sorted([(a.address, b.address, measured, None),
                                                        (b.address, a.address, 1e9, 0.002)])
    # the older "src->dst" entries say the same, until every client reads "links"
    assert snap["bandwidth"] == {f"{src}->{dst}": bw for src, dst, bw, _ in snap["links"]}
    assert snap["latency"] == {f"{b.address}->{a.address}": 0.002}
    other = await c.scheduler.kv_snapshot(session=theirs)  # a probe steers only its namespace's plans
    assert [tuple(link) for link in other["links"]] == [(a.address, b.address, measured, None)]
    assert other["latency"] == {}


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config(**{"workers.report-interval": "50ms"}))
async def test_a_prefill_batched_with_others_is_no_sample_for_the_profile_fit(c, s, a, b):
    plugin = await start_plugin(s, evict_interval="50ms")
    await login(c)

    def samples() -> int:
        return plugin.profiles.prefill_profiles().get(a.address, {}).get("samples", 0)

    clean = {"worker": a.address, "new_tokens": 64, "prefix_tokens": 0, "seconds": 0.01, "op": "calibrate"}
    await until(lambda: (a.log_event(PREFILL_TOPIC, clean), samples() > 0)[1], what="a's own sample")
    await asyncio.sleep(0.3)  # the ones still on their way
    n = samples()
    a.log_event(PREFILL_TOPIC, {**clean, "shared_steps": 3})  # its steps also fed other requests
    a.log_event(PREFILL_TOPIC, {**clean, "seconds": 0.02})  # sent after it on the same stream
    await until(lambda: samples() > n, what="the clean sample after it")
    assert samples() == n + 1  # the batched one was left out


# Dask's own memory monitor would resume b (its memory is low): the test pauses it by hand
@gen_cluster(client=True, nthreads=TWO_WORKERS, config={**kv_config(), "distributed.worker.memory.pause": False})
async def test_a_kv_task_placed_on_a_worker_that_stays_paused_runs_elsewhere(c, s, a, b, monkeypatch):
    """Dask pauses a worker whose process memory is over its pause threshold; when the model and
    its allocator keep it there, it never resumes - its strictly placed KV tasks must not wait
    for it (they run on a running worker, which fetches their inputs from the paused one)."""
    import distributed.core

    from daskflow_kv.plugins import kv_locality

    monkeypatch.setattr(kv_locality, "PAUSE_PATIENCE_S", 0.3)
    plugin = await start_plugin(s, evict_interval="50ms")
    token = await login(c)
    upstream = c.submit(kv_value, 64, workers=[b.address], pure=False)
    await upstream
    b.status = distributed.core.Status.paused
    await until(lambda: s.workers[b.address].status == distributed.core.Status.paused, what="b paused")
    placed = submit_compute(c, token, b.address, passthrough, upstream)
    assert len(await placed) == 64
    assert {ws.address for ws in s.tasks[placed.key].who_has} == {a.address}
    [ev] = events(plugin, "paused-worker")
    assert ev["workers"] == [b.address] and ev["rescheduled"] >= 1
