"""The second tenant's workbench: a real cluster with tenants configured as
``tests/test_tenancy.py`` has them (alice and bob users, ops the admin), their runtimes, and
the few things an attacker inside the documented boundary uses (a plain Dask client, the
plugin's ``kv_*`` RPCs, the store URL). The scheduler runs in this process: tests read the
plugin's state there only to check what an attack did, never to attack.
"""

from __future__ import annotations

import contextlib

import dask
import pytest
from distributed import Client

from daskflow_kv.keys import PLUGIN_NAME
from daskflow_kv.runtime.cluster import local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime

TENANTS = {
    "alice": {"secret": "alice-secret-8f2c", "role": "user"},
    "bob": {"secret": "bob-secret-11aa", "role": "user"},
    "ops": {"secret": "ops-secret-7d41", "role": "admin"},
}
PROMPT = ("Patient record: Jane Roe, born 1961-03-04, SSN 078-05-1120, diagnosis: hypertension. "
          "Medication: lisinopril 10 mg daily. Notes: follow up in three months.")
SUFFIX = " Summary for the referring physician:"
BLOCK = 16


@contextlib.contextmanager
def tenant_cluster(tenants=TENANTS, n_workers: int = 2, **settings):
    """A local cluster whose scheduler lists ``tenants``; ``settings``: more daskflow-kv.* keys.

    The settings apply while the cluster starts (its plugin reads them then), not after:
    another cluster started later in the same process has its own."""
    extra = {f"daskflow-kv.{k}": v for k, v in settings.items()}
    with dask.config.set({"daskflow-kv.tenants": tenants, **extra}):
        cluster = local_cluster(n_workers=n_workers, threads_per_worker=1, dashboard_address="127.0.0.1:0")
    with cluster:
        yield cluster


def cluster_fixture(tenants=TENANTS, name: str = "cluster", **settings):
    """A module-scoped fixture named ``name``: a ``tenant_cluster`` (in a test module:
    ``cluster = cluster_fixture()``)."""

    @pytest.fixture(scope="module", name=name)
    def fixture():
        with tenant_cluster(tenants, **settings) as c:
            yield c

    return fixture


def compute_note(**fields) -> dict:
    """A compute task's ``kv`` annotation as a client could write it (bob's, in the attacks)."""
    return {"role": "compute", "op": "prefill", "state_id": "kvstate-prefill-b0b0b0b0b0b0", "target": None,
            "reads": [], "decision": None, "first": False, "kv_out": 0, **fields}


def runtime(cluster, namespace: str, tenants=TENANTS, **kw) -> KVRuntime:
    """A tenant's runtime on its own client (close with ``rt.client.close()``)."""
    return KVRuntime(Client(cluster), "tiny-llama", block_size=BLOCK, namespace=namespace,
                     secret=tenants[namespace]["secret"], **kw)


def tenant(namespace: str, tenants=TENANTS, cluster: str = "cluster", name: str | None = None):
    """A module-scoped fixture named ``name`` (default ``namespace``): its runtime on the
    module's ``cluster`` fixture (in a test module: ``alice = tenant("alice")``)."""

    @pytest.fixture(scope="module", name=name or namespace)
    def fixture(request):
        rt = runtime(request.getfixturevalue(cluster), namespace, tenants)
        yield rt
        rt.client.close()

    return fixture


def plugin(cluster):
    """The scheduler's KV plugin (for checking what an attack did)."""
    return cluster.scheduler.plugins[PLUGIN_NAME]


def text_tokens(rt: KVRuntime, tokens, max_new_tokens: int = 8) -> list[int]:
    """What text mode generates for ``tokens``: the reference every reuse path must match."""
    return rt.generate_text(list(tokens), max_new_tokens).result().generated


def scheduler_state(client, key):
    """The scheduler's state of ``key`` (None: unknown)."""
    return client.run_on_scheduler(lambda dask_scheduler: getattr(dask_scheduler.tasks.get(key), "state", None))
