"""The KV byte budget through the real plugin on a real (in-process) scheduler and workers:
admission parks a KV task until there is room, eviction follows the score and cuts chains
from the end, a lease keeps a looked-up block, a task that can never fit fails at once."""

from __future__ import annotations

import asyncio
import time

import pytest
from distributed import wait
from distributed.utils_test import gen_cluster

from daskflow_kv import dask_internals as di
from daskflow_kv.errors import KVBudgetError, KVPreempted
from plugin_kit import (events, gate, kv_config, kv_value, login, start_plugin, submit_block, submit_compute,
                        state_of, until, wait_at_gate, wanted_only_by_cache)

TWO_WORKERS = [("127.0.0.1", 1)] * 2
PATIENT = kv_config(**{"scheduler.admission-patience": "60s"})  # parked tasks wait, never time out here


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_admission_parks_a_kv_task_under_the_budget_and_admits_it_when_room_is_made(c, s, a, b):
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    block = submit_block(c, token, a.address, 800)
    await block
    key = block.key

    task = submit_compute(c, token, a.address, kv_value, 500, kv_out=500, predicted_s=2.0)
    await until(lambda: state_of(s, task.key) == "no-worker", what="the task to be parked")
    await asyncio.sleep(0.5)  # ten periodic checks: the client's block is pinned, so it stays parked
    assert state_of(s, task.key) == "no-worker"
    assert plugin.budget.awaiting_admission(task.key)
    snap = await c.scheduler.kv_snapshot(session=token)
    assert snap["workers"][a.address]["kv_bytes"] == 800
    assert snap["workers"][a.address]["busy_s"] == pytest.approx(2.0)  # parked for a: it will run there
    assert snap["workers"][b.address]["busy_s"] == 0.0
    assert not events(plugin, "evict")

    del block  # the client lets go; only the cache keeps the block, which the budget may now evict
    await until(lambda: wanted_only_by_cache(s, key) or key not in s.tasks, what="the client's release")
    out = await task
    assert len(out) == 500
    assert {ws.address for ws in s.tasks[task.key].who_has} == {a.address}  # where the plan sent it
    assert [(e["key"], e["worker"], e["nbytes"]) for e in events(plugin, "evict")] == [(key, a.address, 800)]
    assert key not in a.data
    counters = (await c.scheduler.kv_counters(session=token))["counters"]
    assert (counters["evictions"], counters["bytes_evicted"]) == (1, 800)
    assert not plugin.budget.is_held(task.key)  # finished: nothing reserved any more
    assert (await c.scheduler.kv_snapshot(session=token))["workers"][a.address]["kv_bytes"] == 500


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_a_kv_task_that_can_never_fit_fails_with_the_budget_in_its_error(c, s, a, b):
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    task = submit_compute(c, token, a.address, kv_value, 10, kv_out=5000)
    with pytest.raises(KVBudgetError, match="more than the whole budget"):
        await task
    [over] = events(plugin, "over-budget")
    assert (over["key"], over["worker"]) == (task.key, a.address)
    assert not plugin.budget.is_held(task.key)


async def _pinned(c, token: str, worker: str, nbytes: int):
    """A block of ``nbytes`` on ``worker`` that the client keeps (pinned) while it holds the future."""
    block = submit_block(c, token, worker, nbytes)
    await block
    return block


async def _budget_with_pinned(c, s, worker: str, nbytes: int):
    """A budget of 1000 and a block of ``nbytes`` on ``worker`` the client keeps (pinned).
    -> plugin, token, block."""
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    block = submit_block(c, token, worker, nbytes)
    await block
    return plugin, token, block


