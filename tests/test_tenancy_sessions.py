"""Issue 22, items 6 and 7: the second tenant at the sessions, and a scheduler with no tenants.

A session used to name its client at login (so it outlived the client), never expired, was
one of an unbounded number, and rode in task annotations Dask ships to workers. Now a login
binds the session to the client stream the challenge came back on: tasks are the
session's by that stream (a stolen token submits nothing, a login naming another client
binds nothing of it), the session ends with the stream and after ``session-ttl`` unused, a
client holds a bounded number, challenges are bounded and expire, and no token - no
``kv`` annotation at all - reaches a worker. A runtime given a secret on a scheduler with
no tenants, where it would silently be an admin, stops with one line (or warns, if set).

The registry's own rules run on plain asyncio (no cluster); the attacks on a real
2-worker cluster, tenants configured as in ``tests/test_tenancy.py``.
"""

from __future__ import annotations

import asyncio
import time

import dask
import pytest
from distributed import Client

from daskflow_kv.errors import OpenSchedulerError
from daskflow_kv.keys import BIND_OP, PREFILL, RESULT, task_key
from daskflow_kv.plugins import tenants as tn
from daskflow_kv.plugins.tenants import AccessDenied, TenantRegistry, login_proof
from daskflow_kv.runtime.kv_runtime import KVRuntime
from tenancy_kit import PROMPT, SUFFIX, TENANTS, plugin, runtime, tenant, tenant_cluster, text_tokens


# -- the registry's rules ---------------------------------------------------------------------------
def _run(coro_fn):
    async def main():
        conn = asyncio.ensure_future(asyncio.sleep(3600))  # stands for a client's stream: open until cancelled
        try:
            return await coro_fn(conn)
        finally:
            conn.cancel()

    return asyncio.run(main())


async def _login(reg, conn, namespace="alice", client="client-1"):
    nonce = reg.challenge()
    assert reg.bind(nonce, client, conn)
    return await reg.login_client(namespace, nonce, login_proof(TENANTS[namespace]["secret"], nonce, namespace))


def test_a_session_expires_unused_and_lives_while_used():
    async def scenario(conn):
        reg = TenantRegistry(TENANTS, session_ttl=0.4)
        s = await _login(reg, conn)
        for _ in range(3):  # used every 0.25 s: refreshed each time
            await asyncio.sleep(0.25)
            assert reg.session(s.token) is s
        await asyncio.sleep(0.6)
        with pytest.raises(AccessDenied, match="session-ttl"):
            reg.session(s.token)

    _run(scenario)


def test_a_session_ends_with_its_connection_and_its_client():
    async def scenario(conn):
        reg = TenantRegistry(TENANTS)
        s = await _login(reg, conn)
        other = asyncio.ensure_future(asyncio.sleep(3600))
        t = await _login(reg, other, client="client-2")
        other.cancel()
        await asyncio.sleep(0)
        with pytest.raises(AccessDenied):
            reg.session(t.token)  # its stream closed
        assert reg.end_client("client-1") == 1
        with pytest.raises(AccessDenied):
            reg.session(s.token)

    _run(scenario)


def test_a_client_holds_a_bounded_number_of_sessions():
    async def scenario(conn):
        reg = TenantRegistry(TENANTS)
        made = [await _login(reg, conn) for _ in range(tn.MAX_SESSIONS_PER_CLIENT + 4)]
        assert len(reg) == tn.MAX_SESSIONS_PER_CLIENT
        with pytest.raises(AccessDenied):
            reg.session(made[0].token)  # the oldest went first
        assert reg.session(made[-1].token) is made[-1]

    _run(scenario)


def test_challenges_are_bounded_single_use_and_expire(monkeypatch):
    async def scenario(conn):
        reg = TenantRegistry(TENANTS)
        first = reg.challenge()
        for _ in range(tn.MAX_PENDING_NONCES + 10):
            reg.challenge()
        assert len(reg._challenges) == tn.MAX_PENDING_NONCES
        assert not reg.bind(first, "client-1", conn)  # pushed out by the flood
        s = await _login(reg, conn)
        nonce = reg.challenge()
        assert reg.bind(nonce, "client-1", conn) and not reg.bind(nonce, "client-2", conn)  # bound once
        monkeypatch.setattr(tn, "NONCE_TTL", 0.05)
        late = reg.challenge()
        await asyncio.sleep(0.1)
        assert not reg.bind(late, "client-1", conn)
        with pytest.raises(AccessDenied, match="expired"):
            await reg.login_client("alice", late, login_proof(TENANTS["alice"]["secret"], late, "alice"))
        return s

    _run(scenario)


