"""Parallel materialize on a real 2-worker LocalCluster: one prefill, two workers at once.

The blocks must be those of a single-worker prefill (same content-addressed keys, same
content up to rounding, each on the worker that computed it) and resuming from them must
give text mode's tokens. A worker killed mid-way costs time, never exactness.
"""

import os
import signal
import threading
import time

import pytest
import torch
from conftest import ARCHS, CONTEXT, DTYPES, SUFFIXES, assert_same_generation, make_engine
from distributed import Client

from daskflow_kv.dask_internals import worker_addresses
from daskflow_kv.bench.systems import made_at
from daskflow_kv.policy.cost_model import PrefillProfile
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.keys import PREFILL_TOPIC
from daskflow_kv.state.blocks import chain_keys

NEW = 6


def _ctx(rt, case: str, repeat: int = 4) -> list[int]:
    return rt.encode(f"Case {case}: " + " ".join([CONTEXT] * repeat))


def _holders_by_block(state) -> list[set[str]]:
    who = state.who_has()
    return [set(who[k]) for k in state.state.block_keys]


def _chunk_events(client, sid):
    return [e for _, e in client.get_events(PREFILL_TOPIC) if isinstance(e, dict) and e.get("state_id") == sid]


def _until(pred, timeout=60.0, what=""):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32"])  # below fp32: see the refusal test below
def test_two_workers_make_the_single_prefill_blocks_and_resume_exactly(client, workers, arch, dtype):
    rt = KVRuntime(client, arch, dtype=dtype, block_size=16)
    rt.bandwidth_override, rt.prefill_override = 2e9, PrefillProfile(1e-3, 1e-5, 1e-7)  # chunk 0 the longer
    engine = make_engine(arch, dtype, block_size=16)
    ctx = _ctx(rt, f"exact-{arch}-{dtype}")
    t0 = time.time()
    st = rt.materialize(ctx, parallel=2)
    rt.wait([st])

    # the keys a single prefill publishes, computed on the client from the chain
    assert list(st.state.block_keys) == [k for k, _, _ in chain_keys(rt.key_digest, ctx, 16,
                                                                      namespace=rt.session.namespace)]
    assert st.state.lineage[-1].as_dict()["parallel"] == 2
    # each block on the worker that computed it: chunk 0 (longer) first in address order
    where = _holders_by_block(st)
    split = next(i for i, w in enumerate(where) if w != where[0])
    assert where[:split] == [{workers[0]}] * split and where[split:] == [{workers[1]}] * (len(where) - split)
    assert split > len(where) - split  # the later chunk attends to more: it is the shorter one
    # the keys and tensors of one prefill in one process (the reference engine), up to rounding
    single = engine.materialize(ctx)
    assert [b.key for b in single.blocks] == list(st.state.block_keys)
    tol = 1e-4 if dtype == "float32" else 2e-2
    for got, ref in zip(client.gather(list(st.futures)), single.blocks):
        assert torch.allclose(got.float(), engine.store.get(ref.key).float(), rtol=tol, atol=1e-3)
    # the chunk tasks really cooperated, and reported compute time without their waits
    events = _chunk_events(client, st.state_id)
    assert sorted(e["chunk"] for e in events) == [0, 1]
    assert all(e["relayed"] for e in events), [(e["alone_because"], e["handoff_failures"]) for e in events]
    # each chunk says when its blocks existed (the bench's TTFT invariant needs the last one)
    assert all(t0 <= e["done_at"] <= time.time() for e in events)
    assert made_at(events) == [max(e["done_at"] for e in events)]

    suffixes = [rt.encode(s) for s in SUFFIXES]
    gens = rt.resume_many(list(zip(rt.fork(st, len(suffixes)), suffixes)), max_new_tokens=NEW, return_logits=True)
    for g, suf in zip(gens, suffixes):
        assert_same_generation(g, engine.generate_text(ctx + suf, max_new_tokens=NEW, return_logits=True))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "float32"])
def test_below_fp32_one_worker_prefills_and_resumes_bit_exactly(client, workers, dtype):
    """A relayed chunk is fed in other shapes than text mode's block chunks, and below fp32
    that changes the rounding: the runtime prefills such a model on one worker instead."""
    rt = KVRuntime(client, "tiny-llama", dtype=dtype, block_size=16)
    rt.bandwidth_override, rt.prefill_override = 2e9, PrefillProfile(1e-3, 1e-5, 1e-7)
    engine = make_engine("tiny-llama", dtype, block_size=16)
    ctx = _ctx(rt, f"refused-{dtype}")
    st = rt.materialize(ctx, parallel=2)
    rt.wait([st])
    assert "parallel" not in st.state.lineage[-1].as_dict()
    assert len(set.union(*_holders_by_block(st))) == 1
    suffixes = [rt.encode(s) for s in SUFFIXES]
    gens = rt.resume_many(list(zip(rt.fork(st, len(suffixes)), suffixes)), max_new_tokens=NEW, return_logits=True)
    for g, suf in zip(gens, suffixes):
        want = engine.generate_text(ctx + suf, max_new_tokens=NEW, return_logits=True)
        assert g.tokens == want.tokens and torch.equal(g.logits, want.logits)


