"""A local CUDA cluster for KV states: dask-cuda's LocalCUDACluster, UCX between GPU workers.

Needs a GPU extra, ``pip install 'daskflow-kv[gpu-cu12]'`` or ``'daskflow-kv[gpu-cu13]'``
(dask-cuda, distributed-ucxx, CuPy for that CUDA major; they pin dask and distributed, see
docs/gpu.md). Each missing piece is named when it is missing.

Workers and devices: one worker per visible GPU, except on a one-GPU machine, where two
workers share device 0, so that KV blocks still move worker to worker (UCX carries them
between the two processes with CUDA IPC, device to device). ``devices="0,0,1,1"`` puts two
workers on each of two GPUs. dask-cuda 26.10 names each worker after its device and so
refuses a repeated one ("Can not scale beyond visible devices"); ``SharedDeviceCUDACluster``
names workers by slot instead and lets dask-cuda build each worker exactly as it would for
that device alone.

KV blocks stay torch CUDA tensors end to end: the "cuda" serializer family hands UCX the
tensor's device buffer, UCX delivers an RMM device buffer, and the receiving task gets a
CUDA tensor over it. ``frame_counts`` counts every CUDA tensor's path in every process;
``cluster_frame_counts`` reads them from the workers, so a check fails if a host path was taken.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import dask

from ..transport import frame_counts
from .preloads import WORKER_PRELOAD, kv_dask_config, scheduler_options

GPU_EXTRA = "pip install 'daskflow-kv[gpu-cu13]' (CUDA 13) or 'daskflow-kv[gpu-cu12]' (CUDA 12)"


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 -- a broken CUDA install counts as none
        return 0


def worker_devices(devices: str | Sequence[int | str] | None, gpus: int, n_workers: int | None = None) -> list[str]:
    """The device of each worker slot, as CUDA_VISIBLE_DEVICES entries.

    ``devices`` (``"0,0"``, ``[0, 1]``) wins; else one slot per GPU, or two on device 0 when
    there is exactly one GPU. ``n_workers`` keeps the first n slots (or cycles the devices
    when it asks for more slots than listed).
    """
    if devices is None:
        slots = ["0", "0"] if gpus == 1 else [str(i) for i in range(gpus)]
    elif isinstance(devices, str):
        slots = [d.strip() for d in devices.split(",") if d.strip()]
    else:
        slots = [str(d) for d in devices]
    if not slots:
        raise ValueError(f"no devices to put workers on (devices={devices!r}, {gpus} GPUs visible)")
    if n_workers is not None:
        if n_workers < 1:
            raise ValueError("n_workers must be >= 1")
        slots = [slots[i % len(slots)] for i in range(n_workers)]
    return slots


def next_slot(taken: Iterable, n_slots: int) -> int:
    """The lowest worker slot not in ``taken`` (the names of the workers there are)."""
    free = sorted(set(range(n_slots)) - set(taken))
    if not free:
        raise ValueError("Can not scale beyond visible devices", n_slots)
    return free[0]


@functools.cache
def _shared_device_cluster_class():
    from dask_cuda import LocalCUDACluster

    class SharedDeviceCUDACluster(LocalCUDACluster):
        """LocalCUDACluster whose workers are named by slot, so several may share a device."""

        def new_worker_spec(self):
            slots = self.cuda_visible_devices  # one device per slot; repeats allowed
            slot = next_slot(self.worker_spec, len(slots))
            specs = self.worker_spec
            try:
                # dask-cuda builds a worker's spec from the devices it sees and the workers it
                # has: show it this slot's device alone and no workers, then file it by slot.
                self.cuda_visible_devices, self.worker_spec = [slots[slot]], {}
                ((_, spec),) = super().new_worker_spec().items()
            finally:
                self.cuda_visible_devices, self.worker_spec = slots, specs
            return {slot: spec}

    return SharedDeviceCUDACluster


def _require(module: str, why: str) -> None:
    try:
        __import__(module)
    except ImportError as e:
        raise RuntimeError(f"{why}: {GPU_EXTRA}; import of {module} failed: {e}") from e


def cuda_cluster(
    n_workers: int | None = None,
    protocol: str = "ucx",
    kv_budget: str | int | None = None,
    dashboard_address: str | None = ":0",
    devices: str | Sequence[int | str] | None = None,
    security=None,
    **kwargs,
):
    """A LocalCUDACluster over UCX with the KV plugins: one worker per GPU, two on a one-GPU machine.

    ``devices``: the device of each worker (``"0,0"``: two workers on GPU 0), see
    ``worker_devices``. ``protocol="tcp"`` runs without UCX (CUDA tensors then cross as host
    bytes: the comparison baseline). Extra keyword arguments go to LocalCUDACluster
    (``rmm_pool_size``, ``enable_nvlink``, ``memory_limit``, ...).
    """
    if security is not None and protocol in ("ucx", "ucxx"):
        raise ValueError("UCX has no TLS in Dask: pass protocol='tls' with security=, or leave security out")
    _require("dask_cuda", "cuda_cluster needs dask-cuda")
    gpus = gpu_count()
    if gpus == 0:
        raise RuntimeError("cuda_cluster needs a CUDA GPU and none is visible; use local_cluster() on CPU")
    if protocol in ("ucx", "ucxx"):
        _require("distributed_ucxx", "protocol='ucx' needs distributed-ucxx (or pass protocol='tcp')")
    slots = worker_devices(devices, gpus, n_workers)
    cls = _shared_device_cluster_class()
    with dask.config.set(kv_dask_config()):
        return cls(
            CUDA_VISIBLE_DEVICES=",".join(slots),
            n_workers=len(slots),
            protocol=protocol,
            security=security,
            dashboard_address=dashboard_address,
            scheduler_kwargs=scheduler_options(kv_budget),
            preload=[WORKER_PRELOAD],
            **kwargs,
        )


def cluster_frame_counts(client) -> dict[str, dict]:
    """Every worker's ``frame_counts`` snapshot: which path each CUDA tensor took there."""
    return client.run(frame_counts.snapshot)


def reset_frame_counts(client) -> None:
    client.run(frame_counts.reset)
