"""Issue 22, item 4: the second tenant forges what the plugin reads from tasks and workers.

A client that never logged in annotates a task with ``kv_out = -1e12`` (a negative
reservation would switch a worker's budget off); bob annotates his own tasks with bad
numbers, with a cost-model decision and events meant for alice's counters, and with
``reads`` of alice's blocks to reorder their eviction; he sends ``kv_worker_report``s
naming alice's worker (to zero its KV bytes) and prefill timings in its name. Each is
refused or lands in bob's own namespace: only a session's own tasks carry annotations the
plugin acts on, their numbers are checked, worker reports count only from the worker
itself (its report token, on its own stream), counters and decisions are per namespace.
A real 2-worker cluster, tenants configured as in ``tests/test_tenancy.py``.
"""

from __future__ import annotations

import time

import dask
import pytest
from distributed import Client

from conftest import wait_until

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import PREFILL, PREFILL_TOPIC, REPORT_OP, namespace_tag, task_key
from daskflow_kv.plugins.tenants import AccessDenied
from tenancy_kit import PROMPT, SUFFIX, plugin, tenant, tenant_cluster, text_tokens

BUDGET = 1 << 30


@pytest.fixture(scope="module")
def cluster():
    with tenant_cluster(**{"kv-budget": BUDGET}) as c:
        yield c


alice = tenant("alice")
bob = tenant("bob")


@pytest.fixture(scope="module")
def record(alice):
    state = alice.materialize(alice.encode(PROMPT))
    alice.wait([state])
    return state


def _note(**kw):
    return {"role": "compute", "op": "prefill", "state_id": "kvstate-prefill-b0b0b0b0b0b0", "target": None,
            "reads": [], "decision": None, "first": False, "kv_out": 0, **kw}


def _submit(client, key, **note):
    with dask.annotate(kv=_note(**note)):
        return client.submit(bytes, 8, key=key, pure=False)


def _reserved(cluster) -> dict:
    return {w: reserved for w, (_, reserved) in plugin(cluster).budget.counted_by_worker().items()}


def test_an_unauthenticated_negative_reservation_changes_no_budget(cluster, record):
    with Client(cluster) as mallory:
        plain = _submit(mallory, "mallorys-plain-task", kv_out=-10 ** 12, target=record.state.worker)
        assert plain.result(timeout=30) == bytes(8)  # a plain key: the annotation is ignored, dropped
        assert not plugin(cluster).budget.is_held(plain.key)
        with pytest.raises(AccessDenied, match="no session"):  # a KV key: refused before it runs
            _submit(mallory, task_key(PREFILL, "alice", "forged"), kv_out=-10 ** 12).result(timeout=30)
    assert all(v >= 0 for v in _reserved(cluster).values())


@pytest.mark.parametrize("field, value, why", [
    ("kv_out", -10 ** 12, "kv_out"), ("kv_out", "1e12", "kv_out"), ("kv_out", 10 ** 18, "kv_out"),
    ("predicted_s", float("nan"), "predicted_s"), ("predicted_s", -1.0, "predicted_s"),
    ("gang_size", 0, "gang_size"), ("reads", "kvblock-x", "reads"), ("first", "yes", "first"),
    ("decision", {"action": "transfer", "nbytes": -5}, "nbytes"),
])
def test_bad_numbers_in_bobs_own_annotations_are_refused(bob, field, value, why):
    fut = _submit(bob.client, task_key(PREFILL, "bob", "bad"), **{field: value})
    with pytest.raises(AccessDenied, match=why) as e:
        fut.result(timeout=30)
    assert "\n" not in str(e.value)


