"""One test per Dask internal daskflow-kv relies on (daskflow_kv/dask_internals.py).

Each runs against a real 2-worker cluster (a LocalCluster, or gen_cluster's in-process one
where a test needs the scheduler's own objects); if a distributed release changes one of
these behaviours, the failure names the assumption.
"""

import asyncio
import time

import dask
import numpy as np
import pytest
from dask.utils import parse_bytes
from distributed import Client, Event, get_worker, wait
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import gen_cluster, gen_test

from conftest import wait_until

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import CACHE_CLIENT
from daskflow_kv.plugins.kv_scheduler import KVAwareReduceReplicas


# -- what the tenancy guards rest on (in-process gen_cluster: one scheduler, two workers). First in
# the file: gen_cluster runs its own event loop, which a module's synchronous client (below) upsets.

_RAN: list = []  # what task bodies ran (the workers are in this process)


def _mark(tag):
    _RAN.append(tag)
    return tag


class _Refuser(SchedulerPlugin):
    """Refuses every new task whose key starts with "refused-" when ``client`` submits it."""

    name = "internals-refuser"

    def __init__(self, client):
        self.client = client
        self.connections = []  # (client argument, current_connection()) per update_graph

    def update_graph(self, scheduler, *, client, tasks, stimulus_id, **kwargs):
        self.connections.append((client, di.current_connection()))
        if client == self.client:
            di.refuse_new_tasks(scheduler, [k for k in tasks if str(k).startswith("refused-")],
                                PermissionError("refused: not yours"), stimulus_id)


@gen_cluster(client=True)
async def test_refused_tasks_err_never_run_and_leave_their_key_free(c, s, a, b):
    _RAN.clear()
    await s.register_scheduler_plugin(_Refuser(c.id), name=_Refuser.name, idempotent=False)
    squat = c.submit(_mark, "squatter", key="refused-x", pure=False)
    with pytest.raises(PermissionError, match="^refused: not yours$"):
        await squat
    marked = dask.delayed(_mark, pure=False)("in a graph", dask_key_name="refused-x")
    after = c.compute(dask.delayed(lambda v: v)(marked, dask_key_name="internals-after-x"))  # its dependent
    with pytest.raises(PermissionError, match="not yours"):
        await after
    assert "refused-x" not in s.tasks and "internals-after-x" not in s.tasks  # forgotten, with its dependent
    assert _RAN == []  # nothing of it ran
    async with Client(s.address, asynchronous=True) as owner:
        mine = owner.submit(_mark, "owner", key="refused-x", pure=False)
        assert await mine == "owner"
        del squat, after  # the refused client lets go of its erred futures: the owner's key stays
        await asyncio.sleep(0.2)
        assert s.tasks["refused-x"].state == "memory" and _RAN == ["owner"]


@gen_cluster(client=True)
async def test_current_connection_is_the_senders_stream_whatever_the_message_says(c, s, a, b):
    seen = []  # (client=, worker=, current_connection()) of each message, as the handler saw them
    di.add_stream_handlers(s, {"internals-whoami": lambda client=None, worker=None: seen.append(
        (client, worker, di.current_connection()))})
    refuser = _Refuser("nobody")
    await s.register_scheduler_plugin(refuser, name=_Refuser.name, idempotent=False)
    async with Client(s.address, asynchronous=True) as other:
        await c.submit(_mark, 1, key="internals-who-submits", pure=False)
        [(_, conn_c)] = refuser.connections  # update_graph runs on the submitter's stream
        di.send_on_stream(c, {"op": "internals-whoami"})
        di.send_on_stream(other, {"op": "internals-whoami", "client": c.id})  # a message naming another client
        di.send_to_scheduler_stream(a, {"op": "internals-whoami"})
        await until(lambda: len(seen) == 3)
        by_client = [(cl, conn) for cl, w, conn in seen if w is None]
        [(worker, conn_a)] = [(w, conn) for _, w, conn in seen if w is not None]
        assert [cl for cl, _ in by_client] == [c.id, c.id]  # Dask's client= says what the message said ...
        assert sorted(conn is conn_c for _, conn in by_client) == [False, True]  # ... the connection, who sent it
        conn_other = next(conn for _, conn in by_client if conn is not conn_c)
        assert worker == a.address and conn_a is not conn_c and conn_a is not conn_other
        assert di.connection_open(conn_other)
    await until(lambda: not di.connection_open(conn_other))  # it ends when its client leaves
    assert di.connection_open(conn_c) and di.connection_open(conn_a)


