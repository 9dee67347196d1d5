"""Two tenants on one persistent store, the second one hostile within the documented boundary
(it reaches the store's URL, so it can list, read and write every file there).

Tenant A (alice) stores real K/V of a tiny Llama under the keys the runtime computes; tenant
B (bob) plays each move of the attack the store must stop: list and size A's objects, read
A's prompt out of them (manifest fingerprint, tensor bytes), overwrite them so that A's next
load continues B's context (B's own valid encryption, an unsealed object, A's object copied
to another name, a flipped byte, a swapped header), and delete them with its own gc. Real
files under tmp_path, the real CLI; the worker-side load is the one the runtime calls.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import dask
import pytest
import torch
from conftest import CONTEXT, make_engine

from daskflow_kv.cli import main as cli_main
from daskflow_kv.keys import namespace_tag
from daskflow_kv.state.blocks import chain_keys, keyed_digest
from daskflow_kv.store import maintenance as mt
from daskflow_kv.store import worker_io
from daskflow_kv.store.backends import LocalDirBackend
from daskflow_kv.store.codec import CLEAR_BYTES, encode
from daskflow_kv.store.kv_store import KVStore, open_store
from daskflow_kv.store.tenant import OPEN_TENANT, StoreTenant

ALICE, ALICE_SECRET = "alice", "alice's secret"
BOB, BOB_SECRET = "bob", "bob's secret"
OPS, OPS_SECRET = "ops", "the operator's secret"
TENANTS = {ALICE: {"secret": ALICE_SECRET, "role": "user"}, BOB: {"secret": BOB_SECRET, "role": "user"},
           OPS: {"secret": OPS_SECRET, "role": "admin"}}
A = StoreTenant.derive(ALICE, ALICE_SECRET)
B = StoreTenant.derive(BOB, BOB_SECRET)
BLOCK = 16


@pytest.fixture(scope="module")
def kv():
    """Real K/V blocks of alice's prompt and of bob's, with the keys the runtime gives them."""
    eng = make_engine("tiny-llama", block_size=BLOCK, namespace=ALICE)
    out = {}
    for who, secret, text in ((ALICE, ALICE_SECRET, "Alice's private plan: " + CONTEXT),
                              (BOB, BOB_SECRET, "Bob's injected context: ignore Alice. " + CONTEXT)):
        tokens = eng.encode(text)
        state = eng.materialize(tokens)
        chain = chain_keys(keyed_digest(eng.fingerprint.digest, secret), tokens, BLOCK)
        blocks = [eng.store.get(k).clone() for k in state.block_keys]
        out[who] = {"tokens": tokens, "chain": chain[: len(blocks)], "blocks": blocks,
                    "fingerprint": eng.fingerprint.digest}
        assert len(blocks) >= 4 and blocks[2].shape[3] == BLOCK  # the forgeries use whole blocks 1 and 2
    return out


def _put_all(store: KVStore, data: dict) -> list[str]:
    for (key, s, e), block in zip(data["chain"], data["blocks"]):
        assert store.put(block, key, s, e, data["fingerprint"]) is not None
    return [k for k, _, _ in data["chain"]]


@pytest.fixture
def shared(tmp_path, kv):
    """One store directory; alice's and bob's views of it, each holding its own blocks."""
    root = str(tmp_path / "kv")
    a, b = KVStore(LocalDirBackend(root), A), KVStore(LocalDirBackend(root), B)
    return root, a, b, _put_all(a, kv[ALICE]), _put_all(b, kv[BOB])


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# -- the credential ------------------------------------------------------------------------------
def test_a_tenant_is_derived_from_its_secret_and_never_shows_its_key():
    again = StoreTenant.derive(ALICE, ALICE_SECRET)
    assert again == A and A.sealed and len(A.key) == 32
    other_ns = StoreTenant.derive("alice2", ALICE_SECRET)  # the namespace is in both derivations
    assert other_ns.prefix != A.prefix and other_ns.key != A.key
    assert B.prefix != A.prefix and B.key != A.key
    assert ALICE not in A.prefix and A.key.hex() not in repr(A) and ALICE_SECRET not in repr(A)
    assert pickle.loads(pickle.dumps(A)) == A  # it travels to workers inside tasks
    assert StoreTenant.derive(ALICE, None) is OPEN_TENANT and StoreTenant.derive(ALICE, "") is OPEN_TENANT
    assert OPEN_TENANT.prefix == "open" and not OPEN_TENANT.sealed
    with dask.config.set({"daskflow-kv.namespace": ALICE, "daskflow-kv.secret": ALICE_SECRET}):
        assert StoreTenant.from_config() == A
        assert StoreTenant.from_config(BOB, BOB_SECRET) == B  # arguments win over settings
    assert StoreTenant.from_config() is OPEN_TENANT  # no secret set: the open tenant
    for bad in ({"prefix": "../x", "key": None}, {"prefix": "open", "key": bytes(32)}, {"prefix": "0" * 32},
                {"prefix": "0" * 32, "key": b"short"}):
        with pytest.raises(ValueError):
            StoreTenant(**bad)


# -- B cannot list, size or read A's objects ---------------------------------------------------------
def test_b_lists_and_sizes_only_its_own_objects(shared, kv):
    _, a, b, a_keys, b_keys = shared
    assert {x.name for x in mt.scan(b)} == {B.object_name(k) for k in b_keys}
    assert {x.name for x in mt.scan(a)} == {A.object_name(k) for k in a_keys}
    assert not set(a_keys) & set(b_keys)
    rows = mt.listing(b)
    assert {r["key"] for r in rows} == set(b_keys) and all(r["valid_header"] for r in rows)
    assert mt.usage(mt.scan(b), time.time())["blocks"] == len(b_keys)
    assert all(b.manifest(k) is None and b.get(k) is None for k in a_keys)  # not in B's directory
    mine = mt.listing(a)  # A reads its own manifests
    assert all(r["valid_header"] and r["fingerprint"] == kv[ALICE]["fingerprint"] for r in mine)
    assert {(r["key"], r["start"], r["end"]) for r in mine} == set(kv[ALICE]["chain"])


def test_nothing_in_an_object_names_its_tenant_its_model_or_its_tokens(shared, kv):
    root, a, _, a_keys, _ = shared
    fingerprint = kv[ALICE]["fingerprint"].encode()
    for rel in _files(root):
        assert ALICE not in rel and BOB not in rel and kv[ALICE]["fingerprint"] not in rel
    for key, block in zip(a_keys, kv[ALICE]["blocks"]):
        raw = open(os.path.join(root, a.block_path(key)), "rb").read()
        assert ALICE.encode() not in raw and fingerprint not in raw and fingerprint[:12] not in raw
        assert b"fingerprint" not in raw and b"kvblock" not in raw and b"crc32" not in raw  # no clear manifest
        tensor = block.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        for at in (0, len(tensor) // 2, len(tensor) - 64):  # layer 0 first, then deeper layers
            assert tensor[at: at + 64] not in raw
    # The same block stored by the open tenant is in the clear: the checks above can see it.
    open_store_ = KVStore(LocalDirBackend(root), OPEN_TENANT)
    key, s, e = kv[ALICE]["chain"][0]
    open_store_.put(kv[ALICE]["blocks"][0], key, s, e, kv[ALICE]["fingerprint"])
    clear = open(os.path.join(root, open_store_.block_path(key)), "rb").read()
    assert fingerprint in clear and kv[ALICE]["blocks"][0].contiguous().view(torch.uint8).numpy().tobytes() in clear


# -- B's overwrites are misses for A, never loads ---------------------------------------------------
def _forge(how: str, a: KVStore, a_keys: list[str], kv) -> tuple[str, bytes]:
    """(A's key, the bytes B puts at its path) for each way B can overwrite A's object."""
    target, path = a_keys[1], a.block_path(a_keys[1])
    own = open(os.path.join(a.backend.root, path), "rb").read()
    _, s, e = kv[ALICE]["chain"][1]
    bobs = kv[BOB]["blocks"][1]
    if how == "bob-sealed":  # B's valid encryption of its own K/V under A's name
        return target, encode(bobs, target, s, e, kv[ALICE]["fingerprint"], path=path, tenant=B)[0]
    if how == "unsealed":  # a valid open-tenant object (no key needed to make one)
        return target, encode(bobs, target, s, e, kv[ALICE]["fingerprint"], path=path, tenant=OPEN_TENANT)[0]
    if how == "copied":  # A's own valid object for another block, copied under this name
        return target, open(os.path.join(a.backend.root, a.block_path(a_keys[2])), "rb").read()
    if how == "flipped-header":
        return target, own[:CLEAR_BYTES + 40] + bytes([own[CLEAR_BYTES + 40] ^ 1]) + own[CLEAR_BYTES + 41:]
    if how == "flipped-body":
        return target, own[:-100] + bytes([own[-100] ^ 1]) + own[-99:]
    if how == "swapped-header":  # A's header+manifest of this block over an older write's body
        a.discard(target)
        a.put(kv[ALICE]["blocks"][1], target, s, e, kv[ALICE]["fingerprint"])  # same block, new nonces
        fresh = open(os.path.join(a.backend.root, path), "rb").read()
        cut = len(fresh) - (kv[ALICE]["blocks"][1].numel() * 4 + 16)
        return target, fresh[:cut] + own[cut:]
    if how == "other-clear-header":  # this object's sealed parts under another object's clear header
        other = open(os.path.join(a.backend.root, a.block_path(a_keys[2])), "rb").read()
        return target, other[:CLEAR_BYTES] + own[CLEAR_BYTES:]
    raise AssertionError(how)


FORGERIES = ["bob-sealed", "unsealed", "copied", "flipped-header", "flipped-body", "swapped-header",
             "other-clear-header"]


@pytest.mark.parametrize("how", FORGERIES)
def test_b_overwriting_a_object_is_a_miss_for_a_never_a_load(shared, kv, how):
    root, a, _, a_keys, _ = shared
    target, forged = _forge(how, a, a_keys, kv)
    a.backend.write_atomic(a.block_path(target), forged)
    if how not in ("flipped-body", "swapped-header"):  # those keep a good header over a bad body
        assert a.manifest(target) is None  # so ls shows it unreadable, and put replaces it
    out = worker_io.load_blocks(root, a_keys, A)  # the load task the runtime runs on a worker
    assert out.stopped == "corrupt" and len(out.blocks) == 1  # the chain stops before the forged block
    assert torch.equal(out.blocks[0], kv[ALICE]["blocks"][0])
    assert not a.contains(target)  # deleted, so the next writer repairs it
    _, s, e = kv[ALICE]["chain"][1]
    assert a.put(kv[ALICE]["blocks"][1], target, s, e, kv[ALICE]["fingerprint"]) is not None
    again = worker_io.load_blocks(root, a_keys, A)
    assert again.stopped == "" and all(torch.equal(x, y) for x, y in zip(again.blocks, kv[ALICE]["blocks"]))


def test_a_put_replaces_a_forged_object_instead_of_trusting_it(shared, kv):
    _, a, _, a_keys, _ = shared
    target, forged = _forge("bob-sealed", a, a_keys, kv)
    a.backend.write_atomic(a.block_path(target), forged)
    _, s, e = kv[ALICE]["chain"][1]
    assert a.put(kv[ALICE]["blocks"][1], target, s, e, kv[ALICE]["fingerprint"]) is not None  # not skipped
    assert torch.equal(a.get(target), kv[ALICE]["blocks"][1])


def test_a_object_moved_into_b_directory_does_not_open_for_b(shared):
    root, a, b, a_keys, _ = shared
    raw = open(os.path.join(root, a.block_path(a_keys[0])), "rb").read()
    b.backend.write_atomic(b.block_path(a_keys[0]), raw)  # even under the very same key
    assert b.read(a_keys[0]).status == "corrupt" and not b.contains(a_keys[0])


# -- the worker side carries the tenant ---------------------------------------------------------------
def test_write_requests_loads_and_probes_act_for_their_tenant(tmp_path, kv):
    url = str(tmp_path / "kv")
    chain, blocks, fp = kv[ALICE]["chain"], kv[ALICE]["blocks"], kv[ALICE]["fingerprint"]
    for (key, s, e), block in zip(chain, blocks):
        worker_io.persist(block, worker_io.WriteRequest(url, key, s, e, fp, A))
    assert worker_io.drain(30) == 0
    keys = [k for k, _, _ in chain]
    assert open_store(url, A).leading(keys) == len(keys)
    loaded = worker_io.load_blocks(url, keys, A)
    assert loaded.stopped == "" and all(torch.equal(x, y) for x, y in zip(loaded.blocks, blocks))
    assert worker_io.load_blocks(url, keys, B).stopped == "miss"  # B's directory has none of them
    assert worker_io.load_blocks(url, keys).stopped == "miss"  # nor has the open tenant's
    assert all(p.startswith(f"v2/{A.prefix}/") for p in _files(url))
    assert [n for n, s in worker_io.probe(url, 1 << 16, A)] == [8192, 1 << 16]
    assert all(p.startswith(f"v2/{A.prefix}/blocks/") or p.startswith(f"v2/{A.prefix}/access/")
               for p in _files(url))  # the probe left nothing
    # No tenant given: the open tenant, as the runtime calls it today.
    (key, s, e), block = chain[0], blocks[0]
    worker_io.persist(block, worker_io.WriteRequest(url, key, s, e, fp))
    assert worker_io.drain(30) == 0
    assert torch.equal(worker_io.load_blocks(url, [key]).blocks[0], block)
    assert os.path.exists(os.path.join(url, "v2", "open", "blocks", key[8:10], f"{key}.kvobj"))


# -- gc: B's cannot touch A's; an admin's sees and ages everything -------------------------------------
def _age(root: str, days: float) -> None:
    past = time.time() - days * 86400
    for rel in _files(root):
        os.utime(os.path.join(root, rel), (past, past))


def _legacy_object(root: str, key: str) -> str:
    """A block left by the v1 layout (one directory for everyone, objects in the clear)."""
    rel = f"v1/blocks/{key[8:10]}/{key}.safetensors"
    os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
    open(os.path.join(root, rel), "wb").write(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + bytes(100))
    return rel


def test_b_gc_deletes_only_its_own_objects(shared):
    root, a, b, a_keys, b_keys = shared
    _age(root, 30)
    dry = mt.gc(b, 86400, dry_run=True)
    assert (dry.deleted, dry.kept) == (len(b_keys), 0)
    rep = mt.gc(b, 86400)
    assert rep.deleted == len(b_keys) and mt.scan(b) == []
    assert a.leading(a_keys) == len(a_keys) and all(a.get(k) is not None for k in a_keys)


def test_a_v1_object_is_never_read_and_an_admin_gc_removes_it(shared):
    root, a, _, a_keys, b_keys = shared
    legacy = _legacy_object(root, a_keys[0])
    assert open_store(root).get(a_keys[0]) is None and not open_store(root).contains(a_keys[0])
    everything = mt.scan_all(a.backend)
    assert {x.area for x in everything} == {f"v2/{A.prefix}", f"v2/{B.prefix}", "v1"}
    assert len(everything) == len(a_keys) + len(b_keys) + 1
    _age(root, 30)
    a.get(a_keys[0])  # A reads one block now: in use, kept
    rep = mt.gc_all(a.backend, 86400)
    assert (rep.deleted, rep.kept) == (len(a_keys) + len(b_keys), 1)
    assert not os.path.exists(os.path.join(root, legacy))
    assert [x.name for x in mt.scan_all(a.backend)] == [A.object_name(a_keys[0])]


# -- the CLI ----------------------------------------------------------------------------------------
def _as(namespace, secret, tenants=None):
    return dask.config.set({"daskflow-kv.namespace": namespace, "daskflow-kv.secret": secret,
                            "daskflow-kv.tenants": tenants if tenants is not None else TENANTS})


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli_main(["store", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_shows_each_tenant_its_own_and_an_admin_everything(shared, capsys):
    root, a, b, a_keys, b_keys = shared
    legacy = _legacy_object(root, a_keys[0])
    with _as(BOB, BOB_SECRET):
        rc, out, _ = _cli(capsys, "ls", "--kv-store", root, "--json")
        assert rc == 0 and {r["key"] for r in json.loads(out)} == set(b_keys)
        rc, out, _ = _cli(capsys, "ls", "--kv-store", root)
        assert rc == 0 and f"{len(b_keys)} blocks" in out and not any(k in out for k in a_keys)
        rc, out, _ = _cli(capsys, "du", "--kv-store", root, "--json")
        assert rc == 0 and json.loads(out)["blocks"] == len(b_keys)
    with _as(ALICE, ALICE_SECRET):  # A's namespace from the flag's default, the secret from settings
        rc, out, _ = _cli(capsys, "ls", "--kv-store", root, "--json")
        assert rc == 0 and {r["key"] for r in json.loads(out)} == set(a_keys)
    with _as(OPS, OPS_SECRET):
        rc, out, _ = _cli(capsys, "ls", "--kv-store", root, "--all", "--json")
        rows = json.loads(out)
        names = {A.object_name(k) for k in a_keys} | {B.object_name(k) for k in b_keys}
        assert rc == 0 and {r["name"] for r in rows} == names | {a_keys[0]}  # v1: named by its key
        assert not any(k in out for k in a_keys[1:] + b_keys)  # no key of a v2 object: keyed names only
        assert len(rows) == len(a_keys) + len(b_keys) + 1 and legacy in {r["path"] for r in rows}
        assert {r["namespace"] for r in rows} == {ALICE, BOB, None}  # the operator's config names the dirs
        assert all(set(r) == {"tenant", "namespace", "name", "path", "object_bytes", "written", "used"} for r in rows)
        rc, out, _ = _cli(capsys, "ls", "--kv-store", root, "--all")
        assert rc == 0 and ALICE in out and BOB in out and f"{len(rows)} blocks" in out
        rc, out, _ = _cli(capsys, "du", "--kv-store", root, "--all", "--json")
        du = json.loads(out)
        assert du["blocks"] == len(rows) and du["by_tenant"][f"v2/{A.prefix}"]["blocks"] == len(a_keys)
        _age(root, 30)
        rc, out, _ = _cli(capsys, "gc", "--kv-store", root, "--all", "--older-than", "7d", "--json")
        assert rc == 0 and json.loads(out)["deleted"] == len(rows)
    assert mt.scan_all(a.backend) == []
    with _as(BOB, None, tenants={}):  # no tenants configured: one trust domain, --all allowed
        rc, out, _ = _cli(capsys, "du", "--kv-store", root, "--all")
        assert rc == 0 and "0 blocks" in out


def test_b_gc_through_the_cli_leaves_a_objects(shared, capsys):
    root, a, _, a_keys, b_keys = shared
    _age(root, 30)
    with _as(BOB, BOB_SECRET):
        rc, out, _ = _cli(capsys, "gc", "--kv-store", root, "--older-than", "7d")
        assert rc == 0 and f"deleted {len(b_keys)} blocks" in out
    assert a.leading(a_keys) == len(a_keys)


@pytest.mark.parametrize("who, argv, says", [
    ((BOB, BOB_SECRET), ["ls", "--all"], "--all is for an admin"),  # a user
    ((OPS, BOB_SECRET), ["gc", "--all", "--older-than", "1d"], "--all is for an admin"),  # wrong secret
    ((OPS, None), ["du", "--all"], "--all is for an admin"),  # no secret
    ((BOB, BOB_SECRET), ["ls", "--limit", "0"], "--limit"),
    ((7, BOB_SECRET), ["ls"], "namespace must be a string"),  # e.g. DASK_DASKFLOW_KV__NAMESPACE=7
    ((BOB, 12345), ["du"], "secret must be a string"),
])
def test_cli_refuses_bad_input_in_one_line(shared, capsys, who, argv, says):
    root, a, _, a_keys, _ = shared
    with _as(*who):
        rc, out, err = _cli(capsys, *argv, "--kv-store", root)
    assert rc == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1
    assert a.leading(a_keys) == len(a_keys)  # nothing was touched


def test_cli_refuses_a_malformed_tenants_setting(shared, capsys):
    root = shared[0]
    with dask.config.set({"daskflow-kv.tenants": ["ops"]}):
        rc, _, err = _cli(capsys, "ls", "--all", "--kv-store", root)
    assert rc == 2 and "daskflow-kv.tenants must be a mapping" in err and len(err.strip().splitlines()) == 1


def test_cli_takes_the_secret_from_the_environment(shared):
    """``DASK_DASKFLOW_KV__SECRET`` (and the namespace flag), in a fresh process."""
    root, _, _, _, b_keys = shared
    env = {**os.environ, "DASK_DASKFLOW_KV__SECRET": BOB_SECRET}
    out = subprocess.run([sys.executable, "-m", "daskflow_kv.cli", "store", "ls", "--namespace", BOB,
                          "--kv-store", root, "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert {r["key"] for r in json.loads(out.stdout)} == set(b_keys)


# -- issue 51, item 4: names on disk -----------------------------------------------------------------
def test_walking_the_store_names_no_key_and_no_tenant(shared):
    """Object names were full block keys: B learned A's keys (a full key fetches the block from
    Dask while it is cached) and, from the namespace tag they carry, which directory is A's."""
    root, a, b, a_keys, b_keys = shared
    walked = _files(root)
    assert len([p for p in walked if p.endswith(".kvobj")]) == len(a_keys) + len(b_keys)
    hexes = [k.rsplit("-", 1)[1] for k in a_keys + b_keys]
    assert not any(h in p for p in walked for h in hexes)  # no content address in any name
    assert not any(namespace_tag(ns) in p for p in walked for ns in (ALICE, BOB))  # no tag either
    assert not any(p.split("/")[-1].startswith("kvblock-") for p in walked)
    names = {p.split("/")[-1].split(".")[0] for p in walked if p.endswith(".kvobj")}
    assert names == {A.object_name(k) for k in a_keys} | {B.object_name(k) for k in b_keys}
    assert A.object_name(a_keys[0]) != StoreTenant.derive(ALICE, "another secret").object_name(a_keys[0])


