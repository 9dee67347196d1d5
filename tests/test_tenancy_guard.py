"""Issue 51, item 2 and the bounds: the second tenant breaks the guard, or the workers' streams.

An annotation value of ``10**400`` made ``math.isfinite`` raise ``OverflowError`` in the note
parser; the guard caught only ``ValueError`` and ``AccessDenied``, and Dask logs a plugin's
exception and schedules the graph anyway: bob's task under alice's key ran unchecked. Now
the check fails closed (any exception refuses), numbers are compared as they came, and an
error anywhere in the plugin's handling of a graph refuses the graph's new KV tasks.

Any annotation, key or priority holding an integer past 64 bits made msgpack fail on the
scheduler's message to a worker, and Dask dropped that worker's stream: every tenant lost
its K/V there. The plugin refuses such a graph before anything of it is scheduled.

Every number a ``kv_*`` call takes is bounded where it enters, and what one tenant can make
the scheduler keep is bounded too: live states (``kv_register_states``; states listing no
block were never pruned) and probed links (``kv_record_bandwidth``: any src/dst pair).

A real 2-worker cluster, tenants configured as in ``tests/test_tenancy.py``; the scheduler
runs in this process, where the tests read what an attack did.
"""

from __future__ import annotations

import os

import dask
import pytest
from distributed import Client

from daskflow_kv.keys import BLOCK, PREFILL, RESULT, namespace_tag, task_key
from daskflow_kv.plugins import kv_client_api as api
from daskflow_kv.plugins.tenants import AccessDenied
from tenancy_kit import (PROMPT, SUFFIX, cluster_fixture, compute_note, plugin, scheduler_state, tenant,
                         text_tokens)


cluster = cluster_fixture()
alice = tenant("alice")
bob = tenant("bob")
ops = tenant("ops")


@pytest.fixture(scope="module")
def record(alice):
    """Alice's state, held for the whole module: its blocks must outlive every attack."""
    state = alice.materialize(alice.encode(PROMPT))
    alice.wait([state])
    return state


def _mark(path: str) -> int:
    open(path, "w").write("ran")
    return 1


@pytest.mark.parametrize("field, value", [
    ("predicted_s", 10 ** 400), ("kv_out", 10 ** 400), ("decision", {"action": "transfer", "nbytes": 10 ** 400}),
    ("decision", {"t_transfer": 10 ** 400}), ("gang_size", -(10 ** 400)),
], ids=["predicted_s", "kv_out", "decision.nbytes", "decision.t_transfer", "gang_size"])
def test_a_number_that_broke_the_check_refuses_the_graph(cluster, bob, tmp_path, field, value):
    """Bob's own task with the number, and in the same graph a task under alice's key."""
    mark = str(tmp_path / "ran")
    with dask.annotate(kv=compute_note(**{field: value})):
        own = dask.delayed(_mark, pure=False)(mark, dask_key_name=task_key(PREFILL, "bob", "huge"))
    squat = dask.delayed(_mark, pure=False)(mark, dask_key_name=task_key(RESULT, "alice", "squat"))
    futures = bob.client.compute([own, squat], optimize_graph=False)
    for f in futures:
        with pytest.raises(AccessDenied) as e:
            f.result(timeout=30)
        assert "\n" not in str(e.value)
    assert not os.path.exists(mark)  # nothing of it ran
    assert all(scheduler_state(bob.client, f.key) is None for f in futures)  # forgotten: the keys stay free
    assert all(plugin(cluster).ownership.owner(f.key) is None for f in futures)


def test_an_error_anywhere_in_the_plugin_refuses_the_graphs_kv_tasks(cluster, bob, tmp_path, monkeypatch):
    """Fault injection: the catalog raises while a graph is added (a bug, say). Dask would log
    it and schedule the graph; the plugin refuses the graph's new KV tasks instead."""
    mark = str(tmp_path / "ran")
    catalog = plugin(cluster).catalog

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(catalog, "add_block", broken)
    meta = {"key": f"{BLOCK}-{namespace_tag('bob')}-{'ab' * 16}", "start": 0, "end": 1, "nbytes": 8, "tokens": [5],
            "parent": None, "fingerprint": "f", "state_id": "kvstate-x-000000000000"}
    with dask.annotate(kv={"role": "block", "meta": meta}):
        fut = bob.client.submit(_mark, mark, key=meta["key"], pure=False)
    with pytest.raises(AccessDenied, match="could not check this graph"):
        fut.result(timeout=30)
    assert not os.path.exists(mark) and scheduler_state(bob.client, fut.key) is None