async def _a_full_and_b_at_work(c, s, a, b, gate_name: str, flow: str | None = None):
    """A budget of 1000 with 800 pinned on a and 600 on b (the client keeps its blocks: a task
    needing 500 fits on neither) and a KV task at work on b until ``gate_name`` opens.
    -> plugin, token, block on a, gate, running task, block on b."""
    plugin, token, block = await _budget_with_pinned(c, s, a.address, 800)
    on_b = await _pinned(c, token, b.address, 600)
    opened = gate(gate_name)
    running = submit_compute(c, token, b.address, wait_at_gate, gate_name, kv_out=10, flow=flow)
    await until(lambda: state_of(s, running.key) == "processing", what="b's task to start")
    return plugin, token, block, opened, running, on_b


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config(**{"scheduler.admission-patience": "500ms"}))
async def test_a_parked_task_waits_in_line_while_the_cluster_runs_and_fails_only_on_a_deadlock(c, s, a, b):
    plugin, token, block, opened, running, _on_b = await _a_full_and_b_at_work(c, s, a, b, "stream")
    task = submit_compute(c, token, a.address, kv_value, 500, kv_out=500)
    await until(lambda: state_of(s, task.key) == "no-worker", what="the task to be parked")
    await asyncio.sleep(1.5)  # three patiences: it waits in line, since b's task may still free room
    assert plugin.budget.awaiting_admission(task.key) and not events(plugin, "over-budget")

    t0 = time.monotonic()
    opened.set()  # the cluster goes idle and the client keeps its block: nothing can free room now
    await running
    with pytest.raises(KVBudgetError, match="are pinned"):
        await task
    assert 0.4 < time.monotonic() - t0 < 5  # one patience after the last progress, not at once
    assert block.key in a.data


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config(**{"scheduler.admission-patience": "500ms"}))
async def test_a_line_whose_room_never_grows_is_deadlocked_however_busy_other_workers_are(c, s, a, b):
    """Runs at work elsewhere that keep nothing on a cannot free room there: a's line is stuck."""
    plugin, token, block, opened, running, _on_b = await _a_full_and_b_at_work(c, s, a, b, "elsewhere", flow="run-b")
    task = submit_compute(c, token, a.address, kv_value, 500, kv_out=500, flow="run-a")
    t0 = time.monotonic()
    with pytest.raises(KVPreempted, match="preempted"):
        await task
    assert time.monotonic() - t0 < 5 and state_of(s, running.key) == "processing"
    opened.set()
    await running


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_eviction_takes_the_lowest_score_and_cuts_chains_from_the_end(c, s, a, b):
    plugin = await start_plugin(s, evict_interval="50ms")  # no budget yet
    token = await login(c)
    # A chain b1 <- b2, and a lone block: by score alone the big b1 (lowest keep score per
    # byte) would go first and suffice, but a prefix goes only after its suffix.
    b1 = submit_block(c, token, a.address, 600, start=0)
    await b1
    b2 = submit_block(c, token, a.address, 100, start=4, parent=b1.key)
    lone = submit_block(c, token, a.address, 200, start=0)
    await asyncio.gather(b2, lone)
    keys = {"b1": b1.key, "b2": b2.key, "lone": lone.key}
    del b1, b2, lone
    await until(lambda: all(wanted_only_by_cache(s, k) for k in keys.values()), what="the client's releases")
    assert not events(plugin, "evict")  # no budget: the cache keeps everything

    await c.scheduler.kv_configure(session=token, kv_budget_bytes=650)  # 900 held: 250 must go
    assert [e["key"] for e in events(plugin, "evict")] == [keys["lone"], keys["b2"]]
    await until(lambda: keys["b2"] not in a.data and keys["lone"] not in a.data, what="the evictions")
    assert keys["b1"] in a.data
    assert (await c.scheduler.kv_snapshot(session=token))["workers"][a.address]["kv_bytes"] == 600


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_a_lease_keeps_a_looked_up_block_until_it_expires(c, s, a, b):
    plugin = await start_plugin(s, evict_interval="50ms", lease_seconds=1.0)
    token = await login(c)
    block = submit_block(c, token, a.address, 400)
    await block
    key = block.key
    del block
    await until(lambda: wanted_only_by_cache(s, key), what="the client's release")

    t0 = time.time()
    assert await c.scheduler.kv_acquire(session=token, keys=[key]) == {key: key}  # content -> its Dask key
    held = di.hold_futures(c, [key])  # acquired for this client: its futures, let go of at once
    del held
    await until(lambda: wanted_only_by_cache(s, key), what="the client's release of the acquired block")
    await c.scheduler.kv_configure(session=token, kv_budget_bytes=100)
    [over] = events(plugin, "over-budget")  # leased: pinned, so the worker stays over budget
    assert (over["worker"], over["nbytes"]) == (a.address, 400)
    assert not events(plugin, "evict") and key in a.data

    await until(lambda: events(plugin, "evict"), timeout=5, what="the eviction once the lease ran out")
    [evict] = events(plugin, "evict")
    assert evict["key"] == key and evict["time"] >= t0 + 1.0


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_a_preempted_runs_leases_end_with_it_and_are_counted_as_its_pins_until_then(c, s, a, b):
    """A lease left running after its run was preempted would keep the blocks pinned until it
    retried and leased them again: the room it was preempted for would never come."""
    plugin = await start_plugin(s, evict_interval="50ms", lease_seconds=60.0)
    token = await login(c)
    shared, own = submit_block(c, token, a.address, 400), submit_block(c, token, a.address, 300)
    await wait([shared, own])
    keys = {"shared": shared.key, "own": own.key}
    del shared, own
    await until(lambda: all(wanted_only_by_cache(s, k) for k in keys.values()), what="the client's releases")
    await c.scheduler.kv_acquire(session=token, keys=[keys["shared"], keys["own"]], flow="run-a")
    await c.scheduler.kv_acquire(session=token, keys=[keys["shared"]], flow="run-b")
    held = di.hold_futures(c, list(keys.values()))
    del held  # the runs let go of their futures (preempted); only the leases keep the blocks
    await until(lambda: all(wanted_only_by_cache(s, k) for k in keys.values()), what="the releases")
    pins = dict((n, runs) for n, runs in plugin.budget._runs.pins_on(a.address, {}))
    assert pins == {400: frozenset({("tests", "run-a"), ("tests", "run-b")}), 300: frozenset({("tests", "run-a")})}

    plugin.usage.end_leases(("tests", "run-a"))
    now = time.time()
    assert not plugin.leases.is_leased(keys["own"], now)  # run-a's alone: over
    assert plugin.leases.is_leased(keys["shared"], now)  # run-b still holds it
    assert dict((n, runs) for n, runs in plugin.budget._runs.pins_on(a.address, {})) == \
        {400: frozenset({("tests", "run-b")})}


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_a_block_announced_for_reuse_is_evicted_after_the_others_until_it_is_read(c, s, a, b):
    plugin = await start_plugin(s, evict_interval="50ms")
    token = await login(c)
    old = submit_block(c, token, a.address, 300)
    await old
    new = submit_block(c, token, a.address, 300)
    await new
    keys = {"old": old.key, "new": new.key}
    del old, new
    await until(lambda: all(wanted_only_by_cache(s, k) for k in keys.values()), what="the client's releases")
    plugin.leases.plan([keys["old"]], time.time())  # what kv_release_state(reuse_expected=True) does
    await c.scheduler.kv_configure(session=token, kv_budget_bytes=400)
    assert [e["key"] for e in events(plugin, "evict")] == [keys["new"]]  # the older one was announced
    assert await c.scheduler.kv_acquire(session=token, keys=[keys["old"]]) == {keys["old"]: keys["old"]}
    assert not plugin.leases.is_planned(keys["old"], time.time())  # read: the lease takes over