@gen_cluster(client=True)
async def test_stream_client_is_the_client_that_stream_registered_as(c, s, a, b):
    seen = []  # (client= as Dask hands it, stream_client()) per message
    di.add_stream_handlers(s, {"internals-whois": lambda client=None, worker=None: seen.append(
        (client, di.stream_client(s)))})
    async with Client(s.address, asynchronous=True) as other:
        di.send_on_stream(other, {"op": "internals-whois", "client": c.id})  # a message naming another client
        di.send_on_stream(c, {"op": "internals-whois"})
        di.send_to_scheduler_stream(a, {"op": "internals-whois", "client": c.id})  # a worker's stream
        await until(lambda: len(seen) == 3)
    assert sorted(seen, key=str) == sorted([(c.id, other.id), (c.id, c.id), (c.id, None)], key=str)
    assert di.stream_client(s) is None  # outside any stream


def test_wire_error_says_what_a_worker_message_cannot_carry():
    class Opaque:  # Dask pickles what msgpack does not know: it travels
        pass

    for fine in (2 ** 64 - 1, -(2 ** 63), {1, 2}, Opaque(), {("k", 1): [1.5, "x", None, b"y"]}, float("nan")):
        assert di.wire_error(fine) is None
    for bad in (2 ** 64, -(2 ** 63) - 1, 10 ** 400, {"deep": [{"x": 10 ** 30}]}):
        assert di.wire_error(bad).startswith("OverflowError")


@gen_cluster(client=True)
async def test_diverted_worker_events_never_reach_dasks_event_log(c, s, a, b):
    got = []
    di.divert_worker_events(s, "internals-diverted", lambda worker=None, msg=None: got.append((worker, msg)))
    heard = []
    c.subscribe_topic("internals-diverted", heard.append)
    a.log_event("internals-diverted", {"n": 1})
    a.log_event("internals-kept", {"n": 2})  # other topics as usual
    await until(lambda: got and s.get_events("internals-kept"))
    assert got == [(a.address, {"n": 1})]
    assert not s.get_events("internals-diverted") and not heard


def _bytes(n):
    return b"x" * n


@gen_cluster(client=True)
async def test_a_refused_finished_task_errs_and_its_worker_frees_it(c, s, a, b):
    seen = []

    def refused(key, worker, nbytes):
        seen.append((key, worker, nbytes))
        return PermissionError("too big") if key == "internals-big" else None

    di.guard_task_finished(s, refused)
    big = c.submit(_bytes, 10_000, key="internals-big", workers=[a.address], pure=False)
    with pytest.raises(PermissionError, match="too big"):
        await big
    assert await c.submit(_bytes, 10, key="internals-small", pure=False) == b"x" * 10
    assert {k for k, _, _ in seen} == {"internals-big", "internals-small"}
    assert [n for k, w, n in seen if k == "internals-big"][0] >= 10_000 and (a.address in {w for _, w, _ in seen})
    await until(lambda: "internals-big" not in a.data)  # freed there: nothing holds the refused result
    assert s.tasks["internals-big"].state == "erred"


class _Stripper(SchedulerPlugin):
    name = "internals-stripper"

    def update_graph(self, scheduler, *, tasks, **kwargs):
        di.strip_annotation(scheduler, [scheduler.tasks[k] for k in tasks], "internals-secret")


def _annotations_here(key):
    return dict(get_worker().state.tasks[key].annotations or {})