def _inc(x):
    return x + 1


def test_a_value_no_worker_message_can_carry_is_refused_and_the_workers_stay(cluster, alice, record):
    """Outside the boundary, but the worst denial of service a tenant had: any client, no session."""
    s = cluster.scheduler
    workers = {addr: ws.server_id for addr, ws in s.workers.items()}
    with Client(cluster) as mallory:
        tries = []
        with dask.annotate(foo=10 ** 400):
            tries.append(mallory.submit(_inc, 1, key="guard-annotated", pure=False))
        with dask.annotate(foo={"deep": [1, {"x": -(10 ** 30)}]}):
            tries.append(mallory.submit(_inc, 2, key="guard-nested", pure=False))
        tries.append(mallory.submit(_inc, 3, key="guard-priority", priority=10 ** 400, pure=False))
        inner = dask.delayed(_inc, pure=False)(4, dask_key_name=2 ** 64)  # a key inside the graph
        tries.append(mallory.compute(dask.delayed(_inc, pure=False)(inner, dask_key_name="guard-outer"),
                                     optimize_graph=False))
        for f in tries:
            with pytest.raises(AccessDenied, match="cannot send to a worker") as e:
                f.result(timeout=30)
            assert "\n" not in str(e.value)
        with dask.annotate(foo={"a": [1, {2, 3}], "b": 2 ** 63}):  # what msgpack carries still runs
            assert mallory.submit(_inc, 5, key="guard-fine", pure=False).result(timeout=30) == 6
    assert {addr: ws.server_id for addr, ws in s.workers.items()} == workers  # no worker lost its stream
    assert all(scheduler_state(alice.client, k) == "memory" for k in record.state.block_keys)
    gen = alice.resume(record, alice.encode(SUFFIX), max_new_tokens=6)
    assert gen.tokens == text_tokens(alice, list(record.tokens) + alice.encode(SUFFIX), 6)


BIG = 2 ** 64 - 1  # the largest integer an RPC carries at all (msgpack: a client cannot even send 10**400)


