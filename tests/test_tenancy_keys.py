"""Issue 22, item 2: the second tenant squats a key of the first.

Bob holds full block keys of alice's (Dask's own ``/info/worker/<addr>.html`` lists them to
any browser). He fills the KV budget until alice's cached blocks are evicted, then tries to
be the one who computes them next: a task annotated as her block, a plain task under her
key, his data scattered under it, a task of his own whose annotation names her block. Each
is refused with one ``AccessDenied`` line before anything of it runs, the key stays free,
and alice's next materialize computes her own blocks under it: her resume gives text
mode's tokens. While her blocks are live, a task or data under their keys changes nothing
of hers. A real 2-worker cluster, tenants configured as in ``tests/test_tenancy.py``.
"""

from __future__ import annotations

import os

import dask
import pytest
from distributed import Client

from daskflow_kv.keys import BLOCK, block_key, namespace_tag, short_key, tag_of
from daskflow_kv.plugins.tenants import AccessDenied
from tenancy_kit import BLOCK as BLOCK_TOKENS
from tenancy_kit import PROMPT, SUFFIX, TENANTS, plugin, scheduler_state, tenant, tenant_cluster, text_tokens


def _squat(path: str, nbytes: int = 64):
    """What bob's task would run: it leaves a mark, and returns bob's own 'K/V'."""
    open(path, "w").write("ran")
    return bytes(nbytes)


# No guaranteed share (quota 0): bob must be able to evict alice's cache for the squats below
# (with the default fair share her blocks stay; tests/test_tenancy_quotas.py).
UNGUARDED = {name: {**spec, "quota": 0} for name, spec in TENANTS.items()}


@pytest.fixture(scope="module")
def cluster():
    with tenant_cluster(UNGUARDED, **{"scheduler.admission-patience": "3s"}) as c:
        yield c


alice = tenant("alice", UNGUARDED)
bob = tenant("bob", UNGUARDED)
ops = tenant("ops", UNGUARDED)


