"""The scheduler killed under a runtime: its next KV call fails with ``SchedulerLost`` naming
the scheduler, within Dask's connect timeout, instead of hanging or a bare comm error."""

import time

import dask
import pytest
from distributed import Client

from daskflow_kv.errors import SchedulerLost
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
