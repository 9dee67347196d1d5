"""A second user of the same scheduler, trying to read or disturb another tenant's KV.

A real 2-worker LocalCluster whose scheduler has three tenants configured: alice and bob
(users) and ops (admin). Every attack from the issue is played through daskflow-kv's own
API and refused; sharing inside one namespace still works.
"""

import json
import urllib.request

import dask
import pytest
from distributed import Client

from daskflow_kv.keys import short_key
from daskflow_kv.plugins.tenants import AccessDenied
from daskflow_kv.runtime.cluster import local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.runtime.plugin_client import PluginClient
from daskflow_kv.state.blocks import chain_keys, keyed_digest
from tenancy_kit import PROMPT, TENANTS, tenant


@pytest.fixture(scope="module")
def tenant_cluster():
    with dask.config.set({"daskflow-kv.tenants": TENANTS}):
        with local_cluster(n_workers=2, dashboard_address="127.0.0.1:0") as cluster:
            yield cluster


alice = tenant("alice", cluster="tenant_cluster")
bob = tenant("bob", cluster="tenant_cluster")
ops = tenant("ops", cluster="tenant_cluster")


def _runtime(cluster, namespace, secret=None):
    client = Client(cluster)
    secret = TENANTS[namespace]["secret"] if secret is None else secret
    return KVRuntime(client, "tiny-llama", block_size=16, namespace=namespace, secret=secret)


@pytest.fixture(scope="module")
def record(alice):
    """Alice's cached prompt: a state kept live for the whole module."""
    state = alice.materialize(alice.encode(PROMPT))
    alice.wait([state])
    return state


def test_logging_in_needs_the_namespace_secret(tenant_cluster):
    with pytest.raises(AccessDenied, match="refused"):
        _runtime(tenant_cluster, "alice", secret="a guess")
    with pytest.raises(AccessDenied, match="refused"):
        _runtime(tenant_cluster, "mallory", secret="anything")  # unknown namespace: the same answer


def test_calls_without_a_session_are_refused(bob):
    for name, kw in [("kv_catalog", {}), ("kv_counters", {}), ("kv_acquire", {"keys": []})]:
        with pytest.raises(AccessDenied, match="session"):
            bob.client.sync(getattr(bob.client.scheduler, name), session="0" * 32, **kw)


def test_lookup_gives_no_prompt_back(bob, record):
    tokens = bob.encode(PROMPT)
    assert tokens == list(record.tokens)  # same model and tokenizer: bob would compute the same tokens
    for probe in (tokens, tokens[:1], tokens[:17]):
        match = bob.prefixes.find(probe)
        assert match.tokens == 0 and not match.blocks
    # The answer never carries token ids, even for the owner.
    ans = bob.client.sync(bob.client.scheduler.kv_lookup, session=bob.session.token, root=bob.key_digest,
                          keys=[], tokens=tokens[:1], block_size=16)
    assert ans["tokens"] == 0 and not ans["blocks"]


def test_the_owner_and_its_namespace_still_reuse(alice, record, tenant_cluster, monkeypatch):
    answers = []  # the plugin's lookup answers, as they came over the wire
    call = PluginClient.call
    monkeypatch.setattr(PluginClient, "call",
                        lambda self, name, **kw: answers.append(call(self, name, **kw)) or answers[-1])
    mine = alice.prefixes.find(list(record.tokens) + [5])
    monkeypatch.undo()
    assert mine.tokens == record.length and all("tokens" not in b for b in answers[-1]["blocks"])
    colleague = _runtime(tenant_cluster, "alice")  # another client holding alice's secret shares her cache
    try:
        again = colleague.materialize(list(record.tokens))
        assert again.state.block_keys == record.state.block_keys
        assert again.state.lineage[-1].as_dict()["tokens_computed"] == 0
    finally:
        colleague.client.close()