@pytest.mark.parametrize("call, kw, says", [
    ("kv_lookup", {"root": "r", "keys": [], "tokens": [BIG], "block_size": 16}, "tokens"),
    ("kv_lookup", {"root": "r", "keys": [], "tokens": [-1], "block_size": 16}, "tokens"),
    ("kv_lookup", {"root": "r", "keys": [], "tokens": [1], "block_size": BIG}, "block_size"),
    ("kv_lookup", {"root": "r" * 10 ** 5, "keys": [], "tokens": [1], "block_size": 16}, "root"),
    ("kv_lookup", {"root": "r", "keys": [], "tokens": [1], "block_size": 16, "view": "yes"}, "view"),
    ("kv_lookup", {"root": "r", "keys": [], "tokens": [1], "block_size": 16, "view": 1}, "view"),
    ("kv_acquire", {"keys": ["k" * 10 ** 5]}, "keys"),
    ("kv_record_bandwidth", {"src": "a", "dst": "b", "bandwidth": BIG}, "bandwidth"),
    ("kv_record_bandwidth", {"src": "a", "dst": "b", "bandwidth": 1e9, "latency": float("inf")}, "latency"),
    ("kv_record_bandwidth", {"src": "tcp://10.0.0.1:1", "dst": "tcp://10.0.0.2:2", "bandwidth": 1e9}, "two workers"),
    ("kv_workflow_done", {"agents": BIG, "ttft_s": []}, "agents"),
    ("kv_register_states", {"metas": [{"state_id": "kvstate-x-1", "block_keys": [], "tokens": BIG}]}, "tokens"),
    ("kv_register_states", {"metas": [{"state_id": "kvstate-x-2", "block_keys": [], "parents": ["p" * 10 ** 5]}]},
     "parents"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "")
def test_rpc_numbers_and_sizes_are_bounded_where_they_enter(bob, call, kw, says):
    with pytest.raises(ValueError, match=says) as e:
        bob.client.sync(getattr(bob.client.scheduler, call), session=bob.session.token, **kw)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_the_admins_numbers_are_bounded_too(ops):
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        ops.configure(kv_budget_bytes=BIG)
    with pytest.raises(ValueError, match="memory_weight"):
        ops.configure(memory_weight=float("nan"))
    assert ops.counters()["kv_budget_bytes"] is None


def test_one_tenant_cannot_grow_the_schedulers_memory_without_limit(cluster, bob, monkeypatch):
    monkeypatch.setattr(api, "MAX_LIVE_STATES", 50)  # the bound is 16384; the same check, cheaper to reach
    catalog = plugin(cluster).catalog

    def mine() -> int:
        return sum(1 for st in catalog.states.values() if st.namespace == "bob" and st.status == "live")

    def register(n: int, first: int, blocks=()) -> None:
        metas = [{"state_id": f"kvstate-empty-{first + i:012x}", "block_keys": list(blocks)} for i in range(n)]
        bob.client.sync(bob.client.scheduler.kv_register_states, session=bob.session.token, metas=metas)

    before = mine()
    with pytest.raises(ValueError, match="live states"):
        register(51, 0)  # states listing no block at all, which nothing ever pruned
    assert mine() == before  # refused whole, before anything was kept
    register(50 - before, 100)
    with pytest.raises(ValueError, match="live states"):
        register(1, 1000)
    monkeypatch.setattr(api, "MAX_LIVE_STATES", 1 << 14)
    monkeypatch.setattr(api, "MAX_LIVE_BLOCK_REFS", 100)  # the bound is 262144 block keys
    keys = [f"{BLOCK}-{namespace_tag('bob')}-{i:032x}" for i in range(60)]
    with pytest.raises(ValueError, match="blocks"):
        register(2, 2000, keys)
    bob.client.sync(bob.client.scheduler.kv_release_states, session=bob.session.token,
                    state_ids=[sid for sid in catalog.states if sid.startswith("kvstate-empty")])
    # probes: only links between two live workers, so at most workers² per namespace
    a, b = sorted(cluster.scheduler.workers)
    bob.plugin.record_bandwidth(a, b, 1e9)
    probed = plugin(cluster).profiles._probed_bandwidth
    assert {k for k in probed if k[0] == "bob"} == {("bob", a, b)}


def test_a_lookups_snapshot_is_the_callers_own_view(cluster, alice, bob, record):
    """A lookup that carries the planner's snapshot (``view=True``: one round trip, not two)
    answers what ``kv_snapshot`` answers that session - another tenant's probed links stay
    out - and no block of another namespace's."""
    a, b = sorted(cluster.scheduler.workers)
    alice.plugin.record_bandwidth(b, a, 123e6)  # alice's probe: for alice's plans only
    ans = bob.client.sync(bob.client.scheduler.kv_lookup, session=bob.session.token, root=bob.key_digest,
                          keys=[], tokens=list(record.tokens), block_size=16, view=True)
    own = bob.plugin.call("kv_snapshot")
    assert ans["tokens"] == 0 and not ans["blocks"]
    assert all(link[:2] != [b, a] for link in ans["snapshot"]["links"])
    assert ans["snapshot"]["links"] == own["links"] and set(ans["snapshot"]["workers"]) == set(own["workers"])
    mine = alice.prefixes.find(list(record.tokens), view=True)
    assert mine.tokens == record.length and mine.snapshot["links"] == alice.plugin.call("kv_snapshot")["links"]
    assert alice.prefixes.find(list(record.tokens), view="uncovered").snapshot is None  # all cached: no plan
    assert alice.prefixes.find(list(record.tokens) + [5], view="uncovered").snapshot is not None