@gen_cluster(client=True)
async def test_a_stripped_annotation_never_reaches_a_worker(c, s, a, b):
    seen = {}

    class Reader(SchedulerPlugin):
        def update_graph(self, scheduler, *, annotations, **kwargs):
            seen.update(annotations.get("internals-secret", {}))

    await s.register_scheduler_plugin(Reader(), name="internals-reader", idempotent=False)
    await s.register_scheduler_plugin(_Stripper(), name=_Stripper.name, idempotent=False)
    with dask.annotate(**{"internals-secret": {"token": "s3cret"}, "internals-kept": 1}):
        got = await c.submit(_annotations_here, "internals-annotated", key="internals-annotated", pure=False)
    assert seen == {"internals-annotated": {"token": "s3cret"}}  # a plugin reads it ...
    assert got == {"internals-kept": 1}  # ... the worker never gets it
    assert "internals-secret" not in s.tasks["internals-annotated"].annotations
    assert all("internals-secret" not in comp.annotations for comp in s.computations)


@gen_cluster(client=True)
async def test_guarded_keys_cannot_be_scattered(c, s, a, b):
    def refused(keys):
        bad = [k for k in keys if str(k).startswith("guarded-")]
        return PermissionError(f"refused: {bad}") if bad else None

    di.guard_data_handlers(s, refused)
    for w in (a, b):
        di.guard_worker_data(w, refused)
    computed = c.submit(_mark, "computed", key="guarded-x", workers=[a.address], pure=False)
    assert await computed == "computed"
    for direct in (True, False):
        with pytest.raises(PermissionError, match="guarded-x"):
            await c.scatter({"guarded-x": "scattered"}, workers=[b.address], direct=direct)
        with pytest.raises(PermissionError, match="guarded-x"):
            await c.scatter({"guarded-x": "scattered"}, workers=[a.address], direct=direct)
    with pytest.raises(PermissionError, match="guarded-y"):
        await c.scheduler.update_data(who_has={"guarded-y": [b.address]}, nbytes={"guarded-y": 8}, client=c.id)
    assert {ws.address for ws in s.tasks["guarded-x"].who_has} == {a.address}
    assert a.data["guarded-x"] == "computed" and "guarded-x" not in b.data
    assert await c.scatter({"plain-key": 3}) is not None  # other keys as usual


def _inc(x):
    return x + 1


@gen_cluster(client=True)
async def test_dead_task_groups_and_default_spans_are_forgotten(c, s, a, b):
    """A stream that empties and re-creates its groups leaves Dask a default span and dead groups
    per round (dask/distributed#7977); pruning forgets them and the scheduler works on."""
    busy = c.submit(_inc, 0, key="kept-0")  # a live group: its span stays
    await busy
    for i in range(6):
        p = c.submit(_inc, i, key=f"prefill-{i:08x}a", pure=False)
        assert await c.submit(_inc, p, key=f"kvresult-{i:08x}a", pure=False) == i + 2
        del p
        while any(k.startswith(("prefill", "kvresult")) for k in s.tasks):  # forgotten: the groups die
            await asyncio.sleep(0.01)
    spans = di.default_spans(s)
    assert len(spans) >= 6 and sum(di.span_is_dead(s, sp) for sp in spans) >= 5
    held = sum(len(comp.groups) for comp in s.computations)
    assert di.prune_dead_groups(s) > 0 and sum(len(comp.groups) for comp in s.computations) < held
    dead = [sp for sp in spans[:-1] if di.span_is_dead(s, sp)]
    died = time.time()
    while di.oldest_heartbeat(s) < died + 0.5:  # every worker has reported the spans' metrics
        await asyncio.sleep(0.05)
    di.drop_spans(s, dead)
    ext = s.extensions["spans"]
    assert not any(sp.id in ext.spans or sp in ext.root_spans for sp in dead)
    assert busy.key in s.tasks and s.tasks[busy.key].group.span_id in ext.spans  # the live span kept
    assert await c.submit(_inc, 1, key="prefill-after", pure=False) == 2  # a new default span opens
    await asyncio.sleep(1.5)  # heartbeats (with span metrics) still land
    assert a.status.name == b.status.name == "running"


async def until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)

def _state(client, key):
    return client.run_on_scheduler(lambda dask_scheduler: getattr(dask_scheduler.tasks.get(key), "state", None))