def test_keys_cannot_be_computed_without_the_secret(bob, record):
    tokens = list(record.tokens)
    full = len(tokens) - len(tokens) % 16
    guesses = set()
    for digest in (bob.fingerprint.digest, bob.key_digest, keyed_digest(bob.fingerprint.digest, "alice")):
        for namespace in (None, "alice", "bob"):  # the tag is public: only the secret is missing
            guesses |= {k for k, _, _ in chain_keys(digest, tokens[:full], 16, namespace=namespace)}
    assert not guesses & set(record.state.block_keys)


def test_known_keys_cannot_be_acquired_by_another_tenant(bob, record):
    """Even a leaked key gives nothing through daskflow-kv's API."""
    got = bob.client.sync(bob.client.scheduler.kv_acquire, session=bob.session.token,
                          keys=list(record.state.block_keys))
    assert got == {}


def test_catalog_events_and_counters_are_scoped(alice, bob, ops, record):
    assert "alice" not in set(bob.catalog().column("namespace").to_pylist())
    mine = alice.catalog()
    assert set(mine.column("namespace").to_pylist()) == {"alice"}
    assert set(record.state.block_keys) <= set(mine.column("block_key").to_pylist())
    everyone = ops.catalog()
    assert "alice" in set(everyone.column("namespace").to_pylist())  # the admin sees all
    assert not [e for e in bob.counters()["events"] if e.get("namespace") == "alice"]
    assert [e for e in ops.counters()["events"] if e.get("namespace") == "alice"]


def test_dask_event_log_and_dashboard_show_no_usable_key(bob, record, tenant_cluster):
    """Dask's own event log is readable by any client: keys in it are cut short."""
    logged = json.dumps([m for _, m in bob.client.get_events("daskflow-kv")], default=str)
    assert not any(k in logged for k in record.state.block_keys)
    host = tenant_cluster.scheduler.http_server.port
    page = urllib.request.urlopen(f"http://127.0.0.1:{host}/kv/api.json", timeout=10).read().decode()
    table = urllib.request.urlopen(f"http://127.0.0.1:{host}/kv/catalog.arrow", timeout=10).read()
    for k in record.state.block_keys:
        assert k not in page and k.encode() not in table
    # Anonymous browsers get totals only, not even cut keys (a tenant's own, after a login:
    # tests/test_dashboard_tenancy.py).
    assert short_key(record.state.block_keys[0]) not in page
    assert short_key(record.state.block_keys[0]).encode() not in table


def _status(rt, state_id):
    return {r["state_status"] for r in rt.catalog().to_pylist() if r["state_id"] == state_id}


def test_release_and_knobs_of_others_are_refused(alice, bob, ops, record):
    with pytest.raises(AccessDenied, match="not one of namespace 'bob'"):
        bob.client.sync(bob.client.scheduler.kv_release_states, session=bob.session.token,
                        state_ids=[record.state_id])
    assert "live" in set(alice.catalog().column("state_status").to_pylist())
    own = bob.materialize(bob.encode("Bob's own notes, released with Alice's in one call."))
    with pytest.raises(AccessDenied, match="not one of namespace 'bob'"):  # one foreign id refuses the batch
        bob.client.sync(bob.client.scheduler.kv_release_states, session=bob.session.token,
                        state_ids=[own.state_id, record.state_id])
    assert _status(bob, own.state_id) == {"live"}  # his own not released either
    with pytest.raises(ValueError, match="state_ids must be a list of at most"):  # a bare id is no list of them
        bob.client.sync(bob.client.scheduler.kv_release_states, session=bob.session.token, state_ids=own.state_id)
    assert _status(bob, own.state_id) == {"live"}
    bob.release_many([own, own])  # his own, named twice: one release
    assert own.released and _status(bob, own.state_id) == {"released"}
    with pytest.raises(AccessDenied, match="admin"):
        bob.configure(kv_budget_bytes=1)
    with pytest.raises(AccessDenied, match="admin"):
        bob.client.sync(bob.client.scheduler.kv_evict_now, session=bob.session.token)
    assert bob.counters()["kv_budget_bytes"] is None  # nothing changed
    ops.configure(kv_budget_bytes=1 << 30)  # the admin may
    assert ops.counters()["kv_budget_bytes"] == 1 << 30
    ops.configure(unset_budget=True)

