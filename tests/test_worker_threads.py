"""Each KV worker's torch runs with its share of the host's cores, not Dask's one thread.

``torch_threads.split_cores`` is the rule (pure); the clusters check that the workers
``local_cluster`` starts run their model with it once they load one."""

from __future__ import annotations

import dask
import pytest
from dask.system import CPU_COUNT
from distributed import Client

from daskflow_kv.errors import InvalidInputError
from daskflow_kv.runtime import torch_threads
from daskflow_kv.runtime.cluster import local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime


@pytest.mark.parametrize("cores, workers, threads", [
    (2, 1, 2), (2, 2, 1), (2, 3, 1), (16, 4, 4), (8, 3, 2),
    (8, 0, 1),  # a cluster started empty and scaled later: Dask's one thread
])
def test_the_hosts_cores_are_split_over_its_workers(cores, workers, threads):
    assert torch_threads.split_cores(cores, workers) == threads


def test_outside_a_worker_auto_leaves_torch_alone_and_a_count_is_taken():
    assert torch_threads.for_this_worker() is None
    with dask.config.set({"daskflow-kv.cluster.torch-threads": 3}):
        assert torch_threads.for_this_worker() == 3


def _load_model(client):
    KVRuntime(client, "tiny-llama").generate_text("Hello there", 2).result()


def test_a_lone_worker_runs_its_model_on_every_core_and_two_share_them(client):
    _load_model(client)
    assert set(client.run(torch_threads.of_a_new_thread).values()) == {split := torch_threads.split_cores(CPU_COUNT, 2)}
    with local_cluster(n_workers=1, dashboard_address=":0") as cluster, Client(cluster) as c:
        # Dask's task threads stay as set: torch's count is a separate setting
        assert [w["nthreads"] for w in c.scheduler_info()["workers"].values()] == [1]
        assert list(c.run(torch_threads.of_a_new_thread).values()) == [1]  # Dask's, until a model is loaded here
        _load_model(c)
        assert list(c.run(torch_threads.of_a_new_thread).values()) == [CPU_COUNT]
    assert split == max(1, CPU_COUNT // 2)


@pytest.mark.parametrize("bad", [0, -1, "many", 1.5])
def test_a_bad_thread_count_is_refused_before_any_worker_starts(bad):
    with pytest.raises(InvalidInputError, match="torch_threads"):
        local_cluster(n_workers=1, torch_threads=bad)