def _where():
    return get_worker().address


@gen_cluster(client=True)
async def test_a_live_spans_repeated_metadata_is_compacted(c, s, a, b):
    """Every submit appends ``{"type": "Future"}`` to its span's metadata; a span that lives
    (cached blocks keep it) would grow by one per task for the scheduler's life."""
    held = [c.submit(_inc, i, key=f"meta-{i}") for i in range(40)]
    await c.gather(held)
    ext = s.extensions["spans"]
    span = ext.spans[s.tasks["meta-0"].group.span_id]
    before = len(span._metadata["collections"])
    assert before >= 20  # one entry per submit (each its own update_graph)
    assert di.compact_span_metadata(s) == before - 1
    assert span._metadata["collections"] == [{"type": "Future"}]
    assert await c.submit(_inc, 100, key="meta-after") == 101  # the span still takes new tasks


@gen_cluster(client=True)
async def test_the_span_history_size_counts_every_span_and_its_groups(c, s, a, b):
    await c.gather(c.map(_inc, range(3)))
    spans, groups = di.span_history_size(s)
    assert spans == len(s.extensions["spans"].spans) >= 1 and groups >= 1


@gen_cluster(client=True)
async def test_dashboard_template_variables_are_the_shared_memoized_menus(c, s, a, b):
    pytest.importorskip("bokeh")
    tv = di.dashboard_template_variables(s)
    assert "info" in tv["pages"] and all({"url", "name"} <= set(p) for p in tv["plots"])
    assert di.dashboard_template_variables(s) is tv  # one dict per scheduler: an entry added shows on every page


@gen_test(timeout=60)
async def test_a_retiring_cluster_moves_the_keys_of_the_workers_it_drops():
    """Scale-down retires the dropped worker by name first: its key moves, not recomputed."""
    from distributed import LocalCluster

    calls = []

    def names(dropped, worker_names):
        calls.append(set(dropped))
        return sorted(dropped)

    cls = di.retiring_by_name(LocalCluster, names, "RetiringLocalCluster")
    assert cls.__name__ == "RetiringLocalCluster" and issubclass(cls, LocalCluster)
    _RAN.clear()
    async with cls(n_workers=2, processes=False, asynchronous=True, dashboard_address=":0") as cluster, \
            Client(cluster, asynchronous=True) as c:
        await c.wait_for_workers(2)
        dropped = list(cluster.worker_spec)[-1]  # scale(1) drops the last spec
        f = c.submit(_mark, "kept", workers=[cluster.workers[dropped].address], pure=False)
        await f
        cluster.scale(1)
        await cluster
        assert calls == [{dropped}]
        # moved off the worker, not run again (lost, it would wait for the dropped worker for good)
        assert await asyncio.wait_for(f.result(), 10) == "kept" and _RAN.count("kept") == 1
        assert len(cluster.workers) == 1


def test_prometheus_handler_base_is_dasks_metrics_request_handler():
    pytest.importorskip("prometheus_client")
    from distributed.http.utils import RequestHandler

    base = di.prometheus_handler_base()
    assert issubclass(base, RequestHandler) and callable(base.get)


def test_a_client_keeps_the_cluster_attached_to_it(client):
    assert di.owned_cluster(client) is None
    owned = object()
    di.attach_owned_cluster(client, owned)
    try:
        assert di.owned_cluster(client) is owned
    finally:
        di.attach_owned_cluster(client, None)


def test_futures_for_keys_another_client_submitted(cluster, client):
    """want() + hold_futures(): a second client gets a working future, which keeps the key alive."""
    x = client.submit(lambda: 41 + 1, key="internals-held", pure=False)
    wait(x)
    with Client(cluster) as other:
        client.run_on_scheduler(lambda dask_scheduler, cid: di.want(dask_scheduler, ["internals-held"], cid),
                                cid=other.id)
        held = di.hold_futures(other, [x.key])
        assert held[x.key].result(timeout=10) == 42
        del x  # the submitting client lets go; the other still holds it
        time.sleep(0.5)
        assert _state(client, "internals-held") == "memory"
        assert held["internals-held"].result(timeout=10) == 42


