"""What every KV cluster's processes load, whatever started them (LocalCluster, dask-cuda,
dask-jobqueue, ``dask scheduler`` by hand): the scheduler preloads the KV plugin and its
dashboard page, workers preload the tensor serializers, and the Active Memory Manager runs
``KVAwareReduceReplicas`` so it never drops a KV replica the planner placed.
"""

from __future__ import annotations

SCHEDULER_PRELOAD = "daskflow_kv.plugins.kv_scheduler"
DASHBOARD_PRELOAD = "daskflow_kv.plugins.dashboard"
WORKER_PRELOAD = "daskflow_kv.transport.serialization"
KV_AMM_POLICY = "daskflow_kv.plugins.kv_scheduler.KVAwareReduceReplicas"
# For worker jobs whose nanny reads its own config (Slurm): drops DROPPED_WORKER_ENV there
NANNY_PRELOAD = "daskflow_kv.runtime.nanny_preload"
DROPPED_WORKER_ENV = ("MALLOC_TRIM_THRESHOLD_",)  # what a KV worker must not inherit (``worker_environ``)


def comm_protocol(security=None) -> str:
    """tls:// when a ``distributed.Security`` with certificates is given, else tcp://."""
    if security is not None and (getattr(security, "tls_ca_file", None) or getattr(security, "require_encryption",
                                                                                    False)):
        return "tls://"
    return "tcp://"


def kv_dask_config() -> dict:
    """Dask config a KV cluster starts with: the AMM that keeps KV replicas, and workers
    spawned without ``MALLOC_TRIM_THRESHOLD_`` (``worker_environ``)."""
    return {"distributed.scheduler.active-memory-manager.policies": [{"class": KV_AMM_POLICY}],
            "distributed.nanny.pre-spawn-environ": worker_environ()}


def worker_environ() -> dict:
    """Dask's nanny environment for new workers, less ``MALLOC_TRIM_THRESHOLD_``.

    Dask sets it to 64 KiB so that pandas workers hand freed memory back to the OS; setting
    it also fixes glibc's mmap threshold, and a step loop that allocates and frees megabytes
    of activations every step then pays for fresh pages each time: the same steps ran 1.26x
    slower in a worker spawned with it (24.0-27.9 s against 20.2-22.2 s, 4 runs each,
    SmolLM2 fp32, 2026-12-03). A KV block is one tensor, freed whole.
    """
    import dask

    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {})
    for name in DROPPED_WORKER_ENV:
        environ.pop(name, None)
    return environ


def preload_argv(kv_budget) -> list[str]:
    return ["--kv-budget", str(kv_budget)] if kv_budget is not None else []  # 0 too: keep nothing cached


def scheduler_options(kv_budget=None) -> dict:
    """Scheduler keyword arguments that load the KV plugin as a preload."""
    # One argv list per preload, or the second preload is silently dropped.
    return {"preload": [SCHEDULER_PRELOAD, DASHBOARD_PRELOAD], "preload_argv": [preload_argv(kv_budget), []]}
