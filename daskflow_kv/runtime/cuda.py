"""A local CUDA cluster for KV states: dask-cuda's LocalCUDACluster, UCX between GPU workers.

Needs the GPU extra (``pip install 'daskflow-kv[gpu-cu12]'`` or ``[gpu-cu13]``): dask-cuda,
distributed-ucxx and CuPy. Each missing piece is named when it is missing.
"""

from __future__ import annotations

import dask

from .preloads import WORKER_PRELOAD, kv_dask_config, scheduler_options


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