def test_pin_holds_a_task_to_its_worker_and_loosen_lets_it_go(client, workers):
    a, b = workers
    gate = Event("internals-gate")
    first = client.submit(lambda: Event("internals-gate").wait(30), key="internals-gate-task", workers=[a],
                          pure=False)
    second = client.submit(lambda _: _where(), first, key="internals-pinned", pure=False)
    wait_until(lambda: _state(client, "internals-pinned") == "waiting")

    def pin(dask_scheduler, target):
        ts = dask_scheduler.tasks["internals-pinned"]
        di.pin(dask_scheduler, ts, target)
        return di.is_strict(ts), sorted(ts.worker_restrictions)

    assert client.run_on_scheduler(pin, target=b) == (True, [b])
    gate.set()
    assert second.result(timeout=20) == b

    # Pinned to a worker that does not exist: stuck in no-worker until loosened and rescheduled.
    third = client.submit(_where, key="internals-stranded", workers=["tcp://127.0.0.1:9"], pure=False)
    assert wait_until(lambda: _state(client, "internals-stranded") == "no-worker")
    assert client.run_on_scheduler(
        lambda dask_scheduler: ("internals-stranded" in {str(ts.key) for ts in di.unrunnable(dask_scheduler)},
                                di.has_running_worker(dask_scheduler),
                                sorted(ws.address for ws in di.running_workers(dask_scheduler))
                                == sorted(dask_scheduler.workers))) == (True, True, True)

    def free(dask_scheduler):
        ts = dask_scheduler.tasks["internals-stranded"]
        di.loosen(ts)
        di.reschedule(dask_scheduler, ["internals-stranded"], "test-reschedule")
        return di.is_strict(ts)

    assert client.run_on_scheduler(free) is False
    assert third.result(timeout=20) in (a, b)


def test_drop_replica_removes_one_copy(client, workers):
    a, b = workers
    x = client.submit(lambda: np.ones(1000), key="internals-replicated", workers=[a], pure=False)
    wait(x)
    client.replicate([x], n=2)
    who = lambda: set(client.who_has([x])[x.key])  # noqa: E731
    assert wait_until(lambda: who() == {a, b})
    client.run_on_scheduler(lambda dask_scheduler: di.drop_replica(dask_scheduler, b, [x.key], "test-drop"))
    assert wait_until(lambda: who() == {a})


def test_recent_transitions_are_the_last_ones_with_their_cause(client, workers):
    a, _ = workers
    before = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.transition_counter)
    x = client.submit(lambda: 1, key="internals-moved", workers=[a], pure=False)
    wait(x)
    n = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.transition_counter) - before
    seen = client.run_on_scheduler(lambda dask_scheduler: di.recent_transitions(dask_scheduler, n))
    ours = [t for t in seen if t[0] == x.key]  # an earlier test's release may land in the window
    assert [(s, f) for _, s, f, _ in ours] == [("released", "waiting"), ("waiting", "processing"),
                                              ("processing", "memory")]
    assert ours[0][3].startswith("update-graph") and ours[-1][3].startswith("task-finished")
    assert client.run_on_scheduler(lambda dask_scheduler: di.recent_transitions(dask_scheduler, 10**9)) is None
    key = x.key
    del x  # the module's cluster is shared: leave no key behind
    assert wait_until(lambda: key not in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.tasks)))