def test_forged_decisions_and_events_stay_in_bobs_namespace(cluster, alice, bob, record):
    a, b = sorted(alice.client.scheduler_info(n_workers=-1)["workers"])
    before = alice.counters()
    decision = {"action": "transfer", "src": a, "dst": b, "nbytes": 10 ** 12, "t_transfer": 1.0,
                "t_recompute": 2.0}
    fut = _submit(bob.client, task_key(PREFILL, "bob", "forged"), decision=decision, first=True,
                  state_id=record.state_id, op="materialize")
    assert fut.result(timeout=30) == bytes(8)
    after = alice.counters()
    assert after["counters"]["transfers"] == before["counters"]["transfers"]
    assert after["counters"]["bytes_transferred"] == before["counters"]["bytes_transferred"]
    assert not [d for d in after["decisions"] if d.get("nbytes") == 10 ** 12]
    assert not [e for e in after["events"] if e.get("namespace") == "bob"]
    mine = bob.counters()
    assert mine["counters"]["bytes_transferred"] >= 10 ** 12  # in bob's own counters, where he put it
    assert [d for d in mine["decisions"] if d.get("nbytes") == 10 ** 12]


def test_bobs_reads_do_not_touch_alices_blocks(alice, bob, record):
    def rows():
        return {r["block_key"]: (r["reuse_count"], r["last_access"]) for r in alice.catalog().to_pylist()
                if r["block_key"] in record.state.block_keys}

    before = rows()
    fut = _submit(bob.client, task_key(PREFILL, "bob", "reader"), reads=list(record.state.block_keys))
    assert fut.result(timeout=30) == bytes(8)
    assert rows() == before


def test_forged_worker_reports_are_dropped(cluster, alice, bob, record):
    worker = record.state.worker
    snap = lambda: alice.plugin.call("kv_snapshot")["workers"][worker]["kv_bytes"]  # noqa: E731
    assert snap() >= record.nbytes  # alice's blocks, in a's memory
    forged = {"op": REPORT_OP, "spilled": list(record.state.block_keys),
              "events": [{"op": "write-failed", "key": record.state.block_keys[0], "error": "forged"}]}
    di.send_on_stream(bob.client, {**forged, "worker": worker, "client": None})  # on bob's stream, in a's name
    di.send_on_stream(bob.client, {**forged, "worker": worker, "client": None, "token": "0" * 32})
    # the old RPC is gone (Dask answers an unknown one with nothing): reports come on the worker's stream
    assert bob.client.sync(bob.client.scheduler.kv_worker_report, worker=worker, spilled=forged["spilled"]) is None
    assert bob.client.sync(bob.client.scheduler.kv_report_hello, worker=worker) is None  # no token back
    time.sleep(1.0)
    assert snap() >= record.nbytes  # still counted: a forged "spilled" list would have zeroed them
    assert not any(plugin(cluster).tiers.spilled_on(k, worker) for k in record.state.block_keys)
    assert not [e for e in plugin(cluster).event_log.events() if e["op"] == "store-write-failed"]


def test_forged_prefill_timings_change_no_profile_and_no_counter(cluster, alice, bob, record):
    worker = record.state.worker
    samples = lambda: len(plugin(cluster).profiles._samples.get(worker, ()))  # noqa: E731
    assert wait_until(lambda: samples() > 0)  # alice's own prefill was counted (the worker's own stream)
    n, computed = samples(), alice.counters()["counters"]["tokens_computed"]
    forged = {"worker": worker, "new_tokens": 10 ** 6, "prefix_tokens": 0, "seconds": 1e-3,
              "tag": namespace_tag("alice")}
    bob.client.log_event(PREFILL_TOPIC, forged)  # Dask's event log takes it; the plugin does not
    time.sleep(1.0)
    assert samples() == n and alice.counters()["counters"]["tokens_computed"] == computed


def test_alice_still_resumes_as_text_mode(alice, record):
    gen = alice.resume(record, alice.encode(SUFFIX), max_new_tokens=8)
    assert gen.tokens == text_tokens(alice, list(record.tokens) + alice.encode(SUFFIX))
    assert alice.counters()["counters"]["tokens_computed"] >= len(record.tokens)  # her prefills, hers
