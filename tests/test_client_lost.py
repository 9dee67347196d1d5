"""A client process SIGKILLed while it holds live KV states: the scheduler cleans up after it
and the other client's workflows go on exactly (the short version of benchmarks/client_lost.py)."""

from distributed import Client

from daskflow_kv.bench.client_lost import run_client_lost
from daskflow_kv.runtime.cluster import local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime


def test_a_killed_client_leaves_no_session_live_state_or_pinned_block():
    with local_cluster(2, 1, dashboard_address=None) as cluster, Client(cluster) as client:
        rt = KVRuntime(client, "tiny-llama", block_size=16)
        out = run_client_lost(cluster.scheduler_address, client, rt, workflows=4, kill_after=2.0,
                              log=lambda msg: None)
    before, after = out["victim_before"], out["victim_after"]
    assert before["live_states"] > 0 and before["sessions"] == 1 and before["blocks_still_wanted"] > 0
    assert out["cleaned_within_s"] is not None and out["cleaned_within_s"] < 30, after
    assert after == {**after, "client_present": False, "sessions": 0, "live_states": 0, "blocks_still_wanted": 0}
    assert out["survivor_agree"] == out["survivor_workflows"] == 4, out["survivor_errors"]