def _fails(nbytes: int):
    raise RuntimeError("this block's task failed")


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_an_erred_block_is_let_go_so_the_same_content_computes_again(c, s, a, b):
    await start_plugin(s, evict_interval="50ms")
    token = await login(c)
    bad = submit_block(c, token, a.address, 100, fn=_fails)
    key = bad.key
    await wait(bad)
    assert bad.status == "error"
    del bad  # the client lets go; the cache must too, or the key stays erred for good
    await until(lambda: key not in s.tasks, what="the erred block to be forgotten")
    again = submit_block(c, token, a.address, 100, key=key)  # the same content address, submitted anew
    assert len(await again) == 100


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config(**{"scheduler.admission-patience": "1s"}))
async def test_on_a_deadlock_only_the_youngest_waiting_task_is_preempted(c, s, a, b):
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    held = await _pinned(c, token, a.address, 700)  # a client keeps it while its task waits: pinned
    _full_b = await _pinned(c, token, b.address, 950)  # nothing waiting fits on b either
    older = submit_compute(c, token, a.address, kv_value, 400, kv_out=400)
    await until(lambda: state_of(s, older.key) == "no-worker", what="the older task to be parked")
    younger = submit_compute(c, token, a.address, kv_value, 400, kv_out=400)
    with pytest.raises(KVPreempted, match="preempted"):
        await younger  # no run holds KV there: the line's youngest goes
    assert plugin.budget.awaiting_admission(older.key)  # the older one waits on, its patience anew
    [pre] = events(plugin, "preempt")
    assert pre["key"] == younger.key
    assert plugin.catalog.counters["preemptions"] == 1  # counted for the page and /metrics too
    del held  # its client lets go: the older task runs
    assert len(await older) == 400


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config(**{"scheduler.admission-patience": "300ms"}))
async def test_a_stuck_task_that_fits_on_another_worker_moves_there_with_what_reads_it(c, s, a, b):
    """a's room is held by a state its own client keeps: no preemption frees it, b has room.
    The task runs on b, and the block cut from it (planned on a) follows it there."""
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    held = await _pinned(c, token, a.address, 700)
    task = submit_compute(c, token, a.address, kv_value, 400, kv_out=400, flow="run-a")
    cut = submit_block(c, token, a.address, 400, source=task)  # planned after it, on a
    assert len(await cut) == 400
    assert {ws.address for ws in s.tasks[task.key].who_has} == {b.address}
    assert {ws.address for ws in s.tasks[cut.key].who_has} == {b.address}  # read where it was made
    [moved] = events(plugin, "relocate")
    assert (moved["key"], moved["source"], moved["worker"], moved["dependents"]) == \
        (task.key, a.address, b.address, 1)
    assert not events(plugin, "preempt") and held.key in a.data  # nobody preempted, nothing of a's evicted


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_a_younger_task_that_would_fit_waits_behind_an_older_one_that_does_not(c, s, a, b):
    """First come, first served per worker, as a serving engine's waiting queue: small
    newcomers do not starve a large request by taking the room it waits for."""
    plugin, token, held = await _budget_with_pinned(c, s, a.address, 600)
    older = submit_compute(c, token, a.address, kv_value, 500, kv_out=500)  # 600 + 500 > 1000
    await until(lambda: state_of(s, older.key) == "no-worker", what="the older task to be parked")
    younger = submit_compute(c, token, a.address, kv_value, 300, kv_out=300)  # 600 + 300 would fit
    await until(lambda: state_of(s, younger.key) == "no-worker", what="the younger task to be parked")
    await asyncio.sleep(0.5)  # ten admission passes
    assert plugin.budget.awaiting_admission(younger.key) and plugin.budget.awaiting_admission(older.key)
    del held
    assert len(await older) == 500 and len(await younger) == 300  # 500 + 300 fit once the block may go


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_a_workflow_runs_later_tasks_go_before_runs_that_began_after_it(c, s, a, b):
    plugin, token, held = await _budget_with_pinned(c, s, a.address, 800)
    first = submit_compute(c, token, a.address, kv_value, 400, kv_out=400, flow="run-old")
    await until(lambda: state_of(s, first.key) == "no-worker", what="the old run's task to be parked")
    other = submit_compute(c, token, a.address, kv_value, 500, kv_out=500, flow="run-new")
    await until(lambda: state_of(s, other.key) == "no-worker", what="the new run's task to be parked")
    later = submit_compute(c, token, a.address, kv_value, 150, kv_out=150, flow="run-old")  # submitted last
    await until(lambda: state_of(s, later.key) == "no-worker", what="the old run's next task to be parked")
    del held  # room for 1000: the old run's 400 + 150 go first; the new run's 500 no longer fits
    assert len(await first) == 400 and len(await later) == 150
    await asyncio.sleep(0.3)
    assert plugin.budget.awaiting_admission(other.key)  # both outputs are held: 550 + 500 > 1000
    del first
    assert len(await other) == 500


