"""The Dask runtime: KV states as futures pinned to workers.

Owns: ``KVRuntime`` (the distributed operators, client side: a façade over its parts -
``plugin_client``, ``prefix_cache``, ``planner``, ``submit``, ``publish``, ``registry``,
``materialize``, ``resume``, ``kv_persistence``, ``calibration``), the functions that run
inside tasks on workers (``tasks``, ``chunk_task``), cluster entry points (``cluster``:
LocalCluster, LocalCUDACluster, an existing scheduler, SLURM) and catalog export.

May import: ``daskflow_kv.state``, ``daskflow_kv.policy``, ``daskflow_kv.model`` (inside
tasks), ``daskflow_kv.plugins`` (to register them) and Dask. Never the workflow layer.

Exports are lazy, so a worker importing ``daskflow_kv.runtime.tasks`` pulls in no client code.
"""

import importlib

_EXPORTS = {
    "KVRuntime": "kv_runtime",
    "DistKVState": "kv_runtime",
    "DistGeneration": "kv_runtime",
    "local_cluster": "cluster",
    "embedded_runtime": "cluster",
    "kv_runtime": "cluster",
    "connect": "cluster",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'daskflow_kv.runtime' has no attribute {name!r}")