def test_a_login_whose_challenge_never_came_back_on_a_stream_is_refused(monkeypatch):
    monkeypatch.setattr(tn, "BIND_WAIT", 0.2)

    async def scenario(conn):
        reg = TenantRegistry(TENANTS)
        nonce = reg.challenge()  # answered over RPC only
        with pytest.raises(AccessDenied, match="own stream"):
            await reg.login_client("alice", nonce, login_proof(TENANTS["alice"]["secret"], nonce, "alice"))
        # a proof-only login (the dashboard's browser logins) is no session any kv_* call accepts
        nonce = reg.challenge()
        s = reg.login("alice", nonce, login_proof(TENANTS["alice"]["secret"], nonce, "alice"), client="browser")
        with pytest.raises(AccessDenied):
            reg.session(s.token)

    _run(scenario)


# -- the attacks on a real cluster ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tenants():
    with tenant_cluster() as c:
        yield c


alice = tenant("alice", cluster="tenants")
bob = tenant("bob", cluster="tenants")


def _worker_annotations(client) -> list[dict]:
    return [a for got in client.run(lambda dask_worker: [dict(ts.annotations or {}) for ts in
                                                        dask_worker.state.tasks.values()]).values() for a in got]


def test_no_token_and_no_kv_annotation_reaches_a_worker(tenants, alice):
    state = alice.materialize(alice.encode(PROMPT))
    gen = alice.resume(state, alice.encode(SUFFIX), max_new_tokens=4)
    assert gen.tokens == text_tokens(alice, list(state.tokens) + alice.encode(SUFFIX), 4)
    shipped = _worker_annotations(alice.client)
    assert shipped and all("kv" not in a for a in shipped)
    assert alice.session.token not in repr(shipped)
    s = tenants.scheduler
    assert not [k for k, ts in s.tasks.items() if "kv" in (ts.annotations or {})]
    assert all("kv" not in c.annotations for c in s.computations)
    assert plugin(tenants).catalog.blocks  # and yet the plugin read them: the blocks are cataloged


def test_a_stolen_token_submits_nothing(tenants, bob, tmp_path):
    with Client(tenants) as mallory:
        # the token works over RPC (a capability, like a password) ...
        assert mallory.sync(mallory.scheduler.kv_counters, session=bob.session.token)["counters"] is not None
        # ... but tasks are the session's by the client stream they come on: mallory's has none
        fut = mallory.submit(len, b"x", key=task_key(PREFILL, "bob", "stolen"), pure=False)
        with pytest.raises(AccessDenied, match="no session"):
            fut.result(timeout=30)


def test_a_login_naming_another_client_binds_nothing_of_it(tenants, alice, bob):
    with pytest.raises(TypeError, match="client"):  # the login no longer takes a client id
        bob.client.sync(bob.client.scheduler.kv_login, namespace="bob", nonce="0", proof="0", client=alice.client.id)

    async def login_in_alices_name(client):
        nonce = await client.scheduler.kv_challenge()
        client._send_to_scheduler({"op": BIND_OP, "nonce": nonce, "client": alice.client.id})
        return await client.scheduler.kv_login(namespace="bob", nonce=nonce,
                                               proof=login_proof(TENANTS["bob"]["secret"], nonce, "bob"))

    with Client(tenants) as mallory:
        forged = mallory.sync(login_in_alices_name, mallory)["session"]
        # alice's client stream holds no session of bob's: her client cannot run bob's tasks ...
        fut = alice.client.submit(len, b"x", key=task_key(PREFILL, "bob", "via-alice"), pure=False)
        with pytest.raises(AccessDenied, match="no session"):
            fut.result(timeout=30)
        # ... the session is the stream it was bound on, mallory's
        assert mallory.submit(len, b"x", key=task_key(RESULT, "bob", "own"), pure=False).result(timeout=30) == 1
    deadline = time.time() + 10
    while time.time() < deadline:  # and it ends with that stream
        try:
            alice.client.sync(alice.client.scheduler.kv_counters, session=forged)
        except AccessDenied:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the session outlived its client")


def test_a_session_ends_when_its_client_leaves(tenants, alice):
    gone = runtime(tenants, "bob")
    token = gone.session.token
    gone.client.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            alice.client.sync(alice.client.scheduler.kv_snapshot, session=token)
        except AccessDenied:
            return
        time.sleep(0.1)
    raise AssertionError("the session outlived its client")


# -- item 7: a secret on a scheduler with no tenants ------------------------------------------------
def test_a_secret_on_an_open_scheduler_is_one_line_error(cluster):
    with Client(cluster) as c:
        with pytest.raises(OpenSchedulerError, match="no tenants configured") as e:
            KVRuntime(c, "tiny-llama", block_size=16, namespace="alice", secret="alice-secret-8f2c")
        assert "\n" not in str(e.value)


def test_it_may_be_a_warning_instead(cluster):
    with Client(cluster) as c, dask.config.set({"daskflow-kv.open-scheduler": "warn"}):
        with pytest.warns(UserWarning, match="no tenants configured"):
            rt = KVRuntime(c, "tiny-llama", block_size=16, namespace="alice", secret="alice-secret-8f2c")
        assert rt.session.open and rt.session.role == "admin"
    with Client(cluster) as c:  # no secret, no word: one trust domain, as before tenancy
        rt = KVRuntime(c, "tiny-llama", block_size=16, namespace="alice")
        assert rt.session.open
