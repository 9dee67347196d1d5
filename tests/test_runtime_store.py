"""The persistent KV tier on real LocalClusters and real files.

* a workflow runs, its cluster closes, a new cluster on the same store runs a second
  workflow over the same context: the shared context is read from the store (0 tokens
  prefilled for it) and every agent's tokens equal text mode's;
* a corrupted object is detected (never loaded), the rest recomputed, the object repaired;
* two clusters writing the same blocks at once leave one valid object per block;
* a block evicted under the KV budget is loaded back from the store, not recomputed.

The tiny test model prefills 220 tokens in ~15 ms, faster than a store load's fixed cost,
so the tests state a slow prefill (``prefill_override``, the runtime's what-if knob): the
cost model then prefers the store, as it does for real models (see the store benchmark).
"""

import logging
import os
import threading
import time

import pytest
from conftest import CONTEXT, SUFFIXES, make_engine
from distributed import Client

from daskflow_kv.flow.executor import Comparison, run_state_mode, run_text_mode
from daskflow_kv.flow.workflow import Workflow
from daskflow_kv.policy.cost_model import PrefillProfile
from daskflow_kv.runtime.cluster import close_runtime, local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.state.blocks import chain_keys
from daskflow_kv.store import maintenance as mt
from daskflow_kv.store.kv_store import open_store

SLOW_PREFILL = PrefillProfile.from_rate(20.0)  # tokens/s: loading from the store wins
DOCUMENT = " ".join([CONTEXT] * 4)  # ~290 tokens: 18 blocks of 16


def _runtime(client, store, **kw) -> KVRuntime:
    rt = KVRuntime(client, "tiny-llama", block_size=16, kv_store=store, **kw)
    rt.prefill_override = SLOW_PREFILL
    rt.bandwidth_override = 1e9  # no link calibration needed for transfer decisions
    return rt


def _cluster(n=2, **kw):
    return local_cluster(n_workers=n, threads_per_worker=1, dashboard_address=":0", silence_logs=logging.ERROR, **kw)


def _workflow(name: str, judge: str) -> Workflow:
    """Two readers over one document, then a judge: the readers' shared prefix is the context."""
    wf = Workflow(name, system="Answer from the document only.")
    wf.context("doc", DOCUMENT, title="Document")
    wf.agent("reader0", "Summarise the document in one line.", reads=["doc"], max_new_tokens=4)
    wf.agent("reader1", "Summarise what the workers do.", reads=["doc"], max_new_tokens=4)
    wf.agent("judge", judge, reads=["doc", "reader0", "reader1"], merge="text", max_new_tokens=4)
    return wf


def _compile(wf, rt):
    return wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)


def _level0(result):
    """(tokens prefilled for level 0's shared prefix, tokens it took from the store, its length)."""
    ev = next(e for a in ("reader0", "reader1") for e in result.lineage[a] if e["op"] == "materialize")
    return ev["tokens_computed"], ev.get("tokens_from_store", 0), ev["tokens_computed"] + ev["tokens_reused"]


def _events(rt, op):
    return [m for _, m in rt.client.get_events("daskflow-kv") if isinstance(m, dict) and m.get("op") == op]


