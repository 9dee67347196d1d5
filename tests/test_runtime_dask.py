"""The Dask runtime on a real LocalCluster of 2 worker processes (1 thread each).

Every test uses its own context (a distinct first block), so content-addressed blocks from
one test never serve another; the cluster and the runtime are shared by the module.
"""

import logging
import time

import pytest
from conftest import CONTEXT, SUFFIXES, assert_same_generation, make_engine, wait_until
from distributed import Client

from daskflow_kv import config
from daskflow_kv.policy.cost_model import DEFAULT_LATENCY, LinkProfile, PrefillProfile, calibration_lengths, decide
from daskflow_kv.runtime.calibration import probes_arrived
from daskflow_kv.errors import IncompatibleStateError, StateReleasedError
from daskflow_kv.state.catalog import ARROW_COLUMNS
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.transport.serialization import _SIZEOF_OVERHEAD
from daskflow_kv.keys import PREFILL_TOPIC
from daskflow_kv.keys import short_key

EVENTS = "daskflow-kv"
NEW = 6  # tokens generated per branch


@pytest.fixture(scope="module")
def rt(client):
    return KVRuntime(client, "tiny-llama", block_size=16)


@pytest.fixture(scope="module")
def engine():
    return make_engine("tiny-llama", block_size=16)


@pytest.fixture(autouse=True)
def _no_what_ifs(rt):
    rt.bandwidth_override = rt.prefill_override = None
    yield
    rt.bandwidth_override = rt.prefill_override = None


def _ctx(rt, case: str, repeat: int = 1) -> list[int]:
    return rt.encode(f"Case {case}: " + " ".join([CONTEXT] * repeat))


def _text(engine, tokens, n=NEW):
    return engine.generate_text(list(tokens), max_new_tokens=n, return_logits=True)


def _holders(state) -> set[str]:
    return {w for ws in state.who_has().values() for w in ws}


def _incoming(client, worker) -> list[dict]:
    return client.run(lambda dask_worker: list(dask_worker.transfer_incoming_log), workers=[worker])[worker]


def _clear_incoming(client):
    client.run(lambda dask_worker: dask_worker.transfer_incoming_log.clear())


def _events(client, topic=EVENTS, since=0.0) -> list[dict]:
    return [msg for t, msg in client.get_events(topic) if t >= since and isinstance(msg, dict)]



# -- the cluster itself ----------------------------------------------------------------------
def test_local_cluster_is_kv_ready(client, workers, rt):
    def info(dask_scheduler):
        amm = dask_scheduler.extensions["amm"]
        return sorted(type(p).__name__ for p in amm.policies), "daskflow-kv" in dask_scheduler.plugins

    policies, has_plugin = client.run_on_scheduler(info)
    assert has_plugin and policies == ["KVAwareReduceReplicas"]
    assert set(client.nthreads().values()) == {1}
    assert str(next(iter(client.scheduler_info()["workers"]))).startswith("tcp://")


