"""Nanny preload for KV worker jobs daskflow-kv does not spawn itself (Slurm).

``dask worker --preload-nanny daskflow_kv.runtime.nanny_preload``: the job's nanny spawns
its worker without Dask's ``MALLOC_TRIM_THRESHOLD_`` (``preloads.worker_environ`` says
why), which a cluster daskflow-kv starts gets from its config instead.
"""

from __future__ import annotations

from .. import dask_internals as di
from .preloads import DROPPED_WORKER_ENV


def dask_setup(nanny) -> None:
    di.drop_spawn_env(nanny, DROPPED_WORKER_ENV)
