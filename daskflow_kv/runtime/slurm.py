"""SLURM through dask-jobqueue: the scheduler runs here with the KV plugin preloaded, every
worker is an ``sbatch`` job with the tensor serializers preloaded.

Needs the slurm extra (``pip install 'daskflow-kv[slurm]'``: dask-jobqueue).
"""

from __future__ import annotations

import sys

import dask

from .preloads import WORKER_PRELOAD, kv_dask_config, scheduler_options


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