NO_SPILL_DISK = {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False}


async def _two_runs_pinning_a(c, token, a, b) -> tuple:
    """b is full (950 of 1000, pinned); run-old and run-mid each pin 400 bytes on ``a`` (a live
    state). -> (b's block, run -> its block)."""
    full_b = await _pinned(c, token, b.address, 950)  # nothing waiting fits on b either
    blocks = {}
    for run in ("run-old", "run-mid"):
        blocks[run] = submit_block(c, token, a.address, 400)
        await blocks[run]
        await c.scheduler.kv_register_states(session=token, metas=[
            {"state_id": f"kvstate-{run}-00000001", "block_keys": [blocks[run].key], "op": "materialize",
             "tokens": 4, "worker": a.address, "flow": run}])
    return full_b, blocks


async def _three_runs_on_a(c, s, token, a, b) -> dict:
    """``_two_runs_pinning_a``, and a lookup no run claims pins 100 more on a. Then a task of
    each run, run-new last, is parked on a. -> run -> its parked task."""
    _full_b, blocks = await _two_runs_pinning_a(c, token, a, b)
    loose = submit_block(c, token, a.address, 100)  # held by a lookup no run claims: nobody's to free
    await loose
    await c.scheduler.kv_acquire(session=token, keys=[loose.key])
    queued = {"blocks": blocks, "held": (_full_b, loose)}
    for run, nbytes in (("run-old", 400), ("run-mid", 300), ("run-new", 100)):  # in this order of arrival
        queued[run] = submit_compute(c, token, a.address, kv_value, nbytes, kv_out=nbytes, flow=run)
        await until(lambda: state_of(s, queued[run].key) == "no-worker", what=f"{run}'s task to be parked")
    return queued


