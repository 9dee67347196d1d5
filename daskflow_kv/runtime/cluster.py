"""Where a KVRuntime runs: a local CPU cluster, a local CUDA cluster over UCX, an existing
scheduler, or SLURM through dask-jobqueue.

The KV plugin loads the same way everywhere: as a scheduler preload
(``daskflow_kv.plugins.kv_scheduler``, the module ``dask scheduler --preload`` takes), and
``KVRuntime`` registers it again idempotently through ``Client.register_plugin`` for
clusters started without it. Workers preload the tensor serializers
(``daskflow_kv.runtime.serialization``); ``KVRuntime`` also installs them as a worker plugin.

The Active Memory Manager keeps running (it still trims replicas of ordinary keys) but with
``KVAwareReduceReplicas`` in place of ``ReduceReplicas``, so it never drops a KV block
replica the planner placed; the plugin swaps the policy too on schedulers started
without this configuration.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import Iterator

import dask

SCHEDULER_PRELOAD = "daskflow_kv.plugins.kv_scheduler"
DASHBOARD_PRELOAD = "daskflow_kv.plugins.kv_dashboard"
WORKER_PRELOAD = "daskflow_kv.runtime.serialization"
KV_AMM_POLICY = "daskflow_kv.plugins.kv_scheduler.KVAwareReduceReplicas"
DEFAULT_MEMORY_LIMIT = "4GiB"  # per worker process


def kv_dask_config() -> dict:
    """Dask config a KV cluster's scheduler must start with (AMM that keeps KV replicas)."""
    return {"distributed.scheduler.active-memory-manager.policies": [{"class": KV_AMM_POLICY}]}


def _preload_argv(kv_budget) -> list[str]:
    return ["--kv-budget", str(kv_budget)] if kv_budget else []


def scheduler_options(kv_budget=None) -> dict:
    """Scheduler keyword arguments that load the KV plugin as a preload."""
    # One argv list per preload, or the second preload is silently dropped.
    return {"preload": [SCHEDULER_PRELOAD, DASHBOARD_PRELOAD], "preload_argv": [_preload_argv(kv_budget), []]}


def local_cluster(
    n_workers: int = 2,
    threads_per_worker: int = 1,
    memory_limit: str | int = DEFAULT_MEMORY_LIMIT,
    dashboard_address: str | None = ":0",
    kv_budget: str | int | None = None,
    **kwargs,
):
    """A LocalCluster of worker processes over TCP, KV plugin preloaded, AMM made KV-safe.

    ``kv_budget``: per-worker KV bytes (e.g. "512MiB"); None leaves the cache unbounded.
    Extra keyword arguments go to ``distributed.LocalCluster``.
    """
    from distributed import LocalCluster

    with dask.config.set(kv_dask_config()):
        return LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads_per_worker,
            processes=True,
            protocol="tcp://",
            memory_limit=memory_limit,
            dashboard_address=dashboard_address,
            scheduler_kwargs=scheduler_options(kv_budget),
            preload=[WORKER_PRELOAD],
            **kwargs,
        )


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 -- a broken CUDA install counts as none
        return 0


def cuda_cluster(
    n_workers: int | None = None,
    protocol: str = "ucx",
    kv_budget: str | int | None = None,
    dashboard_address: str | None = ":0",
    **kwargs,
):
    """A dask_cuda.LocalCUDACluster, one worker per GPU, UCX transport, KV plugin preloaded.

    Needs the ``gpu`` extra (dask-cuda, distributed-ucxx, cupy) and at least one GPU; says
    which is missing otherwise. ``protocol="tcp"`` runs without UCX.
    """
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as e:
        raise RuntimeError(
            "cuda_cluster needs dask-cuda: pip install 'daskflow-kv[gpu]' (dask-cuda, distributed-ucxx-cu12, "
            f"cupy-cuda12x); import failed: {e}"
        ) from e
    gpus = gpu_count()
    if gpus == 0:
        raise RuntimeError("cuda_cluster needs a CUDA GPU and none is visible; use local_cluster() on CPU")
    if protocol == "ucx":
        try:
            import distributed_ucxx  # noqa: F401  -- registers the "ucx" comm backend
        except ImportError as e:
            raise RuntimeError(
                "protocol='ucx' needs distributed-ucxx (pip install distributed-ucxx-cu12), or pass protocol='tcp'"
            ) from e
    with dask.config.set(kv_dask_config()):
        return LocalCUDACluster(
            n_workers=n_workers or gpus,
            protocol=protocol,
            dashboard_address=dashboard_address,
            scheduler_kwargs=scheduler_options(kv_budget),
            preload=[WORKER_PRELOAD],
            **kwargs,
        )