def test_parallel_one_is_todays_single_prefill(client, workers):
    rt = KVRuntime(client, "tiny-llama", block_size=16)
    st = rt.materialize(_ctx(rt, "single"), parallel=1)
    rt.wait([st])
    assert len(set.union(*_holders_by_block(st))) == 1
    assert "parallel" not in st.state.lineage[-1].as_dict()


def test_auto_splits_only_when_predicted_faster(client, workers):
    rt = KVRuntime(client, "tiny-llama", block_size=16)
    rt.bandwidth_override = 2e9
    rt.prefill_override = PrefillProfile(0.002, 2e-5, 1e-9)  # a fast model: the hand-offs would cost more
    st = rt.materialize(_ctx(rt, "auto-fast"), parallel="auto")
    rt.wait([st])
    assert rt.parallel_plans[-1].width == 1 and "not 10%" in rt.parallel_plans[-1].reason
    assert len(set.union(*_holders_by_block(st))) == 1
    rt.prefill_override = PrefillProfile(0.002, 2e-2, 1e-5)  # a slow one: two workers pay off
    st2 = rt.materialize(_ctx(rt, "auto-slow"), parallel="auto")
    rt.wait([st2])
    assert rt.parallel_plans[-1].width == 2
    assert set.union(*_holders_by_block(st2)) == set(workers)
    assert "parallel prefill over 2" in rt.explain()


def test_a_cached_prefix_is_read_by_every_chunk(client, workers):
    rt = KVRuntime(client, "tiny-qwen2", block_size=16)
    engine = make_engine("tiny-qwen2", block_size=16)
    ctx = _ctx(rt, "prefix")
    head = rt.materialize(ctx[:37], parallel=1)  # ends inside a block
    rt.wait([head])
    st = rt.materialize(ctx, parallel=2)
    rt.wait([st])
    event = st.state.lineage[-1].as_dict()
    assert event["tokens_reused"] == 37 and event["parallel"] == 2
    assert list(st.state.block_keys) == [k for k, _, _ in chain_keys(rt.key_digest, ctx, 16,
                                                                      namespace=rt.session.namespace)]
    suf = rt.encode(SUFFIXES[2])
    g = rt.resume(st, suf, max_new_tokens=NEW, return_logits=True)
    assert_same_generation(g, engine.generate_text(ctx + suf, max_new_tokens=NEW, return_logits=True))


# -- a worker dies mid-way -------------------------------------------------------------------------
@pytest.fixture
def own_client():
    from daskflow_kv.runtime.cluster import local_cluster, wait_for_restarts

    with local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as c, Client(c) as cl:
        yield cl
        wait_for_restarts(c)  # the test killed a worker: let its nanny finish restarting before the close


def _slow_sends(seconds):
    """On this worker, every layer hand-off is followed by a pause: chunks take seconds."""
    from daskflow_kv.plugins import handoff

    send = handoff.Channel.send

    def slow(self, layer, k, v):
        send(self, layer, k, v)
        time.sleep(seconds)

    handoff.Channel.send = slow


def _running_chunks():
    from daskflow_kv.plugins import handoff

    return sorted(c for (_, c), s in handoff.MAILBOX._states.items() if s == handoff.RUNNING)


@pytest.mark.parametrize("victim", ["upstream", "downstream"])
def test_a_worker_killed_mid_way_leaves_the_outputs_exact(own_client, victim):
    client = own_client
    a, b = sorted(worker_addresses(client))
    rt = KVRuntime(client, "tiny-llama", block_size=16)
    engine = make_engine("tiny-llama", block_size=16)
    ctx = _ctx(rt, f"kill-{victim}")
    client.run(_slow_sends, 3.0, workers=[a])  # chunk 0 runs on a (address order)
    out = {}

    def run():
        try:
            out["state"] = rt.materialize(ctx, parallel=2)
            rt.wait([out["state"]], timeout=120)
        except Exception as e:  # noqa: BLE001 -- surfaced below
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    _until(lambda: client.run(_running_chunks, workers=[a])[a] == [0]
           and client.run(_running_chunks, workers=[b])[b] == [1], what="both chunks to run")
    time.sleep(1.0)  # chunk 0 has handed over layer 0 and pauses; chunk 1 waits for layer 1
    dead = a if victim == "upstream" else b
    os.kill(client.run(os.getpid, workers=[dead])[dead], signal.SIGKILL)
    killed = time.time()
    thread.join(150)
    assert not thread.is_alive(), "materialize did not finish after a worker died"
    # no wait for a start or stall timeout (30 s, 120 s): the death is noticed at once
    assert time.time() - killed < 25
    assert "error" not in out, out.get("error")
    st = out["state"]
    assert list(st.state.block_keys) == [k for k, _, _ in chain_keys(rt.key_digest, ctx, 16,
                                                                      namespace=rt.session.namespace)]
    assert dead not in set.union(*_holders_by_block(st))
    alone = [e for e in _chunk_events(client, st.state_id) if not e["relayed"]]
    assert alone, "some chunk should have been prefilled again without its peer"
    for s in SUFFIXES[:2]:
        suf = rt.encode(s)
        g = rt.resume(st, suf, max_new_tokens=NEW, return_logits=True)
        assert_same_generation(g, engine.generate_text(ctx + suf, max_new_tokens=NEW, return_logits=True))