def _total_len(*arrays) -> int:
    return sum(len(a) for a in arrays)


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_a_waiting_task_gets_room_by_spilling_idle_blocks_younger_runs_first_and_nothing_is_redone(c, s, a, b):
    """No deadlock to wait for, no preemption: a task that lacks room where every block is
    pinned has a younger run's idle block moved to the spill disk (the youngest run's first,
    its own run's next, the oldest's last: ``policy.admission.spill_order``), and a task that
    reads a spilled block later is admitted with room to read it back, and reads what was
    written."""
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    await until(lambda: plugin.tiers.can_spill(a.address), what="a's report that it keeps a spill disk")
    _full_b, blocks = await _two_runs_pinning_a(c, token, a, b)
    old, mid = blocks["run-old"].key, blocks["run-mid"].key
    made = submit_compute(c, token, a.address, kv_value, 400, kv_out=400, flow="run-old")
    assert len(await made) == 400
    assert [(e["blocks"], e["nbytes"]) for e in events(plugin, "spill")] == [(1, 400)]
    done = made.key
    del made  # its output let go: else the read-back below may need a second spill
    await until(lambda: state_of(s, done) is None, what="run-old's output released")
    await until(lambda: mid in a.data.slow, what="run-mid's block on a's disk")
    assert old in a.data.fast and plugin.tiers.spilled_on(mid, a.address)
    # a task reading run-mid's spilled block: admitted with room for it, reads it back
    reader = submit_compute(c, token, a.address, _total_len, blocks["run-mid"], kv_out=0, flow="run-mid")
    assert await reader == 400
    assert mid in a.data.fast
    assert not events(plugin, "preempt")
    counters = (await c.scheduler.kv_counters(session=token))["counters"]
    assert (counters["spills"], counters["bytes_spilled"], counters["bytes_read_back"]) == (1, 400, 400)


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config(**{"scheduler.admission-patience": "1s"}) | NO_SPILL_DISK)
async def test_a_deadlock_preempts_the_youngest_run_that_holds_kv_there_not_one_that_holds_nothing(c, s, a, b):
    """Without a spill disk the budget's last resort is preemption (the level is redone)."""
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    queued = await _three_runs_on_a(c, s, token, a, b)
    assert not plugin.tiers.can_spill(a.address) and not events(plugin, "spill")
    with pytest.raises(KVPreempted, match="a waiting workflow holding KV there"):
        await queued["run-mid"]  # run-new is younger but holds nothing: preempting it frees nothing
    [pre] = events(plugin, "preempt")
    assert pre["key"] == queued["run-mid"].key
    assert plugin.budget.awaiting_admission(queued["run-new"].key)
    assert plugin.budget.awaiting_admission(queued["run-old"].key)


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_a_parked_task_its_workflow_let_go_is_dropped_though_the_cache_wants_its_blocks(c, s, a, b):
    """The cache wants a block from its submission on; once the workflow gives up, a parked
    prefill only the cache still waits for would pin its inputs for good."""
    plugin, token, held = await _budget_with_pinned(c, s, a.address, 800)
    task = submit_compute(c, token, a.address, kv_value, 500, held, kv_out=500)  # reads the block: pins it
    block = submit_block(c, token, a.address, 500, source=task)  # cut from it: the cache wants it already
    keys = (task.key, block.key)
    await until(lambda: state_of(s, task.key) == "no-worker", what="the task to be parked")
    del task, block  # the workflow gives up
    await until(lambda: not any(k in s.tasks for k in keys), what="the orphaned chain to be forgotten")
    assert not plugin.budget.is_held(keys[0]) and [e["blocks"] for e in events(plugin, "orphan-dropped")] == [1]
    assert not s.tasks[held.key].waiters  # the input it pinned is the client's alone again


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config())
async def test_a_client_that_leaves_has_its_states_released_and_its_blocks_left_to_the_cache(c, s, a, b):
    from distributed import Client

    plugin = await start_plugin(s, evict_interval="50ms")
    other = await Client(s.address, asynchronous=True)
    token = await login(other)
    block = submit_block(other, token, a.address, 400)
    await block
    sid = "kvstate-leaver-000000000001"
    await other.scheduler.kv_register_states(session=token, metas=[
        {"state_id": sid, "block_keys": [block.key], "op": "materialize", "tokens": 4, "worker": a.address}])
    assert plugin.catalog.states[sid].status == "live"
    key = block.key
    await other.close()  # as if its process died: nothing releases the state but the plugin
    await until(lambda: plugin.catalog.states[sid].status == "released", what="the state's release")
    assert wanted_only_by_cache(s, key)  # evictable now
    assert any(e.get("state_id") == sid and e.get("reason") == "client left" for e in events(plugin, "release"))


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_a_parked_task_whose_input_is_lost_waits_in_line_again_and_runs(c, s, a, b):
    """A lost input (its worker died) sends a parked task back through ``released`` and
    ``waiting``; it must come back under admission, not stay parked with nobody to admit it."""
    plugin, token, held = await _budget_with_pinned(c, s, a.address, 800)
    source = submit_block(c, token, b.address, 100)
    await source
    task = submit_compute(c, token, a.address, kv_value, 500, source, kv_out=500)
    await until(lambda: state_of(s, task.key) == "no-worker", what="the task to be parked")
    s.transitions({source.key: "released"}, stimulus_id="test-input-lost")  # as when b dies with it
    await until(lambda: state_of(s, source.key) == "memory", what="the input to be computed again")
    await until(lambda: state_of(s, task.key) == "no-worker", what="the task to be parked again")
    assert plugin.budget.awaiting_admission(task.key)
    del held  # room: the task is admitted and runs where the plan sent it
    assert len(await task) == 500
    assert {ws.address for ws in s.tasks[task.key].who_has} == {a.address}


