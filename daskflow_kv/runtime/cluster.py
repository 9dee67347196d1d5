"""Where a KVRuntime runs: a local CPU cluster, an existing scheduler, and the shared pieces
of every entry point (``cuda.py``: a local CUDA cluster over UCX; ``slurm.py``: SLURM).

The KV plugin loads the same way everywhere: as a scheduler preload
(``daskflow_kv.plugins.kv_scheduler``, the module ``dask scheduler --preload`` takes), and
``KVRuntime`` registers it again idempotently through ``Client.register_plugin`` for
clusters started without it. Workers preload the tensor serializers
(``daskflow_kv.transport.serialization``); ``KVRuntime`` also installs them as a worker plugin.

The Active Memory Manager keeps running (it still trims replicas of ordinary keys) but with
``KVAwareReduceReplicas`` in place of ``ReduceReplicas``, so it never drops a KV block
replica the planner placed; the plugin swaps the policy too on schedulers started
without this configuration.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator

import dask
from dask.system import CPU_COUNT

from .. import config, validation
from .. import dask_internals as di
from .main_guard import check_main_guard

from .preloads import (  # noqa: F401  -- part of this module's interface
    DASHBOARD_PRELOAD,
    KV_AMM_POLICY,
    NANNY_PRELOAD,
    SCHEDULER_PRELOAD,
    WORKER_PRELOAD,
    preload_argv,
    comm_protocol,
    kv_dask_config,
    scheduler_options,
)
from .torch_threads import SETTING as TORCH_THREADS
from .torch_threads import setting as torch_threads_setting
from .torch_threads import split_cores


def local_cluster(
    n_workers: int | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | int | None = None,
    dashboard_address: str | None = ":0",
    kv_budget: str | int | None = None,
    security=None,
    torch_threads: int | str | None = None,
    **kwargs,
):
    """A LocalCluster of worker processes over TCP, KV plugin preloaded, AMM made KV-safe.

    ``security``: a ``distributed.Security`` (e.g. ``Security.temporary()`` or one built from
    certificate files): then every connection - client, scheduler, workers - is TLS.
    ``kv_budget``: per-worker KV bytes (e.g. "512MiB"). ``torch_threads``: each worker's
    torch threads, ``"auto"``: the host's cores split over the workers (``torch_threads``
    says why). Arguments left None come from
    ``dask.config["daskflow-kv"]`` (``cluster.workers``, ``cluster.memory-limit``, ``kv-budget``,
    ...). Extra keyword arguments go to ``distributed.LocalCluster``.
    """
    from distributed import LocalCluster

    check_main_guard("local_cluster()")  # an unguarded script: one clear line before any worker starts
    # 0 is a cluster started empty and scaled later (the CLI asks for >= 1)
    n_workers = validation.setting("cluster.workers", n_workers, "n_workers", validation.integer, minimum=0)
    threads = validation.setting("cluster.threads-per-worker", threads_per_worker, "threads_per_worker",
                                 validation.integer, minimum=1)
    memory_limit = config.get("cluster.memory-limit", memory_limit)
    if memory_limit not in ("auto", None, 0):
        validation.byte_size("memory_limit", memory_limit)
    if kv_budget is not None:
        validation.byte_size("kv_budget", kv_budget, minimum=0)
    torch_threads = torch_threads_setting(torch_threads)
    if torch_threads == "auto":  # the workers split this host's cores (their nannies keep this config)
        torch_threads = split_cores(CPU_COUNT, n_workers)
    with dask.config.set({**kv_dask_config(), f"daskflow-kv.{TORCH_THREADS}": torch_threads}):
        return LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads,
            processes=True,
            protocol=comm_protocol(security),
            security=security,
            memory_limit=memory_limit,
            dashboard_address=dashboard_address,
            scheduler_kwargs=scheduler_options(kv_budget),
            preload=[WORKER_PRELOAD],
            **kwargs,
        )


def wait_for_restarts(cluster, timeout: float = 120.0) -> bool:
    """Wait until the nannies have every worker of ``cluster`` running again -> whether they do.

    Call it before closing a cluster whose workers were killed: on distributed 2026.7.1 a
    nanny closing a worker that is still starting spends its close timeout (5 s) waiting for
    the start, then gives the killed process no time to exit and raises TimeoutError out of
    ``cluster.close()`` (fixed in 2026.8.0). Seen on a loaded CI machine after a chaos test.
    """
    n = len(cluster.workers)
    try:
        if n:
            cluster.wait_for_workers(n, timeout=timeout)
        return True
    except TimeoutError:
        return False


def connect(address: str, timeout: str | float = "10s", security=None, **client_kwargs):
    """A Client on an existing scheduler, with the KV plugins registered (idempotently).

    The scheduler and workers must be able to import daskflow_kv (same environment). An
    address nothing listens on fails at once (``validation.scheduler_reachable``), not
    after the client's whole connect timeout. ``security``: a ``distributed.Security`` for
    a ``tls://`` scheduler (None: Dask's ``distributed.comm.tls.*`` configuration, if any).
    """
    from distributed import Client

    validation.scheduler_reachable("scheduler address", address)
    client = Client(address, timeout=timeout, security=security, **client_kwargs)
    from ..plugins.kv_scheduler import KVSchedulerPlugin
    from ..transport import serialization  # noqa: F401  -- registers the tensor serializers here

    client.register_plugin(KVSchedulerPlugin())  # installs the worker plugins too
    return client


def scheduler_command(kv_budget=None, port: int = 8786) -> str:
    """The shell command that starts a KV-aware scheduler by hand (or in its own batch job)."""
    args = ["dask", "scheduler", "--port", str(port), "--preload", SCHEDULER_PRELOAD, *preload_argv(kv_budget),
            "--preload", DASHBOARD_PRELOAD]
    return " ".join(shlex.quote(a) for a in args)


def kv_runtime(target=None, security=None, **runtime_kwargs):
    """A KVRuntime on ``target``: a Client, a cluster object, a scheduler address, or None
    (a new local_cluster, closed with the client). ``security`` for TLS (see local_cluster);
    other keyword arguments go to KVRuntime."""
    from distributed import Client

    from .kv_runtime import KVRuntime

    if isinstance(target, Client):
        client = target
    elif isinstance(target, str):
        client = connect(target, security=security)
    elif target is not None:
        client = Client(target, security=security or getattr(target, "security", None))
    else:
        cluster = local_cluster(security=security)
        client = Client(cluster, security=security)
        di.attach_owned_cluster(client, cluster)
    return KVRuntime(client, **runtime_kwargs)


def drop_kv(runtime) -> None:
    """Let go of every KV block the cache and ``runtime``'s client hold, before their cluster closes.

    Workers that leave while holding computed keys make the scheduler log each one as lost
    ("Removing worker ... caused the cluster to lose already computed task(s)"): nothing is
    lost at shutdown, but it reads as data loss. Only for a cluster this process owns: on a
    shared scheduler the cached prefixes are what the next client reuses.
    """
    with contextlib.suppress(Exception):  # no plugin, or already closing: nothing to drop
        runtime.plugin.drop()


def close_runtime(runtime, cluster=None) -> None:
    """Close a runtime's client, then ``cluster`` (or the one ``kv_runtime(None)`` started for
    it), dropping the KV blocks first so that the workers leave holding nothing."""
    cluster = cluster if cluster is not None else di.owned_cluster(runtime.client)
    with contextlib.suppress(Exception):  # blocks queued for the persistent store reach it first
        runtime.flush_store()
    if cluster is not None:
        drop_kv(runtime)
    runtime.client.close()
    if cluster is not None:
        cluster.close()


@contextlib.contextmanager
def embedded_runtime(
    n_workers: int | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | int | None = None,
    dashboard_address: str | None = None,
    kv_budget: str | int | None = None,
    security=None,
    **runtime_kwargs,
) -> Iterator:
    """A local cluster, a client and a KVRuntime for the length of a ``with`` block
    (``security``: TLS everywhere, see local_cluster)."""
    from distributed import Client

    from .kv_runtime import KVRuntime

    with (
        local_cluster(n_workers, threads_per_worker, memory_limit, dashboard_address, kv_budget,
                      security=security) as cluster,
        Client(cluster, security=security) as client,
    ):
        runtime = KVRuntime(client, **runtime_kwargs)
        try:
            yield runtime
        finally:
            with contextlib.suppress(Exception):
                runtime.flush_store()
            drop_kv(runtime)


def cuda_cluster(*args, **kwargs):
    """``runtime.cuda.cuda_cluster``: LocalCUDACluster over UCX with the KV plugins (see there)."""
    from .cuda import cuda_cluster as make

    check_main_guard("cuda_cluster()")
    return make(*args, **kwargs)


def slurm_cluster(*args, **kwargs):
    """``runtime.slurm.slurm_cluster``: SLURMCluster with the KV plugins (see there)."""
    from .slurm import slurm_cluster as make

    return make(*args, **kwargs)


def render_slurm_job_script(*args, **kwargs) -> str:
    """``runtime.slurm.render_slurm_job_script``: one worker job's sbatch script."""
    from .slurm import render_slurm_job_script as render

    return render(*args, **kwargs)