# -- exactness -------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["transfer", "recompute"])
def test_materialize_on_a_resume_on_b_matches_text_mode(rt, engine, workers, policy):
    a, b = workers
    ctx = _ctx(rt, f"exact-{policy}")
    root = rt.materialize(ctx, worker=a)
    rt.wait([root])
    assert _holders(root) == {a}
    sufs = [rt.encode(s) for s in SUFFIXES]
    gens = rt.resume_many([(root, s) for s in sufs], max_new_tokens=NEW, policy=policy, workers=[b],
                          return_logits=True)
    for g, s in zip(gens, sufs):
        assert g.worker == b and g.placement.action == policy
        assert_same_generation(g, _text(engine, ctx + s))
        assert g.metrics["tokens_reused"] == len(ctx) and g.metrics["tokens_computed"] == len(s)
    # The continuation (prefix blocks shared, new blocks on b) holds everything fed so far,
    # i.e. all but the last sampled token: resuming it with that token continues exactly.
    cont = gens[0].state
    assert list(cont.tokens) == ctx + sufs[0] + gens[0].tokens[:-1]
    assert cont.state.block_keys[: len(ctx) // 16] == root.state.block_keys[: len(ctx) // 16]
    more = [gens[0].tokens[-1]] + rt.encode(" And then?")
    g2 = rt.resume(cont, more, max_new_tokens=NEW)
    assert g2.tokens == engine.generate_text(list(cont.tokens) + more, NEW).tokens


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_extend_and_merge_match_text_mode(rt, engine):
    ctx = _ctx(rt, "extend")
    root = rt.materialize(ctx)
    ext = rt.extend(root, rt.encode(" Extra facts arrive."))
    assert ext.state.block_keys[: len(ctx) // 16] == root.state.block_keys[: len(ctx) // 16]
    assert ext.state.lineage[-1].as_dict()["tokens_computed"] == len(ext.tokens) - len(ctx)
    merged = rt.merge(root, ext)  # ext continues root exactly: concat, nothing computed
    assert merged.state.block_keys == ext.state.block_keys
    g = rt.resume(merged, rt.encode(" Sum up."), max_new_tokens=NEW)
    assert g.tokens == engine.generate_text(list(ext.tokens) + rt.encode(" Sum up."), NEW).tokens
    g0 = rt.resume(root, [], max_new_tokens=NEW)  # an empty suffix re-feeds the last cached token
    assert g0.tokens == engine.generate_text(ctx, NEW).tokens


# -- bytes moved, from Dask's own transfer records -------------------------------------------
def test_bytes_moved_once_per_destination_worker(client, rt, engine, workers):
    a, b = workers
    ctx = _ctx(rt, "bytes", repeat=2)
    root = rt.materialize(ctx, worker=a)
    rt.wait([root])
    _clear_incoming(client)
    before = rt.counters()["counters"]["bytes_transferred"]
    kids = rt.fork(root, 4)
    sufs = [rt.encode(s) for s in SUFFIXES]
    pairs = list(zip(kids, sufs))  # two branches on each worker: where they run is this test's choice
    gens = (rt.resume_many(pairs[:2], max_new_tokens=NEW, policy="transfer", workers=[a])
            + rt.resume_many(pairs[2:], max_new_tokens=NEW, policy="transfer", workers=[b]))
    assert [g.worker for g in gens] == [a, a, b, b]
    assert [g.placement.action for g in gens if g.worker == b] == ["transfer", "transfer"]
    for g, s in zip(gens, sufs):
        assert g.tokens == engine.generate_text(ctx + s, NEW).tokens

    moved = [(k, n) for e in _incoming(client, b) if e["who"] == a for k, n in e["keys"].items()
             if str(k).startswith("kvblock-")]
    needed = root.state.blocks  # every block: each branch reuses the whole context
    assert sorted(k for k, _ in moved) == sorted(r.key for r in needed)  # each block exactly once
    assert sum(n for _, n in moved) == sum(r.nbytes + _SIZEOF_OVERHEAD for r in needed)
    assert not [k for e in _incoming(client, a) for k in e["keys"] if str(k).startswith("kvblock-")]
    assert rt.counters()["counters"]["bytes_transferred"] - before == root.nbytes  # charged once

    # Each consumer task (one batch per worker: two branches there) depends on exactly the blocks it reads.
    # named after a batch's first branch, plus a random tail
    batch_prefixes = tuple(f"kvprefill-resume-batch-{g.state.state_id}-" for g in gens)
    deps = client.run_on_scheduler(
        lambda dask_scheduler, prefixes: {
            k: sorted(d.key for d in ts.dependencies) for k, ts in dask_scheduler.tasks.items()
            if str(k).startswith(prefixes)
        },
        prefixes=batch_prefixes,
    )
    assert len(deps) == 2 and all(d == sorted(root.state.block_keys) for d in deps.values())


# -- the cost model drives the plan -----------------------------------------------------------
def test_forced_bandwidth_flips_the_plan_and_outputs_stay_identical(client, rt, engine, workers):
    a, b = workers
    ctx = _ctx(rt, "flip", repeat=3)
    root = rt.materialize(ctx, worker=a)
    rt.wait([root])
    suf = rt.encode(SUFFIXES[1])
    want = engine.generate_text(ctx + suf, NEW).tokens
    rt.prefill_override = PrefillProfile(0.0, 1e-3, 0.0)  # 1000 tok/s everywhere
    results = {}
    for bw in (1e3, 1e12):  # low first: recompute must not move the blocks
        rt.bandwidth_override = bw
        _clear_incoming(client)
        g = rt.resume(root, suf, max_new_tokens=NEW, workers=[b])
        got = {k for e in _incoming(client, b) for k in e["keys"]}
        results[bw] = (g, got)
        d = g.placement.decision
        assert g.worker == b and g.tokens == want
        latency = rt.view().link(a, b).latency  # fitted by a calibration, else the default
        assert d.t_transfer == pytest.approx(latency + root.nbytes / bw)
        assert d.t_recompute == pytest.approx(1e-3 * len(ctx))
        assert d.action == decide(root.nbytes, len(ctx), 0, a, b, LinkProfile(bw), rt.prefill_override).action
    (low, low_got), (high, high_got) = results[1e3], results[1e12]
    assert low.placement.action == "recompute" and high.placement.action == "transfer"
    assert not low_got & set(root.state.block_keys)  # recomputed on b: nothing fetched
    assert set(root.state.block_keys) <= high_got  # transferred: fetched from a
    text = rt.explain()
    assert "recompute" in text and "transfer" in text and "GB/s" in text


# -- cross-workflow prefix sharing -------------------------------------------------------------
def test_second_workflow_shares_block_keys_and_prefills_nothing(cluster, client, rt, engine):
    sched_log = logging.getLogger("distributed.scheduler")  # "distributed" does not propagate
    collect = _Collect()
    sched_log.addHandler(collect)
    ctx = _ctx(rt, "shared")
    first = rt.materialize(ctx)
    rt.wait([first])
    g1 = rt.resume(first, [], max_new_tokens=NEW)
    assert wait_until(lambda: any(m.get("state_id") == first.state_id for m in _events(client, PREFILL_TOPIC)))
    with Client(cluster, set_as_default=False) as c2:
        rt2 = KVRuntime(c2, "tiny-llama", block_size=16)
        second = rt2.materialize(ctx)
        assert second.state.block_keys == first.state.block_keys
        ev = second.state.lineage[-1].as_dict()
        assert ev["tokens_computed"] == 0 and ev["tokens_reused"] == len(ctx)
        rt2.wait([second], timeout=10)  # the second client's futures resolve
        wanted = c2.run_on_scheduler(
            lambda dask_scheduler, keys: [sorted(c.client_key for c in dask_scheduler.tasks[k].who_wants)
                                          for k in keys], keys=list(second.state.block_keys))
        assert all(c2.id in w and client.id in w for w in wanted)  # both workflows hold the blocks
        # Same continuation, other client: its blocks' content addresses are already known to
        # the scheduler, so they are acquired, never submitted a second time under another spec.
        g2 = rt2.resume(second, [], max_new_tokens=NEW)
        assert g2.tokens == g1.tokens and g2.state.state.block_keys == g1.state.state.block_keys
        rt2.wait([g2.state], timeout=10)
        sched_log.removeHandler(collect)
        assert not [m for m in collect.messages if "Detected different `run_spec`" in m]
        rt.release(first)  # the first workflow lets go; the second still holds every block
        more = rt2.encode(" A follow-up question for the shared context.")
        longer = rt2.materialize(ctx + more)
        ev3 = longer.state.lineage[-1].as_dict()
        assert ev3["tokens_reused"] == len(ctx) and ev3["tokens_computed"] == len(more)
        g = rt2.resume(second, rt2.encode(SUFFIXES[2]), max_new_tokens=NEW)
        assert g.tokens == engine.generate_text(ctx + rt2.encode(SUFFIXES[2]), NEW).tokens
        prefills = _events(client, PREFILL_TOPIC)
        assert wait_until(lambda: any(m.get("state_id") == longer.state_id for m in _events(client, PREFILL_TOPIC)))
        prefills = _events(client, PREFILL_TOPIC)
        assert not [m for m in prefills if m.get("state_id") == second.state_id]  # no prefill at all
        [p3] = [m for m in prefills if m.get("state_id") == longer.state_id]
        assert (p3["new_tokens"], p3["prefix_tokens"]) == (len(more), len(ctx))


# -- catalog and events -----------------------------------------------------------------------
def test_catalog_arrow_table_matches_states(rt, workers):
    a, _ = workers
    ctx = _ctx(rt, "catalog")
    root = rt.materialize(ctx, worker=a)
    rt.wait([root])
    kids = rt.fork(root, 2)
    tbl = rt.catalog()
    assert tbl.column_names == [c for c, _ in ARROW_COLUMNS]
    rows = [r for r in tbl.to_pylist() if r["state_id"] == root.state_id]
    assert [r["block_key"] for r in rows] == list(root.state.block_keys)
    for r, ref in zip(rows, root.state.blocks):
        assert (r["token_start"], r["token_end"], r["nbytes"]) == (ref.start, ref.end, ref.nbytes)
        assert r["workers"] == a and r["status"] == "memory" and r["cached"]
        assert r["refcount"] >= 3 and r["state_op"] == "materialize" and r["state_status"] == "live"
    fork_rows = [r for r in tbl.to_pylist() if r["state_id"] == kids[0].state_id]
    assert [r["block_key"] for r in fork_rows] == list(root.state.block_keys)
    assert fork_rows[0]["state_op"] == "fork" and fork_rows[0]["state_parents"] == root.state_id
    rt.release(kids[0])
    released = [r for r in rt.catalog().to_pylist() if r["state_id"] == kids[0].state_id]
    assert {r["state_status"] for r in released} == {"released"}


def test_lifecycle_events_through_dask(client, rt, workers):
    a, b = workers
    t0 = time.time()
    root = rt.materialize(_ctx(rt, "events"), worker=a)
    rt.wait([root])
    kids = rt.fork(root, 2)
    rt.resume(root, rt.encode(" First."), max_new_tokens=2, policy="recompute", workers=[b])  # no copy on b
    rt.resume_many([(k, rt.encode(" Go.")) for k in kids], max_new_tokens=2, policy="transfer", workers=[b])
    events = _events(client, since=t0)
    by_op = {}
    for m in events:
        by_op.setdefault(m["op"], []).append(m)
    assert {"materialize", "fork", "resume", "transfer", "recompute"} <= set(by_op)
    assert any(m["state_id"] == root.state_id for m in by_op["materialize"])
    assert {m["state_id"] for m in by_op["fork"]} >= {k.state_id for k in kids}
    [tr] = [m for m in by_op["transfer"] if m["dst"] == b]  # two branches on b, one transfer
    assert tr["src"] == a and tr["nbytes"] == root.nbytes and sorted(tr["keys"]) == sorted(map(short_key, root.state.block_keys))
    assert any(m.get("reason") == "cost-model" and m["dst"] == b for m in by_op["recompute"])


# -- Active Memory Manager -------------------------------------------------------------------
def test_amm_keeps_kv_replicas_but_trims_others(client, rt, workers):
    a, b = workers
    root = rt.materialize(_ctx(rt, "amm"), worker=a)
    rt.wait([root])
    rt.resume(root, rt.encode(" Go."), max_new_tokens=2, policy="transfer", workers=[b])
    assert all(set(ws) == {a, b} for ws in root.who_has().values())  # replicas on both
    plain = client.submit(lambda: list(range(1000)), workers=[a], pure=False)
    client.replicate(plain, n=2)
    assert len(client.who_has(plain)[plain.key]) == 2
    client.amm.run_once()
    assert wait_until(lambda: len(client.who_has(plain)[plain.key]) == 1)  # ordinary keys: trimmed
    time.sleep(0.3)
    assert all(set(ws) == {a, b} for ws in root.who_has().values())  # KV replicas stay


# -- misuse ------------------------------------------------------------------------------------
def test_released_state_raises(rt):
    s = rt.materialize(_ctx(rt, "released"))
    kid = rt.fork(s, 1)[0]
    rt.release(s)
    rt.release(s)  # idempotent
    with pytest.raises(StateReleasedError):
        rt.resume(s, rt.encode(" Hi."), max_new_tokens=2)
    with pytest.raises(StateReleasedError):
        rt.fork(s, 2)
    with pytest.raises(StateReleasedError):
        rt.extend(s, rt.encode(" more"))
    g = rt.resume(kid, rt.encode(" Hi."), max_new_tokens=2)  # a fork of it still works
    assert len(g.tokens) == 2


def test_state_of_another_model_or_block_size_raises(client, rt):
    other = KVRuntime(client, "tiny-qwen2", block_size=16)
    s = other.materialize(other.encode("Case wrong model: hello"))
    with pytest.raises(IncompatibleStateError, match="tiny-qwen2"):
        rt.resume(s, rt.encode(" Hi."), max_new_tokens=2)
    with pytest.raises(IncompatibleStateError):
        rt.merge(rt.materialize(_ctx(rt, "wrong")), s)
    big = KVRuntime(client, "tiny-llama", block_size=32)
    s32 = big.materialize(big.encode("Case block size: hello"))
    with pytest.raises(IncompatibleStateError, match="block_size"):
        rt.fork(s32, 2)


def test_bad_arguments_raise(rt):
    s = rt.materialize(_ctx(rt, "bad"))
    with pytest.raises(ValueError, match="policy"):
        rt.resume(s, rt.encode(" Hi."), max_new_tokens=2, policy="teleport")
    with pytest.raises(ValueError, match="vocabulary"):
        rt.resume(s, [10**7], max_new_tokens=2)
    with pytest.raises(ValueError):
        rt.resume(s, rt.encode(" Hi."), max_new_tokens=0)
    with pytest.raises(ValueError):
        rt.materialize([])
    with pytest.raises(ValueError):
        rt.fork(s, 0)
    with pytest.raises(ValueError, match="probe_repeats"):  # before any probe runs
        rt.calibrate(probe_repeats=0)


# -- calibration, and what is left behind ----------------------------------------------------
def test_the_calibration_warms_each_worker_up_without_fitting_it(client, rt, workers):
    """A worker's first forward pays one-time costs the calibration must not fit as every
    prefill's fixed cost: each worker runs an untimed prefill first, and only the timed probes
    reach the profile and the event log."""
    from daskflow_kv.runtime import tasks

    from daskflow_kv.bench.process_load import prompt_delta, worker_load

    t0 = time.time()  # the scheduler's clock: the same host
    assert client.submit(tasks.warm_up, rt.spec, tuple(range(3, 67)), workers=[workers[0]], pure=False).result() == 64
    before = client.run(worker_load)
    rt.calibrate(probe_bytes=1 << 20, probe_tokens=256, probe_repeats=2)
    sizes = calibration_lengths(256)  # each one step of the step loop (under its 512-token chunk)
    after = client.run(worker_load)
    assert {w: x["steps"] - before[w]["steps"] for w, x in after.items()} == {w: 2 * len(sizes) + 1 for w in workers}
    # what the step loops fed, by op, is what the probes' events reported; the warm-up fed
    # but reported nothing (``bench.process_load``: the counts a stream's rows reconcile)
    for w in workers:
        moved = prompt_delta(after[w]["prompt"], before[w]["prompt"])
        fed, told = moved["fed"], moved["reported"]
        assert fed.get("calibrate") == told.get("calibrate") > 0
        assert fed.get("warm-up", 0) > 0 and told.get("warm-up", 0) == 0
    probes = 2 * 2 * len(sizes)  # every length twice on both workers
    since = lambda: [e.get("op") for ts, e in client.get_events(PREFILL_TOPIC) if ts >= t0]  # noqa: E731
    assert wait_until(lambda: since().count("calibrate") >= probes)
    ops = since()  # (a previous test's last timing may land here too)
    assert ops.count("calibrate") == probes and "warm-up" not in ops  # the warm-ups reported nothing


def test_calibration_feeds_the_auto_plan(client, rt, workers):
    a, b = workers
    before = {w: p["samples"] for w, p in rt.plugin.prefill_profiles().items()}
    cal = rt.calibrate(probe_bytes=4 << 20, probe_tokens=512)  # long enough for probes to overlap
    # every probe's timing came (probes sent together shared a batch and had none of their own:
    # the calibration waited out its 10 s deadline and reported one-sample profiles)
    repeats = config.get("calibration.probe-repeats")
    assert probes_arrived(cal["prefill_profiles"], before, workers, repeats * len(calibration_lengths(512)))
    assert set(cal["bandwidth"]) == {f"{a}->{b}", f"{b}->{a}"} and all(v > 0 for v in cal["bandwidth"].values())
    assert set(cal["prefill_profiles"]) == {a, b}
    root = rt.materialize(_ctx(rt, "calibrated"), worker=a)
    rt.wait([root])
    g = rt.resume(root, rt.encode(" Go."), max_new_tokens=2, workers=[b])  # auto: measured numbers decide
    d = g.placement.decision
    assert g.worker == b and d.src == a and d.dst == b and d.nbytes == root.nbytes
    assert d.bandwidth > 0 and d.t_recompute > 0  # both sides measured, none assumed
    link = rt.view().link(a, b)
    assert link.latency != DEFAULT_LATENCY and 0 < link.latency < 1  # fitted from probes of two sizes
    assert d.t_transfer == pytest.approx(link.latency + root.nbytes / d.bandwidth)
    assert d.action == ("transfer" if d.start_transfer < d.start_recompute else "recompute")


def test_prefill_outputs_and_replicas_are_released(client, rt, workers):
    a, b = workers
    root = rt.materialize(_ctx(rt, "leaks"), worker=a)
    kids = rt.fork(root, 4)
    gens = rt.resume_many([(k, rt.encode(" Go.")) for k in kids[:2]], max_new_tokens=2, policy="recompute",
                          workers=[b])
    # the blocks stay on a: b gets them by transfer (placed there, so no planner choice decides the path)
    gens += rt.resume_many([(k, rt.encode(" Go.")) for k in kids[2:]], max_new_tokens=2, policy="transfer",
                           workers=[b])
    assert {g.worker for g in gens} == {b} and {g.placement.action for g in gens} == {"recompute", "transfer"}
    rt.wait([g.state for g in gens])

    def intermediates(dask_scheduler):
        return sorted(k for k, ts in dask_scheduler.tasks.items()
                      if str(k).startswith(("kvprefill-", "kvresult-", "kvreplica-")) and ts.state == "memory")

    assert wait_until(lambda: not client.run_on_scheduler(intermediates)), client.run_on_scheduler(intermediates)


def test_sizeof_reports_tensor_bytes():
    from dask.sizeof import sizeof

    from daskflow_kv.runtime import tasks

    spec = tasks.ModelSpec("tiny-llama", block_size=16)
    out = tasks.prefill(spec, tasks.PrefillRequest(tuple(range(3, 40)), 0, 2, return_logits=True))
    tensor_bytes = sum(b.numel() * b.element_size() for b in out.blocks)
    assert tensor_bytes > 0 and sizeof(out) >= tensor_bytes + out.logits.numel() * 4
    res = tasks.take_result(out)
    assert sizeof(res) >= out.logits.numel() * 4 and sizeof(res) < tensor_bytes