async def _crossed_states(c, token, a, b) -> dict:
    """run-old pins 700 of 1000 on b, run-new 700 on a, a spare state 10 on b."""
    blocks = {}
    for run, worker, nbytes in (("run-old", b.address, 700), ("run-new", a.address, 700), ("spare", b.address, 10)):
        blocks[run] = submit_block(c, token, worker, nbytes)
        await blocks[run]
        await c.scheduler.kv_register_states(session=token, metas=[
            {"state_id": f"kvstate-{run}-00000001", "block_keys": [blocks[run].key], "op": "materialize",
             "tokens": 4, "worker": worker, "flow": run}])
    return blocks


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_two_runs_each_pinning_the_others_room_both_run_after_spilling_the_others_state(c, s, a, b):
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    await until(lambda: plugin.tiers.can_spill(a.address) and plugin.tiers.can_spill(b.address),
                what="the workers' reports that they keep a spill disk")
    blocks = await _crossed_states(c, token, a, b)
    old = submit_compute(c, token, a.address, kv_value, 500, kv_out=500, flow="run-old")
    new = submit_compute(c, token, b.address, kv_value, 500, kv_out=500, flow="run-new")
    assert [len(x) for x in await c.gather([old, new])] == [500, 500]
    assert blocks["run-new"].key in a.data.slow and blocks["run-old"].key in b.data.slow
    assert not events(plugin, "preempt")


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_a_block_a_task_on_the_other_worker_reads_is_spilled_for_room_where_it_waits(c, s, a, b):
    """A task running on b reads run-old's block, which b fetched from a: a's copy is kept only
    by run-old's state, so a task of run-new lacking room on a has that copy spilled instead
    of a idling until the reader on b ends."""
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    await until(lambda: plugin.tiers.can_spill(a.address), what="a's report that it keeps a spill disk")
    block = submit_block(c, token, a.address, 600)
    await block
    await c.scheduler.kv_register_states(session=token, metas=[
        {"state_id": "kvstate-run-old-00000001", "block_keys": [block.key], "op": "materialize", "tokens": 4,
         "worker": a.address, "flow": "run-old"}])
    opened = gate("reader-on-b")
    reader = submit_compute(c, token, b.address, wait_at_gate, "reader-on-b", block, kv_out=10, flow="run-old")
    await until(lambda: block.key in b.data, what="b's copy of the block")
    try:
        new = submit_compute(c, token, a.address, kv_value, 500, kv_out=500, flow="run-new")
        assert len(await asyncio.wait_for(new, 10)) == 500
        assert block.key in a.data.slow and not events(plugin, "preempt")
    finally:
        opened.set()
    assert len(await reader) == 0


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=kv_config(**{"scheduler.admission-patience": "1s"}) | NO_SPILL_DISK)
async def test_two_lines_stuck_on_each_other_preempt_only_the_younger_run(c, s, a, b):
    """run-old waits for room on a that run-new's state pins; run-new waits for room on b that
    run-old's state pins. Each line preempting for its own oldest would preempt both runs,
    which retry into the same deadlock; only the younger run goes, and the older one runs.
    (Without a spill disk: with one, both states are spilled and nobody is preempted.)"""
    plugin = await start_plugin(s, kv_budget_bytes=1000, evict_interval="50ms")
    token = await login(c)
    blocks = await _crossed_states(c, token, a, b)
    old = submit_compute(c, token, a.address, kv_value, 500, kv_out=500, flow="run-old")
    await until(lambda: state_of(s, old.key) == "no-worker", what="run-old's task to be parked")
    new = submit_compute(c, token, b.address, kv_value, 500, kv_out=500, flow="run-new")
    await until(lambda: state_of(s, new.key) == "no-worker", what="run-new's task to be parked")
    # A state released: both lines' patience starts again together, so both are stuck at once.
    await c.scheduler.kv_release_state(session=token, state_id="kvstate-spare-00000001")
    with pytest.raises(KVPreempted, match="preempted"):
        await new
    assert [e["key"] for e in events(plugin, "preempt")] == [new.key]
    assert plugin.budget.awaiting_admission(old.key)
    await c.scheduler.kv_release_state(session=token, state_id="kvstate-run-new-00000001")
    del blocks["run-new"]  # run-new backs off: it lets go of what it holds, and run-old runs
    assert len(await old) == 500


@gen_cluster(client=True, nthreads=TWO_WORKERS, config=PATIENT)
async def test_a_task_whose_planned_worker_is_gone_runs_where_it_fits_not_behind_its_inputs(c, s, a, b):
    plugin, token, held = await _budget_with_pinned(c, s, a.address, 800)
    source = submit_block(c, token, a.address, 100)  # its input, on a: a is full (900 of 1000)
    await source
    # Planned on a worker that is gone:
    task = submit_compute(c, token, "tcp://127.0.0.1:9", kv_value, 500, source, kv_out=500)
    assert len(await asyncio.wait_for(task, 10)) == 500  # b has room for it and its input
    assert {ws.address for ws in s.tasks[task.key].who_has} == {b.address}
