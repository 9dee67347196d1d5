"""Issue 22, item 1: the second tenant at the shared store, through real runtimes.

Alice and bob run on one tenants-configured cluster over one real store directory (every
client and worker must reach its URL, so bob can walk it). Alice's shared context is
written through; bob lists the store, walks its directories (issue 51: object names used
to be full keys, telling him her keys and which directory is hers; now keyed hashes),
reads alice's blocks by key, overwrites one of her objects with his own K/V sealed under her
key, and garbage-collects with an age of zero: each step fails. Alice's next cluster on the
same store reads her context back - the forged object is a miss, its blocks recomputed -
and resumes with text mode's tokens.
(The store's own attacks, object by object: ``tests/test_store_tenancy.py``.)
"""

from __future__ import annotations

import os

from conftest import wait_until

from daskflow_kv.keys import content_key, namespace_tag
from daskflow_kv.policy.cost_model import PrefillProfile
from daskflow_kv.store import maintenance as mt
from daskflow_kv.store import worker_io
from daskflow_kv.store.codec import encode
from tenancy_kit import PROMPT, SUFFIX, plugin, runtime, tenant_cluster, text_tokens

SLOW_PREFILL = PrefillProfile.from_rate(20.0)  # tokens/s: the cost model then prefers loading from the store


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _store_runtime(cluster, namespace, url):
    rt = runtime(cluster, namespace, kv_store=url)
    rt.prefill_override = SLOW_PREFILL
    rt.bandwidth_override = 1e9
    return rt


def test_bob_cannot_list_read_overwrite_or_collect_alices_store_objects(tmp_path):
    url = str(tmp_path / "kv")
    tokens = forged_at = None
    with tenant_cluster() as cluster:
        alice, bob = _store_runtime(cluster, "alice", url), _store_runtime(cluster, "bob", url)
        try:
            tokens = alice.encode(PROMPT)
            state = alice.materialize(tokens)
            alice.wait([state])
            assert alice.flush_store(30) == 0
            keys = list(state.state.block_keys)
            assert alice.store.leading(keys) == len(keys)  # all of it written through
            mine = bob.materialize(bob.encode("Bob's own context, to have K/V of his own: " + PROMPT[::-1]))
            bob.wait([mine])
            assert bob.flush_store(30) == 0

            # list: bob's view of the store holds only his own objects
            assert {r["key"] for r in mt.listing(bob.store)} == set(mine.state.block_keys)
            assert {b.name for b in mt.scan(bob.store)} == {bob.store.tenant.object_name(k)
                                                            for k in mine.state.block_keys}
            # read: by key, in bob's client and in a load task on a worker, as bob
            assert all(bob.store.get(k) is None for k in keys)
            loaded = bob.client.submit(worker_io.load_blocks, url, keys, bob.tier.tenant, pure=False).result()
            assert loaded.stopped == "miss" and not loaded.blocks

            # walk (issue 51, item 4): objects are named by keyed hashes - no path holds a key of
            # alice's, nor either namespace's tag, so nothing says whose directory is whose
            walked = _files(url)
            assert not any(content_key(k)[len("kvblock-"):] in p for p in walked for k in keys)
            assert not any(namespace_tag(ns) in p for p in walked for ns in ("alice", "bob"))
            others = [p for p in walked if p.endswith(".kvobj") and f"/{bob.tier.tenant.prefix}/" not in f"/{p}"]
            assert len(others) == len(keys)  # he sees how many objects another directory holds, not what
            # overwrite: bob seals his own K/V under her key over one of her objects (which one is
            # her second block he cannot tell: the test picks it, he could only try them all)
            target = keys[1]
            forged_at = state.state.blocks[1].start
            path = alice.store.block_path(target)
            assert path in others
            forged, _ = encode(mine.futures[1].result(), target, state.state.blocks[1].start,
                               state.state.blocks[1].end, bob.fingerprint.digest, path=path, tenant=bob.tier.tenant)
            bob.store.backend.write_atomic(path, forged)

            # collect: bob's gc, every object counted stale, deletes only his
            before = [p for p in _files(url) if f"/{bob.tier.tenant.prefix}/" not in f"/{p}"]
            report = mt.gc(bob.store, 0)
            assert report.deleted >= len(mine.state.block_keys)
            assert [p for p in _files(url) if f"/{bob.tier.tenant.prefix}/" not in f"/{p}"] == before
            assert mt.scan(bob.store) == []
        finally:
            alice.client.close()
            bob.client.close()

    # alice's next cluster: her context comes back from the store, the forged block is a miss
    with tenant_cluster() as cluster:
        alice = _store_runtime(cluster, "alice", url)
        try:
            again = alice.materialize(tokens)
            alice.wait([again])
            assert alice.store_decisions and alice.store_decisions[-1].action == "load"
            lineage = again.state.lineage[-1].as_dict()
            # read up to the forged block, which fails verification; from there on recomputed
            assert (lineage.get("tokens_from_store"), lineage["tokens_computed"]) == (forged_at,
                                                                                  len(tokens) - forged_at)
            assert wait_until(lambda: plugin(cluster).catalog.counters["store_corrupt"] >= 1)
            gen = alice.resume(again, alice.encode(SUFFIX), max_new_tokens=8)
            assert gen.tokens == text_tokens(alice, list(tokens) + alice.encode(SUFFIX))
        finally:
            alice.client.close()
