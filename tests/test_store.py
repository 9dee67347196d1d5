"""The persistent KV store without a cluster: format, verification, atomicity, back ends,
maintenance (ls / du / gc and their CLI) and the store-read price. Real files, real bytes."""

import json
import os
import threading
import time

import pytest
import torch

from daskflow_kv.cli import main as cli_main
from daskflow_kv.policy.cost_model import NeedsCalibration, PrefillProfile
from daskflow_kv.policy.store_read import (
    StoreProfile,
    StoreSample,
    decide_store_read,
    fit_store_profile,
    store_read_seconds,
)
from daskflow_kv.state.blocks import block_key
from daskflow_kv.store import maintenance as mt
from daskflow_kv.store.backends import FsspecBackend, LocalDirBackend, open_backend
from daskflow_kv.store.codec import CorruptBlockError, checksum, decode, encode, read_manifest
from daskflow_kv.store.kv_store import KVStore, open_store
from daskflow_kv.store.layout import SUFFIX, block_path
from daskflow_kv.store.manifest import check_key
from daskflow_kv.store.tenant import OPEN_TENANT, StoreTenant

SHAPE = (2, 2, 3, 16, 8)  # layers, K/V, kv heads, tokens, head dim
TOKENS = list(range(1000, 1016))  # what must never appear in a stored object's manifest
PATH = "v2/open/blocks/xx/object.kvobj"  # the name an object is sealed to (codec tests)
# The open tenant (no secret: unsealed, CRC-checked) and a sealed one (AES-256-GCM).
TENANTS = {"open": OPEN_TENANT, "sealed": StoreTenant.derive("tests", "a secret")}


def _key(i=0):
    return block_key("fp-digest", None, [i, *TOKENS])