def test_transfer_records_and_bandwidth_orientation(client, workers):
    """Workers log what they fetched; the scheduler keys its per-pair estimate (receiver, sender)."""
    a, b = workers
    client.run(lambda dask_worker: di.clear_incoming_transfers(dask_worker))
    payload = client.submit(lambda: np.ones(4 << 20, dtype=np.float32), key="internals-payload", workers=[a],
                            pure=False)
    reader = client.submit(lambda v: v.nbytes, payload, key="internals-reader", workers=[b], pure=False)
    assert reader.result(timeout=20) == 16 << 20
    log = client.run(lambda dask_worker: di.incoming_transfers(dask_worker), workers=[b])[b]
    rec = next(e for e in log if "internals-payload" in e["keys"])
    assert rec["who"] == a and rec["total"] >= 16 << 20 and rec["duration"] > 0 and rec["stop"] >= rec["start"]
    held = client.run(lambda dask_worker: di.in_memory(dask_worker)["internals-payload"].nbytes)
    assert held[a] == held[b] == 16 << 20
    # Worker metrics reach the scheduler with heartbeats. A sample taken while a heartbeat is
    # in flight is cleared unsent (Dask clears the table when the reply comes), so a loaded
    # machine can lose one: fetch again until a heartbeat carries one, as a busy worker would.
    links = lambda: client.run_on_scheduler(lambda dask_scheduler: di.link_bandwidths(dask_scheduler))  # noqa: E731
    for attempt in range(5):
        if wait_until(lambda: (a, b) in links(), timeout=6):
            break
        again = client.submit(lambda: np.ones(4 << 20, dtype=np.float32), key=f"internals-payload-{attempt}",
                              workers=[a], pure=False)
        assert client.submit(lambda v: v.nbytes, again, workers=[b], pure=False).result(timeout=20) == 16 << 20
    assert (a, b) in links()
    raw = client.run_on_scheduler(lambda dask_scheduler: dict(dask_scheduler.bandwidth_workers))
    assert (b, a) in raw  # the receiver first


def test_plugin_handlers_pseudo_client_and_amm_policy(client):
    assert isinstance(client.sync(client.scheduler.kv_challenge), str)  # the plugin's RPC handlers are there

    def facts(dask_scheduler):
        amm = dask_scheduler.extensions["amm"]
        return CACHE_CLIENT in dask_scheduler.clients, sorted(type(p).__name__ for p in amm.policies)

    has_cache_client, policies = client.run_on_scheduler(facts)
    assert has_cache_client
    assert KVAwareReduceReplicas.__name__ in policies and "ReduceReplicas" not in policies


def test_spilled_keys_lists_what_the_spill_buffer_holds_on_disk(client, workers):
    a, _ = workers
    x = client.submit(lambda: np.ones(1 << 16), key="internals-spillme", workers=[a], pure=False)
    wait(x)

    def spill(dask_worker):
        for _ in range(1000):  # SpillBuffer.evict(): the least recently used key goes to disk
            if "internals-spillme" in di.spilled_keys(dask_worker) or dask_worker.data.evict() < 0:
                break
        return "internals-spillme" in di.spilled_keys(dask_worker), "internals-spillme" in di.in_memory(dask_worker)

    def written(dask_worker):
        return di.bytes_spilled_to_disk(dask_worker)

    before = client.run(written, workers=[a])[a]
    assert client.run(spill, workers=[a])[a] == (True, False)
    assert float(x.result(timeout=10).sum()) == 1 << 16  # read back from disk
    assert client.run(written, workers=[a])[a] - before >= 8 << 16  # counted, though read back since


def test_the_scheduler_spills_a_named_key_on_a_worker_through_its_stream(client, workers):
    a, _ = workers
    keep = client.submit(lambda: np.ones(1 << 14), key="internals-keep", workers=[a], pure=False)
    x = client.submit(lambda: np.ones(1 << 16), key="internals-spill-named", workers=[a], pure=False)
    wait([keep, x])

    def install(dask_worker):
        assert di.can_spill(dask_worker)
        di.add_worker_stream_handlers(dask_worker, {"internals_spill": lambda keys=(), **_: di.spill_keys(
            dask_worker, keys)})

    client.run(install, workers=[a])
    client.run_on_scheduler(lambda dask_scheduler: di.send_to_worker_stream(
        dask_scheduler, a, {"op": "internals_spill", "keys": ["internals-spill-named", "internals-not-here"]}))
    assert wait_until(lambda: client.run(lambda dask_worker: di.spilled_keys(dask_worker), workers=[a])[a]
                      == ["internals-spill-named"])  # that key alone, the least recently used one stays
    assert float(x.result(timeout=10).sum()) == 1 << 16  # read back from disk


