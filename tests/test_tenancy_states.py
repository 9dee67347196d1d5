"""Issue 22, item 3: the second tenant at ``kv_register_states``.

Bob re-registers alice's live state id (to release it himself, and stop her from doing
so), lists alice's block keys in a state of his own (to have his scoped catalog return her
rows), and picks how long the scheduler polls for him. Each is refused: a state id is
registered once, by its namespace; a state lists only its own namespace's blocks; the
wait is the server's (``daskflow-kv.scheduler.register-wait``), woken as graphs arrive,
not a caller-chosen 2 ms busy poll. Alice still releases her state; bob's catalog never
shows her. A real 2-worker cluster, tenants configured as in ``tests/test_tenancy.py``.
"""

from __future__ import annotations

import time

import pytest

from daskflow_kv.keys import block_key
from daskflow_kv.plugins.tenants import AccessDenied
from tenancy_kit import PROMPT, SUFFIX, tenant, tenant_cluster, text_tokens

REGISTER_WAIT = 1.5  # s: the server's bound, set for this cluster


@pytest.fixture(scope="module")
def cluster():
    with tenant_cluster(**{"scheduler.register-wait": f"{REGISTER_WAIT}s"}) as c:
        yield c


alice = tenant("alice")
bob = tenant("bob")


@pytest.fixture(scope="module")
def record(alice):
    state = alice.materialize(alice.encode(PROMPT))
    alice.wait([state])
    return state


def _register(rt, metas, **kw):
    return rt.client.sync(rt.client.scheduler.kv_register_states, session=rt.session.token, metas=metas, **kw)


def _meta(state_id, keys, **kw):
    return {"state_id": state_id, "block_keys": list(keys), "op": "materialize", "parents": [], "tokens": 16, **kw}


def test_bob_cannot_re_register_alices_state_id(alice, bob, record):
    with pytest.raises(AccessDenied, match="already registered by another namespace"):
        _register(bob, [_meta(record.state_id, [])])
    with pytest.raises(AccessDenied, match="not one of namespace 'bob'"):  # so he cannot release it either
        bob.client.sync(bob.client.scheduler.kv_release_states, session=bob.session.token,
                        state_ids=[record.state_id])
    rows = [r for r in alice.catalog().to_pylist() if r["state_id"] == record.state_id]
    assert rows and {r["namespace"] for r in rows} == {"alice"} and {r["state_status"] for r in rows} == {"live"}
    with pytest.raises(AccessDenied, match="already registered$"):  # nor alice twice: once, by one namespace
        _register(alice, [_meta(record.state_id, record.state.block_keys)])


def test_bob_cannot_list_alices_blocks_in_a_state_of_his(alice, bob, record):
    with pytest.raises(AccessDenied, match="only its own namespace's blocks"):
        _register(bob, [_meta("kvstate-materialize-b0b0b0b0b0b0", record.state.block_keys)])
    mixed = [block_key("4" * 32, "bob"), record.state.block_keys[0]]
    with pytest.raises(AccessDenied, match="only its own namespace's blocks"):
        _register(bob, [_meta("kvstate-materialize-b0b0b0b0b0b1", mixed)])
    assert not [r for r in bob.catalog().to_pylist() if r["block_key"] in record.state.block_keys]
    assert "kvstate-materialize-b0b0b0b0b0b0" not in {r["state_id"] for r in alice.catalog().to_pylist()}