def connect(address: str, timeout: str | float = "10s", **client_kwargs):
    """A Client on an existing scheduler, with the KV plugins registered (idempotently).

    The scheduler and workers must be able to import daskflow_kv (same environment).
    """
    from distributed import Client

    from ..plugins.kv_scheduler import KVSchedulerPlugin
    from .serialization import TorchSerializationPlugin

    client = Client(address, timeout=timeout, **client_kwargs)
    client.register_plugin(TorchSerializationPlugin())
    client.register_plugin(KVSchedulerPlugin())
    return client


def scheduler_command(kv_budget=None, port: int = 8786) -> str:
    """The shell command that starts a KV-aware scheduler by hand (or in its own batch job)."""
    args = ["dask", "scheduler", "--port", str(port), "--preload", SCHEDULER_PRELOAD, *_preload_argv(kv_budget),
            "--preload", DASHBOARD_PRELOAD]
    return " ".join(shlex.quote(a) for a in args)


def _slurm_kwargs(kwargs: dict) -> dict:
    kw = dict(kwargs)
    kw.setdefault("cores", 1)
    kw.setdefault("memory", "8GiB")
    kw.setdefault("processes", 1)
    kw["worker_extra_args"] = list(kw.get("worker_extra_args") or []) + ["--preload", WORKER_PRELOAD]
    return kw


def _require_jobqueue():
    try:
        import dask_jobqueue
    except ImportError as e:
        raise RuntimeError("SLURM support needs dask-jobqueue: pip install 'daskflow-kv[slurm]'") from e
    return dask_jobqueue


def slurm_cluster(kv_budget: str | int | None = None, **kwargs):
    """A dask_jobqueue.SLURMCluster: the scheduler runs here with the KV plugin preloaded,
    workers run in SLURM jobs with the tensor serializers preloaded.

    Keyword arguments go to ``SLURMCluster`` (queue, account, cores, memory, walltime,
    job_script_prologue, ...). Call ``.scale(n)`` to submit worker jobs.
    """
    jq = _require_jobqueue()
    kw = _slurm_kwargs(kwargs)
    kw["scheduler_options"] = {**scheduler_options(kv_budget), **(kw.get("scheduler_options") or {})}
    with dask.config.set(kv_dask_config()):
        return jq.SLURMCluster(**kw)


def render_slurm_job_script(scheduler_address: str = "tcp://scheduler:8786", **kwargs) -> str:
    """The sbatch script of one KV worker job, without starting a scheduler or submitting."""
    jq = _require_jobqueue()
    kw = _slurm_kwargs(kwargs)
    kw.setdefault("python", sys.executable)
    return jq.slurm.SLURMJob(scheduler=scheduler_address, name="daskflow-kv-worker", **kw).job_script()


def kv_runtime(target=None, **runtime_kwargs):
    """A KVRuntime on ``target``: a Client, a cluster object, a scheduler address, or None
    (a new local_cluster, closed with the client). Keyword arguments go to KVRuntime."""
    from distributed import Client

    from .kv_runtime import KVRuntime

    if isinstance(target, Client):
        client = target
    elif isinstance(target, str):
        client = connect(target)
    elif target is not None:
        client = Client(target)
    else:
        cluster = local_cluster()
        client = Client(cluster)
        client._daskflow_owned_cluster = cluster
    return KVRuntime(client, **runtime_kwargs)


def close_runtime(runtime) -> None:
    """Close a runtime's client, and the cluster ``kv_runtime(None)`` started for it."""
    cluster = getattr(runtime.client, "_daskflow_owned_cluster", None)
    runtime.client.close()
    if cluster is not None:
        cluster.close()


@contextlib.contextmanager
def embedded_runtime(
    n_workers: int = 2,
    threads_per_worker: int = 1,
    memory_limit: str | int = DEFAULT_MEMORY_LIMIT,
    dashboard_address: str | None = None,
    kv_budget: str | int | None = None,
    **runtime_kwargs,
) -> Iterator:
    """A local cluster, a client and a KVRuntime for the length of a ``with`` block."""
    from distributed import Client

    from .kv_runtime import KVRuntime

    with (
        local_cluster(n_workers, threads_per_worker, memory_limit, dashboard_address, kv_budget) as cluster,
        Client(cluster) as client,
    ):
        yield KVRuntime(client, **runtime_kwargs)
