"""The chaos scenario, short: two clients stream workflows while a worker process is SIGKILLed.

Its own cluster (3 worker processes under nannies): every workflow completes with text
replay's tokens, nothing waits on the dead worker, and the kill really happened.
"""

from distributed import Client

from daskflow_kv.bench.chaos import ChaosConfig, run_chaos
from daskflow_kv.runtime.cluster import local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime


def test_a_worker_killed_mid_stream_loses_no_workflow_and_hangs_nothing():
    cfg = ChaosConfig(workflows=6, docs=2, context=96, max_new=4, concurrency=2, kill_every=(0.05, 0.2),
                      max_kills=1, hang_s=120.0, kill_after_done=2)  # killed mid-stream, however fast it runs
    with local_cluster(3, 1, dashboard_address=None) as cluster, \
            Client(cluster) as c0, Client(cluster, set_as_default=False) as c1:
        runtimes = [KVRuntime(c, "tiny-llama", block_size=16) for c in (c0, c1)]
        out = run_chaos(cluster, [c0, c1], runtimes, cfg, log=lambda msg: None)
    assert out["hung"] == 0, (out["errors"], out["waiting_on"])
    assert out["completed"] == out["workflows"] == 12, out["errors"]
    assert out["wrong"] == 0
    assert len(out["kills"]) == 1 and out["kills"][0]["worker"].startswith("tcp://"), out["kill_errors"]
    assert out["workers_back"]  # the nanny restarted the killed worker before the cluster closed