def test_registrations_riding_on_a_release_keep_every_check(alice, bob, record):
    """A release may carry states to register first (``kv_release_states(metas=...)``: a
    fork's, on its parent's release). Bob's release of alice's state refuses the whole call
    before anything is registered; a carried state listing her blocks refuses it before
    anything is released; his own carried fork is registered, then released in one call."""
    bob_state = bob.materialize(bob.encode(PROMPT))
    bob.wait([bob_state])
    keys = bob_state.state.block_keys
    release = lambda ids, metas: bob.client.sync(bob.client.scheduler.kv_release_states,  # noqa: E731
                                                  session=bob.session.token, state_ids=ids, metas=metas)
    with pytest.raises(AccessDenied, match="not one of namespace 'bob'"):
        release([bob_state.state_id, record.state_id], [_meta("kvstate-bob-ride-1", keys)])
    assert "kvstate-bob-ride-1" not in {r["state_id"] for r in bob.catalog().to_pylist()}
    with pytest.raises(AccessDenied, match="own namespace's blocks"):
        release([bob_state.state_id], [_meta("kvstate-bob-ride-2", record.state.block_keys)])
    rows = {r["state_id"]: r["state_status"] for r in bob.catalog().to_pylist()}
    assert rows[bob_state.state_id] == "live" and "kvstate-bob-ride-2" not in rows
    release([bob_state.state_id, "kvstate-bob-ride-3"], [_meta("kvstate-bob-ride-3", keys)])
    rows = {r["state_id"]: r["state_status"] for r in bob.catalog().to_pylist()}
    assert rows[bob_state.state_id] == rows["kvstate-bob-ride-3"] == "released"
    alice_rows = [r for r in alice.catalog().to_pylist() if r["state_id"] == record.state_id]
    assert {r["state_status"] for r in alice_rows} == {"live"}


def test_a_fork_is_registered_by_the_next_call(bob, record):
    """A fork's registration rides on the runtime's next call: its parent's release carries
    it, and a refused call still leaves it registered (sent on its own)."""
    parent = bob.materialize(bob.encode(PROMPT + SUFFIX))
    kids = bob.fork(parent, 2)
    assert len(bob.plugin.pending) == 2
    rows = {r["state_id"] for r in bob.catalog().to_pylist()}  # any call registers them first
    assert {k.state_id for k in kids} <= rows and not bob.plugin.pending
    more = bob.fork(parent, 1)
    bob.release(parent)  # the parent's release carries the fork: one round trip
    rows = {r["state_id"]: r["state_status"] for r in bob.catalog().to_pylist()}
    assert rows[more[0].state_id] == "live" and rows[parent.state_id] == "released"
    late = bob.fork(kids[0], 1)
    with pytest.raises(AccessDenied, match="not one of namespace 'bob'"):
        bob.plugin.release_states([record.state_id])  # refused whole: alice's
    assert late[0].state_id in {r["state_id"] for r in bob.catalog().to_pylist()} and not bob.plugin.pending
    bob.release_many(kids + more + late)


def test_the_wait_is_the_servers(bob):
    with pytest.raises(TypeError, match="timeout"):  # the caller no longer chooses it
        _register(bob, [_meta("kvstate-materialize-b0b0b0b0b0b2", [])], timeout=3600)
    never = [block_key("5" * 32, "bob")]  # a block of his whose task never comes
    t0 = time.monotonic()
    _register(bob, [_meta("kvstate-materialize-b0b0b0b0b0b3", never)])
    waited = time.monotonic() - t0
    assert REGISTER_WAIT - 0.1 <= waited < REGISTER_WAIT + 2.0


def test_registration_waits_for_blocks_submitted_just_before(alice):
    """The client's graphs travel on its stream, its registration over RPC: the server waits for
    the graph, woken as it arrives (a materialize registers its state right after submitting)."""
    t0 = time.monotonic()
    state = alice.materialize(alice.encode(PROMPT + SUFFIX))
    assert time.monotonic() - t0 < REGISTER_WAIT + 30
    listed = {r["block_key"] for r in alice.catalog().to_pylist() if r["state_id"] == state.state_id}
    assert listed == set(state.state.block_keys)


def test_alice_still_releases_her_state_and_reuses_her_cache(alice, record):
    alice.release(record)
    rows = [r for r in alice.catalog().to_pylist() if r["state_id"] == record.state_id]
    assert {r["state_status"] for r in rows} <= {"released"}
    tokens = list(record.tokens)
    again = alice.materialize(tokens)
    assert again.state.lineage[-1].as_dict()["tokens_computed"] == 0  # her cached blocks, still hers
    gen = alice.resume(again, alice.encode(SUFFIX), max_new_tokens=8)
    assert gen.tokens == text_tokens(alice, tokens + alice.encode(SUFFIX))
