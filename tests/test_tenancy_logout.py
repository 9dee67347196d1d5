"""Issue 51, item 1 and the admin token: the second tenant logs another tenant out, or acts as the admin.

The bind message used to carry ``client=``, and the plugin took the session's client from
it: bob logged in 20 times as himself, naming alice's client (and the admin's) each time,
and the per-client cap of 16 dropped their own sessions - alice's next call failed with
"no valid daskflow-kv session" (every client id is readable from Dask's event log). Now
the client is the one whose stream the bind came on (``dask_internals.stream_client``):
bob's logins are bob's, counted against his own client, whatever the message says.

The admin's token was a bearer credential: any client holding it could change the budget,
force evictions or drop every tenant's cache. Now such a call also needs a fresh challenge
sent back on the admin client's own stream (``tenants.admin``).

A real 2-worker cluster, tenants configured as in ``tests/test_tenancy.py``.
"""

from __future__ import annotations

import pytest
from distributed import Client

from daskflow_kv.keys import BIND_OP
from daskflow_kv.plugins import tenants as tn
from daskflow_kv.plugins.tenants import AccessDenied, login_proof
from daskflow_kv.runtime.session import stream_challenge
from tenancy_kit import PROMPT, SUFFIX, TENANTS, cluster_fixture, plugin, tenant, text_tokens


cluster = cluster_fixture()
alice = tenant("alice")
ops = tenant("ops")


async def _login_naming(client, victims: list[str]) -> str:
    """Bob's login on ``client``'s stream, whose bind message names ``victims``' clients."""
    nonce = await client.scheduler.kv_challenge()
    for victim in victims:  # every field a message can carry that once named the client
        client._send_to_scheduler({"op": BIND_OP, "nonce": nonce, "client": victim})
    ans = await client.scheduler.kv_login(namespace="bob", nonce=nonce,
                                          proof=login_proof(TENANTS["bob"]["secret"], nonce, "bob"))
    return ans["session"]


def test_logins_naming_another_client_log_nobody_out(cluster, alice, ops):
    registry = plugin(cluster).tenants
    with Client(cluster) as mallory:
        tokens = [mallory.sync(_login_naming, mallory, [alice.client.id, ops.client.id])
                  for _ in range(tn.MAX_SESSIONS_PER_CLIENT + 4)]
        # every login was bob's client's own: the cap dropped only bob's oldest sessions
        assert registry.sessions_of(mallory.id) == tn.MAX_SESSIONS_PER_CLIENT
        assert registry.sessions_of(alice.client.id) == 1 and registry.sessions_of(ops.client.id) == 1
        with pytest.raises(AccessDenied, match="no valid daskflow-kv session"):
            mallory.sync(mallory.scheduler.kv_counters, session=tokens[0])
        assert mallory.sync(mallory.scheduler.kv_counters, session=tokens[-1])["counters"] is not None
    # alice's and the admin's sessions live on: her next materialize and resume run as text mode's
    state = alice.materialize(alice.encode(PROMPT))
    gen = alice.resume(state, alice.encode(SUFFIX), max_new_tokens=6)
    assert gen.tokens == text_tokens(alice, list(state.tokens) + alice.encode(SUFFIX), 6)
    assert ops.counters()["counters"] is not None


def test_the_admin_token_alone_changes_nothing(cluster, alice, ops):
    token = ops.session.token
    budget = ops.counters()["kv_budget_bytes"]
    with Client(cluster) as mallory:
        calls = [("kv_configure", {"kv_budget_bytes": 1}), ("kv_evict_now", {}), ("kv_drop", {}),
                 ("kv_gate_configure", {"per_worker": 0.5})]
        for name, kw in calls:
            with pytest.raises(AccessDenied, match="own stream") as e:  # the token, no confirmation
                mallory.sync(getattr(mallory.scheduler, name), session=token, **kw)
            assert "\n" not in str(e.value)
            confirm = mallory.sync(stream_challenge, mallory)  # confirmed, but on mallory's own stream
            with pytest.raises(AccessDenied, match="own stream"):
                mallory.sync(getattr(mallory.scheduler, name), session=token, confirm=confirm, **kw)
    assert ops.counters()["kv_budget_bytes"] == budget  # nothing changed
    assert plugin(cluster).catalog.blocks  # nothing dropped
    ops.configure(kv_budget_bytes=1 << 30)  # the admin's own client confirms on its own stream
    assert ops.counters()["kv_budget_bytes"] == 1 << 30
    ops.configure(unset_budget=True)
    with pytest.raises(AccessDenied, match="admin role"):  # a user is no admin, confirmed or not
        alice.configure(kv_budget_bytes=1)