@pytest.fixture(scope="module")
def evicted(cluster, alice, bob, ops):
    """Alice's prompt, cached and released; bob fills the budget on its worker until it is evicted.
    -> (alice's tokens, her block keys, her state's metadata for a forged annotation)."""
    tokens = alice.encode(PROMPT)
    state = alice.materialize(tokens)
    alice.wait([state])
    keys, worker, nbytes = list(state.state.block_keys), state.state.worker, state.nbytes
    meta = [{"key": b.key, "start": b.start, "end": b.end, "nbytes": b.nbytes, "tokens": list(b.token_ids)}
            for b in state.state.blocks]
    alice.release(state)
    ops.configure(kv_budget_bytes=3 * nbytes // 2)
    held = None  # bob's newest state, kept (pinned): the budget must take someone else's blocks
    for i in range(8):
        new = bob.materialize(bob.encode(f"{i} Bob's filler context: " + PROMPT[::-1]), worker=worker)
        bob.wait([new])
        if held is not None:
            bob.release(held)
        held = new
        if all(scheduler_state(bob.client, k) in (None, "released", "forgotten") for k in keys):
            break
    assert all(scheduler_state(bob.client, k) in (None, "released", "forgotten") for k in keys), "not evicted"
    assert any(e["op"] == "evict" and e["namespace"] == "alice" for e in plugin(cluster).event_log.events())
    bob.release(held)
    ops.configure(unset_budget=True)
    return tokens, keys, meta


def _refused(fut, tmp_path, key):
    with pytest.raises(AccessDenied, match="refused") as e:
        fut.result(timeout=30)
    assert "\n" not in str(e.value) and key not in str(e.value)  # one line, the key cut short
    assert not os.path.exists(tmp_path / "ran")  # nothing of it ran
    assert scheduler_state(fut.client, key) is None  # forgotten: the key stays free for its owner


def test_a_task_annotated_as_alices_evicted_block_is_refused(bob, evicted, tmp_path):
    tokens, keys, meta = evicted
    forged = {**meta[0], "parent": None, "fingerprint": bob.fingerprint.digest, "root": bob.key_digest,
              "state_id": "kvstate-materialize-000000000000"}
    with dask.annotate(kv={"role": "block", "meta": forged}):
        fut = bob.client.submit(_squat, str(tmp_path / "ran"), key=keys[0], pure=False)
    _refused(fut, tmp_path, keys[0])


def test_a_plain_task_under_alices_evicted_key_is_refused(bob, evicted, tmp_path):
    _, keys, _ = evicted
    fut = bob.client.submit(_squat, str(tmp_path / "ran"), key=keys[1], pure=False)
    _refused(fut, tmp_path, keys[1])
    # and as a dependency inside a bigger graph of his: the whole graph errs, nothing runs
    inner = dask.delayed(_squat, pure=False)(str(tmp_path / "ran"), dask_key_name=keys[1])
    outer = bob.client.compute(dask.delayed(len)(inner, dask_key_name="bobs-consumer"))
    with pytest.raises(AccessDenied):
        outer.result(timeout=30)
    assert not os.path.exists(tmp_path / "ran") and scheduler_state(bob.client, keys[1]) is None


def test_a_client_that_never_logged_in_cannot_compute_a_kv_key(cluster, evicted, tmp_path):
    _, keys, _ = evicted
    with Client(cluster) as mallory:
        _refused(mallory.submit(_squat, str(tmp_path / "ran"), key=keys[0], pure=False), tmp_path, keys[0])
        own = block_key("0" * 32, "mallory")  # a tag no tenant has
        _refused(mallory.submit(_squat, str(tmp_path / "ran"), key=own, pure=False), tmp_path, own)


def test_data_scattered_under_alices_key_is_refused(bob, evicted):
    _, keys, _ = evicted
    for direct in (True, False):
        with pytest.raises(PermissionError, match="refused"):
            bob.client.scatter({keys[0]: bytes(64)}, direct=direct)
    with pytest.raises(PermissionError, match="refused"):
        bob.client.sync(bob.client.scheduler.update_data, who_has={keys[0]: list(bob.client.has_what())[:1]},
                        nbytes={keys[0]: 64}, client=bob.client.id)
    assert scheduler_state(bob.client, keys[0]) is None


def test_bobs_own_task_cannot_publish_alices_block(bob, evicted, tmp_path):
    _, keys, meta = evicted
    own = block_key("1" * 32, "bob")
    assert tag_of(own) == namespace_tag("bob") != tag_of(keys[0])
    forged = {**meta[0], "key": keys[0], "parent": None, "fingerprint": "fp", "root": "fp", "state_id": "s"}
    with dask.annotate(kv={"role": "block", "meta": forged}):  # his key, her block in the annotation
        fut = bob.client.submit(_squat, str(tmp_path / "ran"), key=own, pure=False)
    with pytest.raises(AccessDenied, match="names another block"):
        fut.result(timeout=30)
    own = block_key("2" * 32, "bob")
    chained = {**meta[1], "key": own, "parent": keys[0], "fingerprint": "fp", "root": "fp", "state_id": "s",
               "start": 0, "end": BLOCK_TOKENS, "tokens": list(range(BLOCK_TOKENS))}
    with dask.annotate(kv={"role": "block", "meta": chained}):  # his block hung under hers
        fut = bob.client.submit(_squat, str(tmp_path / "ran"), key=own, pure=False)
    with pytest.raises(AccessDenied, match="parent"):
        fut.result(timeout=30)
    assert not os.path.exists(tmp_path / "ran")
    assert not [r for r in bob.catalog().to_pylist() if r["block_key"] in keys]


def test_after_every_squat_alices_next_materialize_computes_her_own_blocks(alice, evicted):
    tokens, keys, _ = evicted
    again = alice.materialize(tokens)
    alice.wait([again])
    assert list(again.state.block_keys) == keys  # the same content addresses, hers again
    assert again.state.lineage[-1].as_dict()["tokens_computed"] > 0  # recomputed, not taken from anyone
    gen = alice.resume(again, alice.encode(SUFFIX), max_new_tokens=8)
    assert gen.tokens == text_tokens(alice, list(tokens) + alice.encode(SUFFIX))
    rows = [r for r in alice.catalog().to_pylist() if r["block_key"] in keys]
    assert rows and {r["namespace"] for r in rows} == {"alice"}
    alice.release(again)


def test_a_live_key_keeps_alices_value_whatever_bob_submits_under_it(alice, bob, tmp_path):
    tokens = alice.encode("(live) " + PROMPT)
    live = alice.materialize(tokens)
    alice.wait([live])
    key = live.state.block_keys[0]
    before = live.futures[0].result()
    # Dask keeps the first run spec of a key it holds: bob's task under it never runs (he may
    # fetch the key by name - outside the boundary - but cannot change it).
    fut = bob.client.submit(_squat, str(tmp_path / "ran"), key=key, pure=False)
    assert bool((fut.result(timeout=30) == before).all())
    assert not os.path.exists(tmp_path / "ran")
    with pytest.raises(PermissionError, match="refused"):  # no second copy of his on a worker either
        bob.client.scatter({key: bytes(64)}, broadcast=True)
    del fut
    gen = alice.resume(live, alice.encode(SUFFIX), max_new_tokens=8)
    assert gen.tokens == text_tokens(alice, list(tokens) + alice.encode(SUFFIX))
    assert bool((live.futures[0].result() == before).all())
    alice.release(live)


def test_refusals_name_keys_cut_short(bob):
    key = block_key("3" * 32, "alice")  # a key of alice's no task computed yet
    fut = bob.client.submit(len, b"x", key=key, pure=False)
    with pytest.raises(AccessDenied) as e:
        fut.result(timeout=30)
    assert short_key(key) in str(e.value) and key not in str(e.value) and str(e.value).startswith("task ")
    assert "namespace 'alice'" in str(e.value) and key.startswith(BLOCK + "-")