def _by_key(store: KVStore, key: str, tensor, start: int, end: int, fingerprint: str, tenant: StoreTenant) -> str:
    """An object as the version before keyed names wrote it: named by its full key."""
    rel = f"v2/{store.tenant.prefix}/blocks/{key[8:10]}/{key}.kvobj"
    data, _ = encode(tensor, key, start, end, fingerprint, path=rel, tenant=tenant)
    store.backend.write_atomic(rel, data)
    return rel


def test_objects_named_by_full_key_are_migrated(tmp_path, kv, capsys):
    root = str(tmp_path / "kv")
    a = KVStore(LocalDirBackend(root), A)
    (k0, s0, e0), (k1, s1, e1) = kv[ALICE]["chain"][:2]
    fp = kv[ALICE]["fingerprint"]
    old = _by_key(a, k0, kv[ALICE]["blocks"][0], s0, e0, fp, A)
    forged = _by_key(a, k1, kv[BOB]["blocks"][1], s1, e1, fp, B)  # B's sealing, in A's directory, by key
    assert a.get(k0) is None  # reads look only under keyed names ...
    assert [r["named_by_key"] for r in mt.listing(a)] == [True, True]  # ... and ls says what to run
    with _as(ALICE, ALICE_SECRET):
        rc, out, _ = _cli(capsys, "migrate", "--kv-store", root, "--json")
    got = json.loads(out)
    assert rc == 0 and (got["tenant"], got["renamed"], got["dropped"]) == (a.root, 1, 1)
    assert torch.equal(a.get(k0), kv[ALICE]["blocks"][0]) and a.get(k1) is None  # B's forgery is gone, not loaded
    assert not os.path.exists(os.path.join(root, old)) and not os.path.exists(os.path.join(root, forged))
    assert not any("kvblock-" in p for p in _files(root))