def test_a_peers_fetch_leaves_a_kept_key_on_the_spill_disk_and_others_as_dask_does(client, workers):
    a, b = workers
    xs = [client.submit(lambda: np.ones(1 << 16), key=f"internals-peer-{n}", workers=[a], pure=False)
          for n in ("kept", "other")]
    wait(xs)

    def spill_both(dask_worker):
        di.keep_spilled_on_peer_reads(dask_worker, lambda key: key == "internals-peer-kept")
        di.keep_spilled_on_peer_reads(dask_worker, lambda key: key == "internals-peer-kept")  # replaces, not wraps
        return di.spill_keys(dask_worker, [x.key for x in xs])

    assert client.run(spill_both, workers=[a])[a] == [x.key for x in xs]
    sums = [client.submit(lambda v: float(v.sum()), x, workers=[b], pure=False) for x in xs]
    assert client.gather(sums) == [1 << 16] * 2  # the peer read both from a's disk
    on_disk = client.run(lambda dask_worker: sorted(di.spilled_keys(dask_worker)), workers=[a])[a]
    assert on_disk == ["internals-peer-kept"]  # Dask's own read brought the other back into memory


def test_a_worker_gathering_one_key_per_message_makes_its_peer_stage_one_block_at_a_time(client, workers):
    a, b = workers

    def record_sends(dask_worker):  # each get_data call a's peers make, and how many keys it asks
        inner = dask_worker.handlers["get_data"]

        async def recorded(comm, keys=(), **msg):
            dask_worker.daskflow_kv_test_sends.append(len(keys))
            return await inner(comm, keys=keys, **msg)

        dask_worker.daskflow_kv_test_sends, recorded.inner = [], inner
        dask_worker.handlers["get_data"] = recorded

    def stop_recording(dask_worker):
        handler = dask_worker.handlers["get_data"]
        dask_worker.handlers["get_data"] = getattr(handler, "inner", handler)
        return dask_worker.__dict__.pop("daskflow_kv_test_sends", None)

    def fetch_four(tag):
        xs = [client.submit(np.ones, 1 << 14, key=f"internals-gather-{tag}-{i}", workers=[a], pure=False)
              for i in range(4)]
        wait(xs)
        assert client.run(lambda dask_worker: di.spill_keys(dask_worker, [x.key for x in xs]), workers=[a])[a]
        total = client.submit(lambda *vs: float(sum(v.sum() for v in vs)), *xs, workers=[b], pure=False)
        assert total.result() == 4 * (1 << 14)

    def set_limit(dask_worker, limit):
        before, dask_worker.state.transfer_message_bytes_limit = dask_worker.state.transfer_message_bytes_limit, limit
        return before

    dasks = parse_bytes(dask.config.get("distributed.worker.transfer.message-bytes-limit"))
    kept = client.run(set_limit, limit=dasks, workers=[b])[b]  # the KV worker plugin set it: Dask's own first
    client.run(record_sends, workers=[a])
    try:
        fetch_four("dask")  # Dask's own way: one message for all four, each loaded from a's disk
        dask_sends = client.run(stop_recording, workers=[a])[a]
        client.run(lambda dask_worker: di.gather_one_key_per_message(dask_worker), workers=[b])
        client.run(record_sends, workers=[a])
        fetch_four("one")
    finally:
        one_sends = client.run(stop_recording, workers=[a])[a]
        client.run(set_limit, limit=kept, workers=[b])
    assert dask_sends == [4] and one_sends == [1, 1, 1, 1]
    held = lambda: client.run(lambda dask_worker: [k for k in dask_worker.data if "gather" in str(k)], workers=[a])[a]  # noqa: E731
    assert wait_until(lambda: not held())  # the module's cluster is shared: leave no key behind


def test_call_scheduler_reaches_a_plugin_handler(client, workers):
    client.run_on_scheduler(lambda dask_scheduler: di.add_handlers(
        dask_scheduler, {"internals_echo": lambda worker=None, value=None: [worker, value]}))

    async def call(dask_worker):
        return await di.call_scheduler(dask_worker, "internals_echo", worker=dask_worker.address, value=7)

    got = client.run(call)
    assert {w: list(v) for w, v in got.items()} == {w: [w, 7] for w in workers}