def _block(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def _stores(tmp_path, tenant=OPEN_TENANT):
    """The same store API over each back end: a directory, fsspec file://, fsspec memory://."""
    return {
        "dir": KVStore(LocalDirBackend(str(tmp_path / "dir")), tenant),
        "fsspec-file": KVStore(FsspecBackend(f"file://{tmp_path / 'fs'}"), tenant),
        "memory": KVStore(FsspecBackend(f"memory://kv-test-{time.time_ns()}"), tenant),
    }


# -- format --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tenant", TENANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_object_round_trips_exactly_and_its_manifest_has_no_tokens(dtype, tenant):
    seal = {"path": PATH, "tenant": TENANTS[tenant]}
    t = _block(dtype)
    data, m = encode(t, _key(), 64, 80, "fp-digest", **seal)
    back, m2 = decode(data, _key(), **seal)
    assert back.dtype == dtype and torch.equal(back, t) and m2 == m
    assert (m.start, m.end, m.tokens, m.nbytes, m.shape) == (64, 80, 16, t.numel() * t.element_size(), SHAPE)
    assert m.checksum == checksum(t) and m.fingerprint == "fp-digest"
    head = read_manifest(data[:2048], _key(), **seal)  # the header alone is enough
    assert head == m
    text = json.loads(m.to_json())
    assert set(text) == {"key", "start", "end", "nbytes", "dtype", "shape", "checksum", "fingerprint", "created",
                         "format"}
    assert not any(str(tok) in m.to_json() for tok in TOKENS[:4])


def test_keys_are_checked_before_they_become_object_names():
    assert check_key(_key()) == _key()
    for bad in ("../../etc/passwd", "kvblock-XYZ", "kvblock-" + "0" * 31, None, 5):
        with pytest.raises(ValueError):
            check_key(bad)
    with pytest.raises(ValueError):
        KVStore(LocalDirBackend("/nonexistent")).block_path("kvblock-../../x")
    with pytest.raises(ValueError):
        block_path("open", "kvblock-../../x")


@pytest.mark.parametrize("tenant", TENANTS)
@pytest.mark.parametrize("damage", ["truncated", "flipped", "header", "empty", "other-key"])
def test_damaged_objects_are_refused(damage, tenant):
    seal = {"path": PATH, "tenant": TENANTS[tenant]}
    t = _block()
    data, _ = encode(t, _key(), 0, 16, "fp", **seal)
    if damage == "truncated":
        bad = data[: len(data) - 100]
    elif damage == "flipped":
        bad = bytearray(data)
        bad[-10] ^= 0xFF
        bad = bytes(bad)
    elif damage == "header":
        bad = data[:8] + b"{" * 20 + data[28:]
    elif damage == "empty":
        bad = b""
    else:
        bad, _ = encode(t, _key(1), 0, 16, "fp", **seal)
    with pytest.raises(CorruptBlockError):
        decode(bad, _key(), **seal)


# -- the store over every back end --------------------------------------------------------------
@pytest.mark.parametrize("tenant", TENANTS)
@pytest.mark.parametrize("backend", ["dir", "fsspec-file", "memory"])
def test_put_get_leading_and_corruption_is_a_miss_then_deleted(tmp_path, backend, tenant):
    store = _stores(tmp_path, TENANTS[tenant])[backend]
    keys = [_key(i) for i in range(4)]
    blocks = [_block(seed=i) for i in range(4)]
    for i in (0, 1, 3):  # a gap at 2
        assert store.put(blocks[i], keys[i], 16 * i, 16 * i + 16, "fp") is not None
    assert store.put(blocks[0], keys[0], 0, 16, "fp") is None  # there already: not written again
    assert store.stats.skipped == 1
    assert store.leading(keys) == 2  # stops at the gap: a suffix without its prefix is useless
    assert torch.equal(store.get(keys[1]), blocks[1])
    assert store.get(keys[2]) is None and store.read(keys[2]).status == "miss"

    # Corrupt block 1 behind the store's back: a miss, never a wrong tensor, and removed.
    path = store.block_path(keys[1])
    raw = bytearray(store.backend.read(path))
    raw[-5] ^= 0x55
    store.backend.write_atomic(path, bytes(raw))
    r = store.read(keys[1])
    assert r.status == "corrupt" and r.tensor is None
    assert not store.contains(keys[1]) and store.stats.corrupt == 1
    assert store.leading(keys) == 1
    assert store.put(blocks[1], keys[1], 16, 32, "fp") is not None  # the next writer repairs it
    assert torch.equal(store.get(keys[1]), blocks[1])


def test_writes_are_atomic_and_concurrent_writers_of_one_block_are_harmless(tmp_path):
    """Eight threads over two store objects write the same block at once: one valid object,
    no temporary file left, every read verifies."""
    root = str(tmp_path / "s")
    stores = [KVStore(LocalDirBackend(root)), KVStore(FsspecBackend(f"file://{root}"))]
    t = _block(torch.bfloat16)
    key = _key(7)
    start = threading.Barrier(8)
    errors = []

    def write(i):
        try:
            start.wait()
            s = stores[i % 2]
            data, _ = encode(t, key, 0, 16, "fp", path=s.block_path(key), tenant=s.tenant)
            s.backend.write_atomic(s.block_path(key), data)  # bypasses the exists check: real races
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    files = [f for _, _, fs in os.walk(root) for f in fs]
    assert files == [f"{key}{SUFFIX}"]
    assert torch.equal(stores[0].get(key), t) and torch.equal(stores[1].get(key), t)


def test_open_backend_picks_the_local_directory_for_paths_and_file_urls(tmp_path):
    assert isinstance(open_backend(str(tmp_path)), LocalDirBackend)
    assert isinstance(open_backend(f"file://{tmp_path}"), LocalDirBackend)
    assert isinstance(open_backend("memory://x"), FsspecBackend)
    assert open_store(str(tmp_path)) is open_store(str(tmp_path))  # one per URL and process


@pytest.mark.parametrize("tenant", TENANTS)
def test_probe_measures_through_the_real_read_path_and_leaves_nothing(tmp_path, tenant):
    store = KVStore(LocalDirBackend(str(tmp_path)), TENANTS[tenant])
    write_s, read_s = store.probe(1 << 20)
    assert write_s > 0 and read_s > 0
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs] == []


# -- maintenance ------------------------------------------------------------------------------------
def _aged_store(tmp_path):
    store = KVStore(LocalDirBackend(str(tmp_path / "aged")), touch_interval=0)
    now = time.time()
    for i, age_days in enumerate([0, 3, 10, 40]):
        store.put(_block(seed=i), _key(i), 0, 16, "fp")
        past = now - age_days * 86400
        os.utime(store.backend._abs(store.block_path(_key(i))), (past, past))
    # Block 3 was written 40 days ago but read just now: it is in use, gc keeps it.
    assert store.get(_key(3)) is not None
    # A write that died an hour and a half ago left its temporary file.
    tmp = store.backend._abs(store.block_path(_key(9))) + ".tmp-deadbeef"
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    open(tmp, "wb").write(b"partial")
    os.utime(tmp, (now - 5400, now - 5400))
    return store, now


def test_stale_is_a_pure_age_policy_and_gc_applies_it(tmp_path):
    store, now = _aged_store(tmp_path)
    blocks = mt.scan(store)
    assert sorted(b.name for b in blocks) == sorted(_key(i) for i in range(4))  # not the temp file; open: by key
    assert [b.name for b in mt.stale(blocks, 7 * 86400, now)] == [_key(2)]
    u = mt.usage(blocks, now)
    assert u["blocks"] == 4 and u["by_last_use"]["< 1d"]["blocks"] == 2 and u["by_last_use"]["7-30d"]["blocks"] == 1
    dry = mt.gc(store, 7 * 86400, now, dry_run=True)
    assert (dry.deleted, dry.temps, dry.kept) == (1, 1, 3) and store.contains(_key(2))
    rep = mt.gc(store, 7 * 86400, now)
    assert (rep.deleted, rep.temps, rep.kept) == (1, 1, 3)
    assert not store.contains(_key(2)) and store.contains(_key(3))
    assert list(store.temp_entries()) == []


