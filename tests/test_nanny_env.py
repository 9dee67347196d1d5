"""A worker job's nanny (Slurm: it reads the job's Dask config, not ours) spawns its worker
without Dask's ``MALLOC_TRIM_THRESHOLD_`` once it preloads ``runtime.nanny_preload``.

Real nannies and worker processes (``dask_internals.drop_spawn_env`` is the Dask internal
it rests on); a nanny without the preload is the control."""

from __future__ import annotations

import os

import dask
from distributed import Nanny
from distributed.utils_test import gen_cluster

from daskflow_kv.runtime.preloads import NANNY_PRELOAD

DASK_DEFAULT = {"MALLOC_TRIM_THRESHOLD_": 65536, "OMP_NUM_THREADS": 1}  # as Dask's own config sets them


def _environ(names):
    return {n: os.environ.get(n) for n in names}


@gen_cluster(client=True, nthreads=[], timeout=120)
async def test_the_nanny_preload_drops_malloc_trim_from_the_workers_environment(c, s):
    with dask.config.set({"distributed.nanny.pre-spawn-environ": DASK_DEFAULT}):
        async with Nanny(s.address, nthreads=1, preload_nanny=[NANNY_PRELOAD]) as kv, \
                Nanny(s.address, nthreads=1) as plain:
            await c.wait_for_workers(2)
            env = await c.run(_environ, list(DASK_DEFAULT))
            assert env[kv.worker_address]["MALLOC_TRIM_THRESHOLD_"] is None
            assert env[plain.worker_address]["MALLOC_TRIM_THRESHOLD_"] == "65536"
            # the other variables stay as the job's config and environment set them
            assert env[kv.worker_address]["OMP_NUM_THREADS"] == env[plain.worker_address]["OMP_NUM_THREADS"]