def _add_echo(dask_worker):
    def echo(value=None):  # runs on the worker's event loop, where get_worker() does not work
        return {"echo": value, "at": dask_worker.address}

    di.add_worker_handlers(dask_worker, {"internals_echo": echo})


def test_worker_handlers_reached_from_a_task_thread(client, workers):
    """add_worker_handlers + call_worker + worker_loop: a task on one worker calls a handler
    added at run time on another, through that worker's own event loop and pooled comms."""
    import asyncio

    a, b = workers
    client.run(_add_echo)

    def ask(target):
        w = get_worker()
        coro = di.call_worker(w, target, "internals_echo", value=7)
        return asyncio.run_coroutine_threadsafe(coro, di.worker_loop(w)).result(timeout=10)

    got = client.submit(ask, b, workers=[a], pure=False).result(timeout=30)
    assert got == {"echo": 7, "at": b}


def test_the_scheduler_reaches_a_workers_own_handler_and_a_task_knows_its_key(client, workers):
    """call_worker_from_scheduler (the report token goes to the worker's own address) and
    running_task_key (a prefill's timing names its task's namespace tag)."""
    client.run(_add_echo)

    async def ask(dask_scheduler, target):
        return await di.call_worker_from_scheduler(dask_scheduler, target, "internals_echo", value=5)

    assert client.run_on_scheduler(ask, target=workers[1]) == {"echo": 5, "at": workers[1]}
    assert client.submit(di.running_task_key, key="internals-who-am-i", pure=False).result() == "internals-who-am-i"
    assert di.running_task_key() is None  # not inside a task


def test_the_distributed_release_is_one_we_pin():
    """pyproject pins distributed; these tests are what the pin rests on."""
    from importlib.metadata import requires

    import distributed
    from packaging.requirements import Requirement

    req = next(Requirement(r) for r in requires("daskflow-kv") if r.startswith("distributed"))
    assert distributed.__version__ in req.specifier, str(req)
    assert any(s.operator == "<" for s in req.specifier), "distributed needs an upper bound: " + str(req)



def test_a_dead_span_is_dropped_only_once_every_worker_reported_after_it_died():
    from daskflow_kv.plugins.kv_span_history import HEARTBEAT_MARGIN_S, SPAN_DEAD_S, spans_to_drop

    dead = {"old": 100.0, "new": 100.0 + SPAN_DEAD_S}
    now = 100.0 + SPAN_DEAD_S + 1
    assert spans_to_drop(dead, now, oldest_heartbeat=100.0 + HEARTBEAT_MARGIN_S) == ["old"]
    assert spans_to_drop(dead, now, oldest_heartbeat=100.0 + HEARTBEAT_MARGIN_S - 1) == []  # a silent worker


def test_worker_addresses_are_asked_now_not_read_from_the_racing_cache(client, workers):
    """The client's periodic refresh caches an identity without workers; a read of that cache
    can see an empty cluster. ``worker_addresses`` asks the scheduler itself, every time."""
    from daskflow_kv.dask_internals import worker_addresses

    for _ in range(20):
        client.sync(client._update_scheduler_info)  # what the periodic refresh runs (n_workers=0 since 2026.8)
        assert worker_addresses(client) == sorted(workers)


def test_worker_resources_are_what_each_worker_declared(client, workers):
    """``worker_resources``: the scheduler's identity lists each worker's resources (none here)."""
    from daskflow_kv.dask_internals import worker_resources

    assert worker_resources(client) == {w: {} for w in workers}


def test_kv_workers_start_without_dasks_malloc_trim_threshold(client):
    """``preloads.worker_environ``: the nanny spawns KV workers without it (its other variables stay)."""
    import os

    env = client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"))
    assert set(env.values()) == {None}
    assert "MALLOC_TRIM_THRESHOLD_" in dask.config.get("distributed.nanny.pre-spawn-environ")  # Dask's default
