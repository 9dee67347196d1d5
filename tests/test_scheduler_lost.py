"""The scheduler killed under a runtime: its next KV call fails with ``SchedulerLost`` naming
the scheduler, within Dask's connect timeout, instead of hanging or a bare comm error."""

import time

import dask
import pytest
from distributed import Client

from daskflow_kv.errors import ClientClosed, SchedulerLost
from daskflow_kv.runtime.cluster import local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime


def test_a_call_after_the_scheduler_died_names_it_and_does_not_hang():
    with dask.config.set({"distributed.comm.timeouts.connect": "5s"}):
        with local_cluster(1, 1, dashboard_address=None) as cluster:
            client = Client(cluster)
            rt = KVRuntime(client, "tiny-llama", block_size=16)
            rt.wait([rt.materialize(rt.encode("A context before the scheduler dies."))])
            address = cluster.scheduler_address
            client.sync(cluster.scheduler.close)  # the scheduler process goes away
            t0 = time.time()
            with pytest.raises(SchedulerLost, match=address.split("://")[-1]):
                rt.counters()
            assert time.time() - t0 < 30
            client.close(timeout=5)
            with pytest.raises(ClientClosed, match="client is closed"):  # a thread that outlived the client
                rt.counters()


def test_the_scheduler_killed_mid_stream_fails_fast_and_a_new_cluster_resumes_from_the_store(tmp_path):
    """The scenario of benchmarks/scheduler_lost.py, short: the scheduler's process SIGKILLed after
    one workflow; the tiny model prefills faster than a store load, so a slow prefill is stated
    (the runtime's what-if knob, as in test_runtime_store) for the store to be worth reading."""
    from daskflow_kv.bench.scheduler_lost import run_scheduler_lost
    from daskflow_kv.policy.cost_model import PrefillProfile

    def slow_prefill(rt):
        rt.prefill_override = PrefillProfile.from_rate(20.0)

    # A call made before the client noticed the loss retries its connection for Dask's connect
    # timeout (30 s by default, as the other test here shortens it): on a loaded machine that
    # alone reached the 30 s bound.
    with dask.config.set({"distributed.comm.timeouts.connect": "10s"}):
        out = run_scheduler_lost(str(tmp_path / "kv"), workflows=3, context=128, max_new=4, kill_after_done=1,
                                 runtime_setup=slow_prefill, log=lambda *a: None)
    failures = [*out["in_flight_at_kill"], *out["next_calls"].values()]
    assert failures and all(f["error"] == "SchedulerLost" and f["names_scheduler"] for f in failures), failures
    assert out["failures_within_30s"] and not out["hung"]
    assert out["lost"] == 0 and out["wrong"] == 0
    assert out["context_tokens_stored_before"] > 0 and out["context_tokens_from_store"] > 0
    assert out["stored_tokens_prefilled_again"] == 0, out["resumed_contexts"]


def test_the_stored_prefix_is_whole_blocks_or_a_whole_stored_context():
    from daskflow_kv.bench.scheduler_lost import stored_prefix

    ctx = list(range(40))
    assert stored_prefix(ctx, [], 16) == 0
    assert stored_prefix(ctx, [list(range(35)) + [-1]], 16) == 32  # diverges at 35: two whole blocks
    assert stored_prefix(ctx, [list(range(40))], 16) == 40  # the same context, partial block included
    assert stored_prefix(ctx, [list(range(45))], 16) == 32  # a longer one: its block 2 is not ctx's