def test_store_cli_ls_du_gc(tmp_path, capsys):
    store, _ = _aged_store(tmp_path)
    url = store.url
    assert cli_main(["store", "ls", "--kv-store", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["key"] for r in rows} == {_key(i) for i in range(4)}
    assert all(r["valid_header"] and r["end"] - r["start"] == 16 for r in rows)
    assert not any("token" in k for r in rows for k in r)  # no token ids, under any name
    assert cli_main(["store", "ls", "--kv-store", url]) == 0
    out = capsys.readouterr().out
    assert _key(0) in out and "4 blocks" in out and str(TOKENS[0]) not in out
    assert cli_main(["store", "du", "--kv-store", url]) == 0
    assert "4 blocks" in capsys.readouterr().out
    assert cli_main(["store", "gc", "--kv-store", url, "--older-than", "7d", "--dry-run"]) == 0
    assert "would delete 1 blocks" in capsys.readouterr().out
    assert cli_main(["store", "gc", "--kv-store", url, "--older-than", "7d", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 1
    assert len(mt.scan(store)) == 3


def test_store_cli_refuses_bad_input_in_one_line(tmp_path, capsys):
    assert cli_main(["store", "gc", "--kv-store", str(tmp_path), "--older-than", "soon"]) == 2
    assert "--older-than" in capsys.readouterr().err
    assert cli_main(["store", "ls", "--kv-store", "nosuchproto://x"]) == 2
    assert "unknown storage protocol" in capsys.readouterr().err
    assert cli_main(["store", "du"]) == 2  # no --kv-store and no setting
    assert "--kv-store" in capsys.readouterr().err


# -- the price of a store read: pure ------------------------------------------------------------------
def test_store_read_seconds_and_the_fit():
    p = StoreProfile(1e9, 0.01)
    assert store_read_seconds(0, p) == 0.0
    assert store_read_seconds(10**9, p) == pytest.approx(1.01)
    fit = fit_store_profile([StoreSample(10**6, 0.002 + 0.001), StoreSample(10**8, 0.002 + 0.1)])
    assert fit.bandwidth == pytest.approx(1e9, rel=1e-6)
    assert fit.latency == pytest.approx(0.002 + 0.03, rel=1e-6)  # fitted intercept + task overhead
    one = fit_store_profile([StoreSample(10**8, 0.1)])  # one size: a pure rate
    assert one.bandwidth == pytest.approx(1e9) and one.latency == pytest.approx(0.03)
    with pytest.raises(ValueError):
        fit_store_profile([])


def test_decide_store_read_prices_load_against_recompute():
    prefill = PrefillProfile(0.0, 1 / 450, 0.0)  # SmolLM2 on 2 CPU threads: ~450 tok/s
    fast = StoreProfile(2e9)
    d = decide_store_read(8168 * 46080, 8168, 0, "w", fast, prefill)
    assert d.action == "load" and d.t_load < 0.3 < 18 < d.t_recompute
    slow = StoreProfile(1e6)  # a store at 1 MB/s loses against prefilling
    assert decide_store_read(8168 * 46080, 8168, 0, "w", slow, prefill).action == "recompute"
    assert decide_store_read(100, 0, 64, "w", fast, prefill).action == "recompute"  # nothing to gain
    assert decide_store_read(10**6, 64, 0, "w", slow, prefill, forced="load").action == "load"
    with pytest.raises(NeedsCalibration):
        decide_store_read(10**6, 64, 0, "w", None, prefill)
    with pytest.raises(NeedsCalibration):
        decide_store_read(10**6, 64, 0, "w", fast, None)
    row = d.as_dict()
    assert row["src"] == "store" and row["dst"] == "w" and row["t_transfer"] == d.t_load


def test_access_marks_remembered_stay_bounded(tmp_path, monkeypatch):
    """A long-lived worker reads ever more keys: the marks it remembers (to refresh each at
    most once per interval) keep only those still inside the interval once past the bound."""
    import daskflow_kv.store.kv_store as ks

    monkeypatch.setattr(ks, "TOUCHED_KEPT", 4)
    store = KVStore(LocalDirBackend(str(tmp_path)), touch_interval=0.05)
    for i in range(6):
        store.put(_block(seed=i), _key(i), 0, 16, "fp")
    for i in range(6):
        assert store.get(_key(i)) is not None
        time.sleep(0.06)  # every earlier mark is stale by the next read
    assert len(store._touched) <= ks.TOUCHED_KEPT
    assert _key(5) in store._touched  # the fresh one is kept