def _wait_forgotten(client, keys, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        known = client.run_on_scheduler(lambda dask_scheduler, keys: [k for k in keys if k in dask_scheduler.tasks],
                                        keys=list(keys))
        if not known:
            return
        time.sleep(0.1)
    raise AssertionError(f"{len(known)} blocks still known to the scheduler")


def test_a_new_cluster_reads_the_shared_context_from_the_store(tmp_path):
    store = str(tmp_path / "kv")
    with _cluster() as cluster, Client(cluster) as client:
        rt = _runtime(client, store)
        first = run_state_mode(_compile(_workflow("first", "Pick the better summary."), rt), rt)
        computed, from_store, prefix = _level0(first)
        assert (computed, from_store) == (prefix, 0)  # a cold store: prefilled once
        assert rt.flush_store(30) == 0
        deadline = time.time() + 10  # worker reports are asynchronous
        while time.time() < deadline and rt.counters()["counters"]["store_writes"] < prefix // 16:
            time.sleep(0.1)
        assert rt.counters()["counters"]["store_writes"] >= prefix // 16
        rows = rt.catalog().to_pylist()
        assert {r["tier"] for r in rows} == {"memory"} and any(r["persisted"] for r in rows)
        close_runtime(rt, cluster)
    stored = {b.name for b in mt.scan(open_store(store))}  # open tenant: named by key
    assert len(stored) >= -(-prefix // 16)

    with _cluster() as cluster, Client(cluster) as client:  # a new cluster: nothing in memory
        rt = _runtime(client, store)
        second_wf = _workflow("second", "List what both readers agree on.")
        second = run_state_mode(_compile(second_wf, rt), rt)
        computed, from_store, prefix2 = _level0(second)
        assert prefix2 == prefix and computed == 0 and from_store == prefix  # read from the store
        text = run_text_mode(_compile(second_wf, rt), rt)
        cmp = Comparison(second, text)
        assert cmp.all_agree, cmp.agreement
        assert [a.tokens for n, a in first.agents.items() if n != "judge"] == \
               [a.tokens for n, a in second.agents.items() if n != "judge"]
        assert rt.store_decisions and rt.store_decisions[-1].action == "load"
        assert "store->" in rt.explain()
        deadline = time.time() + 10
        while time.time() < deadline and rt.counters()["counters"]["store_loads"] < len(stored) // 2:
            time.sleep(0.1)
        c = rt.counters()
        assert c["counters"]["store_loads"] >= prefix // 16 and c["counters"]["store_corrupt"] == 0
        assert any(d.get("action") == "load" and d.get("src") == "store" for d in c["decisions"])
        close_runtime(rt, cluster)


def test_corrupt_objects_are_detected_recomputed_and_repaired(tmp_path):
    store_url = str(tmp_path / "kv")
    engine = make_engine("tiny-llama", block_size=16)
    with _cluster(1) as cluster, Client(cluster) as client:
        rt = _runtime(client, store_url)
        ctx = rt.encode("Corruption case. " + DOCUMENT)
        s = rt.materialize(ctx)
        keys = s.state.block_keys
        rt.wait([s])  # flush_store drains what workers queued: the blocks must exist first
        rt.release(s)
        assert rt.flush_store(30) == 0
        store = open_store(store_url)
        assert store.leading(keys) == len(keys)
        bad = 5  # flip bytes inside block 5's tensor
        path = store.backend._abs(store.block_path(keys[bad]))
        raw = bytearray(open(path, "rb").read())
        raw[len(raw) // 2] ^= 0xFF
        open(path, "wb").write(bytes(raw))
        rt.plugin.drop()  # the cache lets go: the blocks leave memory
        _wait_forgotten(client, keys)

        again = rt.materialize(ctx)
        ev = again.state.lineage[-1].as_dict()
        assert again.state.block_keys == keys
        assert ev["tokens_from_store"] == bad * 16  # up to the corrupt block, not past it
        assert ev["tokens_computed"] == len(ctx) - bad * 16  # the rest prefilled again
        g = rt.resume(again, rt.encode(SUFFIXES[1]), max_new_tokens=6)
        assert g.tokens == engine.generate_text(ctx + rt.encode(SUFFIXES[1]), 6).tokens
        assert rt.flush_store(30) == 0
        assert store.leading(keys) == len(keys)  # the recomputed block was written again, intact
        assert store.get(keys[bad]) is not None
        deadline = time.time() + 10
        while time.time() < deadline and not rt.counters()["counters"]["store_corrupt"]:
            time.sleep(0.1)
        assert rt.counters()["counters"]["store_corrupt"] == 1
        close_runtime(rt, cluster)


def test_two_clusters_writing_the_same_blocks_at_once(tmp_path):
    store_url = str(tmp_path / "kv")
    with _cluster(1) as c1, Client(c1) as a, _cluster(1) as c2, Client(c2) as b:
        rts = [_runtime(a, store_url, kv_store_write="all"), _runtime(b, store_url, kv_store_write="all")]
        ctx = rts[0].encode("Two writers. " + DOCUMENT)
        go = threading.Barrier(2)
        out = [None, None]

        def run(i):
            go.wait()
            s = rts[i].materialize(ctx)
            out[i] = rts[i].resume(s, rts[i].encode(SUFFIXES[2]), max_new_tokens=5)
            rts[i].flush_store(30)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert out[0].tokens == out[1].tokens
        store = open_store(store_url)
        keys = [k for k, _, _ in chain_keys(rts[0].key_digest, ctx, 16, namespace=rts[0].session.namespace)]
        assert store.leading(keys) == len(keys)
        files = [f for _, _, fs in os.walk(store_url) for f in fs]
        assert not [f for f in files if ".tmp-" in f]  # no write left half done
        assert all(store.read(k).status == "hit" for k in keys)  # every object verifies
        for rt, c in zip(rts, (c1, c2)):
            close_runtime(rt)


def test_an_evicted_block_comes_back_from_the_store(tmp_path):
    store_url = str(tmp_path / "kv")
    engine = make_engine("tiny-llama", block_size=16)
    with _cluster(1) as cluster, Client(cluster) as client:
        rt = _runtime(client, store_url)
        block = 16 * rt.facts.bytes_per_token
        rt.configure(kv_budget_bytes=30 * block)  # one context (~20 blocks) fits, two do not
        contexts = [rt.encode(f"Eviction case {i}. " + DOCUMENT) for i in range(4)]
        first = None
        for ctx in contexts:
            s = rt.materialize(ctx)
            first = first or s.state.block_keys
            rt.wait([s])
            rt.release(s)
        assert rt.flush_store(30) == 0
        deadline = time.time() + 20
        while time.time() < deadline and not rt.counters()["counters"]["evictions"]:
            time.sleep(0.1)
        assert rt.counters()["counters"]["evictions"] > 0
        time.sleep(1.0)  # Dask forgets the evicted keys (nothing else refers to them)
        known = set(client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.tasks)))
        gone = [k for k in first if k not in known]
        assert gone, "the oldest context should have lost blocks to eviction"
        rows = {r["block_key"]: r for r in rt.catalog().to_pylist()}
        assert rows[gone[0]]["tier"] == "store" and rows[gone[0]]["persisted"]  # evicted, still stored

        again = rt.materialize(contexts[0])
        ev = again.state.lineage[-1].as_dict()
        assert again.state.block_keys == first
        assert ev.get("tokens_from_store", 0) >= 16 and ev["tokens_computed"] == 0  # loaded, not prefilled
        g = rt.resume(again, rt.encode(SUFFIXES[0]), max_new_tokens=5)
        assert g.tokens == engine.generate_text(contexts[0] + rt.encode(SUFFIXES[0]), 5).tokens
        assert not [e for e in _events(rt, "recompute") if e.get("reason") == "lineage"]
        close_runtime(rt, cluster)


def test_store_settings_from_dask_config_and_bad_ones_fail_first(client, tmp_path):
    import dask

    from daskflow_kv.errors import InvalidInputError

    with dask.config.set({"daskflow-kv.store.url": f"file://{tmp_path}/cfg", "daskflow-kv.store.write": "all"}):
        rt = KVRuntime(client, "tiny-llama", block_size=16)
    assert rt.store.url == f"file://{tmp_path}/cfg" and rt.store_write == "all"
    assert KVRuntime(client, "tiny-llama", block_size=16).store is None  # no store unless asked
    with pytest.raises(InvalidInputError, match="kv_store"):
        KVRuntime(client, "tiny-llama", block_size=16, kv_store="nosuchproto://x")
    with pytest.raises(InvalidInputError, match="kv_store_write"):
        KVRuntime(client, "tiny-llama", block_size=16, kv_store=str(tmp_path), kv_store_write="sometimes")


def test_cli_run_writes_the_shared_context_to_the_store(tmp_path, capsys):
    from daskflow_kv.cli import main

    store = tmp_path / "cli-kv"
    argv = ["run", "rag", "--model", "tiny-llama", "--mode", "state", "--workers", "1", "--agents", "2",
            "--context-tokens", "128", "--max-new-tokens", "2", "--block-size", "16", "--kv-store", str(store)]
    assert main(argv) == 0
    assert len(mt.scan(open_store(str(store)))) >= 128 // 16  # flushed before the cluster closed
    assert main(["store", "du", "--kv-store", str(store)]) == 0
    assert "blocks" in capsys.readouterr().out