def test_a_chunk_lost_after_materialize_is_recomputed_from_lineage(own_client):
    client = own_client
    a, b = sorted(worker_addresses(client))
    rt = KVRuntime(client, "tiny-llama", block_size=16)
    engine = make_engine("tiny-llama", block_size=16)
    ctx = _ctx(rt, "lost-later")
    st = rt.materialize(ctx, parallel=2)
    rt.wait([st])
    on_b = [k for k, w in zip(st.state.block_keys, _holders_by_block(st)) if w == {b}]
    assert on_b
    t0 = time.time()
    os.kill(client.run(os.getpid, workers=[b])[b], signal.SIGKILL)
    _until(lambda: b not in worker_addresses(client), what="b to be removed")
    suf = rt.encode(SUFFIXES[1])
    g = rt.resume(st, suf, max_new_tokens=NEW, return_logits=True)
    assert_same_generation(g, engine.generate_text(ctx + suf, max_new_tokens=NEW, return_logits=True))
    events = [m for t, m in client.get_events("daskflow-kv") if t >= t0 and isinstance(m, dict)]
    redone = {m["key"] for m in events if m["op"] == "recompute" and m.get("reason") == "lineage"}
    assert len(redone) >= len(on_b)


# -- under a KV budget the chunks are one gang: admitted together or not at all --------------------
def test_a_budget_admits_the_chunks_together(client, workers):
    from daskflow_kv.errors import KVBudgetError
    from daskflow_kv.policy.parallel_prefill import chunk_spans

    rt = KVRuntime(client, "tiny-llama", block_size=16)
    engine = make_engine("tiny-llama", block_size=16)
    rt.bandwidth_override = 2e9
    rt.prefill_override = PrefillProfile(0.0, 1e-6, 1e-5)  # attention-bound: chunk 0 much longer than chunk 1
    bpt = rt.facts.bytes_per_token
    try:
        rt.configure(kv_budget_bytes=64 << 20)  # room for both: admitted together, and exact
        ctx = _ctx(rt, "gang-fits")
        st = rt.materialize(ctx, parallel=2)
        rt.wait([st])
        assert set.union(*_holders_by_block(st)) == set(workers)
        suf = rt.encode(SUFFIXES[0])
        assert rt.resume(st, suf, max_new_tokens=NEW).tokens == engine.generate_text(ctx + suf, NEW).tokens
        rt.release(st)

        ctx = _ctx(rt, "gang-too-big")
        (s0, e0), (s1, e1) = chunk_spans(0, len(ctx), [rt.prefill_override] * 2, 16)
        assert e0 - s0 > e1 - s1
        rt.configure(kv_budget_bytes=(e0 - s0 + e1 - s1) * bpt // 2)  # chunk 1 fits, chunk 0 never will
        t0 = time.time()
        st = rt.materialize(ctx, parallel=2)
        with pytest.raises(KVBudgetError):
            st.futures[-1].result(timeout=30)  # a block of chunk 1: failed with its gang, not run
        assert time.time() - t0 < 20  # at once, not after a peer's start timeout
        assert not _chunk_events(client, st.state_id)  # neither chunk ran
    finally:
        rt.configure(unset_budget=True)


def test_workflow_state_mode_prefills_cold_shared_contexts_in_parallel(client, workers):
    """The executor (and the CLI's --parallel-materialize) pass the width to each group's
    materialize: a cold shared context is split, and every agent still gets text mode's tokens."""
    from daskflow_kv.flow.executor import run_workflow
    from daskflow_kv.workflows import WORKFLOWS

    rt = KVRuntime(client, "tiny-llama", block_size=16)
    wf = WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=300, max_new_tokens=6, agents=3)
    cmp = run_workflow(wf, mode="both", runtime=rt, parallel=2)
    assert cmp.all_agree
    assert any(ev.get("parallel") == 2 for events in cmp.state.lineage.values() for ev in events)


def test_a_dead_peer_is_told_from_a_slow_one_by_its_port(workers):
    """The channel's liveness test: a live worker's port accepts (however busy it is), a dead one refuses."""
    import socket

    from daskflow_kv.plugins.handoff import listening

    assert listening(workers[0]) is True
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    assert listening(f"tcp://127.0.0.1:{port}") is False
    assert listening("ucx://10.0.0.1:1234") is None  # other protocols: not judged
