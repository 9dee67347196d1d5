"""SLURM through dask-jobqueue: the scheduler runs here with the KV plugin preloaded, every
worker is an ``sbatch`` job with the tensor serializers preloaded.

What a worker job needs, and where it comes from when the caller does not say:

- the same Python and the same daskflow_kv as the client: ``python`` is this process's
  interpreter (a virtual environment's ``bin/python`` is enough, no activation), and the
  variables named in ``daskflow-kv.slurm.forward-env`` (``PYTHONPATH``, the model cache,
  daskflow-kv settings) are exported in the job script, so a site that submits with
  ``--export=NONE`` still starts workers that import this daskflow_kv;
- cores and memory from ``daskflow-kv.cluster`` (threads and memory per worker process, as
  on a local cluster), and a KV budget that fits in one worker's memory;
- a worker lifetime shorter than the walltime by ``daskflow-kv.slurm.retire-before-walltime``
  (staggered by half of it), so a worker retires (its KV blocks move to the others) before
  Slurm kills it, and ``adapt`` submits its successor;
- a scale-down that retires the dropped workers (their KV blocks move) before it cancels
  their jobs, which SLURMCluster alone does not do;
- a scheduler address the jobs can reach: a loopback address (what Dask picks on a host
  without a route) draws a warning naming the fix (``interface=``), since jobs on other
  nodes could never connect.

Needs the slurm extra (``pip install 'daskflow-kv[slurm]'``: dask-jobqueue).
"""

from __future__ import annotations

import fnmatch
import ipaddress
import os
import shlex
import warnings
from urllib.parse import urlsplit

import dask
from dask.utils import format_bytes, parse_bytes

from .. import config
from .. import dask_internals as di
from .preloads import NANNY_PRELOAD, WORKER_PRELOAD, comm_protocol, kv_dask_config, scheduler_options

JOB_NAME = "daskflow-kv-worker"


def walltime_seconds(walltime: str | int | None) -> int | None:
    """Seconds in a Slurm time limit: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS`` (an int is minutes, as sbatch reads it); None when there is none."""
    if walltime in (None, "", "UNLIMITED", "INFINITE"):
        return None
    text = str(walltime)
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))  # D-HH, D-HH:MM
        h, m, s = parts
    elif len(parts) == 3:
        h, m, s = parts
    else:  # MM or MM:SS
        h, (m, s) = 0, (parts + [0])[:2]
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


def worker_lifetime(walltime_s: int | None, margin_s: float) -> int | None:
    """Seconds a worker lives before it retires: the walltime less the margin, but never
    less than half the walltime (a short job still does work)."""
    if walltime_s is None:
        return None
    return int(max(walltime_s - margin_s, walltime_s / 2))


def forwarded_env(environ=None, patterns=None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) whose names match one of
    ``patterns`` (default: ``daskflow-kv.slurm.forward-env``, shell-style wildcards)."""
    environ = os.environ if environ is None else environ
    patterns = config.get("slurm.forward-env", patterns)
    return {k: v for k, v in sorted(environ.items()) if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def _slurm_kwargs(kwargs: dict, kv_budget=None, env: dict | None = None) -> dict:
    """SLURMCluster / SLURMJob keyword arguments: the caller's, completed as the module says."""
    _require_jobqueue()  # registers the jobqueue.* settings read below
    kw = dict(kwargs)
    kw.setdefault("processes", 1)
    kw.setdefault("cores", kw["processes"] * config.get("cluster.threads-per-worker"))
    kw.setdefault("memory", format_bytes(kw["processes"] * parse_bytes(config.get("cluster.memory-limit"))))
    kw.setdefault("job_name", JOB_NAME)
    per_worker = parse_bytes(kw["memory"]) // kw["processes"]
    budget = config.get_bytes("kv-budget", kv_budget)
    if budget is not None and budget >= per_worker:
        raise ValueError(f"kv_budget {format_bytes(budget)} does not fit in one worker's memory "
                         f"({kw['memory']} per job / {kw['processes']} processes = {format_bytes(per_worker)})")

    args = list(kw.get("worker_extra_args") or [])
    if WORKER_PRELOAD not in args:
        args += ["--preload", WORKER_PRELOAD]
    if NANNY_PRELOAD not in args:  # the job's nanny reads the job's config: dropped there
        args += ["--preload-nanny", NANNY_PRELOAD]
    walltime = kw.get("walltime") or dask.config.get("jobqueue.slurm.walltime")
    walltime_s = walltime_seconds(walltime)
    lifetime = worker_lifetime(walltime_s, config.get_seconds("slurm.retire-before-walltime"))
    if lifetime is not None and "--lifetime" not in args:
        # Jobs submitted together would retire together, with no worker left to take their
        # blocks: spread the retirements over the margin, all still before the walltime.
        args += ["--lifetime", f"{lifetime}s", "--lifetime-stagger", f"{(walltime_s - lifetime) // 2}s"]
    kw["worker_extra_args"] = args

    env = forwarded_env() if env is None else env
    exports = [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]
    kw["job_script_prologue"] = exports + list(kw.get("job_script_prologue") or [])
    return kw


def _require_jobqueue():
    try:
        import dask_jobqueue
    except ImportError as e:
        raise RuntimeError("SLURM support needs dask-jobqueue: pip install 'daskflow-kv[slurm]'") from e
    return dask_jobqueue


def job_workers(job_names, worker_names) -> list[str]:
    """The Dask worker names that belong to the given jobs (``name`` with one process per
    job, ``name-0``, ``name-1``, ... with several)."""
    jobs = set(map(str, job_names))
    return sorted(w for w in map(str, worker_names) if w in jobs or w.rpartition("-")[0] in jobs)


_CLUSTER_CLASS = None


def _cluster_class():
    """SLURMCluster whose scale-down retires workers before cancelling their jobs.

    distributed's SpecCluster asks the scheduler to retire the jobs it drops by *name* in
    the argument that takes addresses, so nothing is retired and the job is cancelled with
    its KV blocks still in memory: every one of them lost (found by slurm_check.sh). Here
    they are retired by name first, which moves their keys to the remaining workers.
    """
    global _CLUSTER_CLASS
    if _CLUSTER_CLASS is None:
        _CLUSTER_CLASS = di.retiring_by_name(_require_jobqueue().SLURMCluster, job_workers, "KVSLURMCluster")
    return _CLUSTER_CLASS


def is_loopback(address: str) -> bool:
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def slurm_cluster(kv_budget: str | int | None = None, env: dict | None = None, allow_loopback: bool = False,
                  security=None, **kwargs):
    """A dask_jobqueue.SLURMCluster: the scheduler runs here with the KV plugin preloaded,
    workers run in SLURM jobs with the tensor serializers preloaded.

    ``kv_budget``: KV bytes per worker (default ``daskflow-kv.kv-budget``); it must fit in a
    worker's memory. ``env``: variables exported in every job script (default: those of
    this process named by ``daskflow-kv.slurm.forward-env``). ``allow_loopback``: no warning
    for a scheduler address only this host can reach (a single-node Slurm). Other keyword
    arguments go to ``SLURMCluster`` (queue, account, cores, memory, walltime, interface,
    job_script_prologue, log_directory, ...). Call ``.scale(jobs=n)`` or ``.adapt(...)``
    to submit worker jobs. ``security``: a ``distributed.Security`` with certificate files
    every node can read: the scheduler and every worker job then talk tls://.
    """
    kw = _slurm_kwargs(kwargs, kv_budget, env)
    if security is not None:
        kw.setdefault("security", security)
        kw.setdefault("protocol", comm_protocol(security))
    kw["scheduler_options"] = {**scheduler_options(kv_budget), **(kw.get("scheduler_options") or {})}
    with dask.config.set(kv_dask_config()):
        cluster = _cluster_class()(**kw)
    if is_loopback(cluster.scheduler_address) and not allow_loopback:
        warnings.warn(
            f"the scheduler's address {cluster.scheduler_address} is loopback: worker jobs on other nodes cannot "
            "reach it. Pass interface='eth0' (or ib0, ...) or scheduler_options={'host': ...}; "
            "allow_loopback=True silences this on a single-node Slurm", RuntimeWarning, stacklevel=2)
    return cluster


def render_slurm_job_script(scheduler_address: str = "tcp://scheduler:8786", kv_budget=None, env: dict | None = None,
                            **kwargs) -> str:
    """The sbatch script of one KV worker job, without starting a scheduler or submitting."""
    jq = _require_jobqueue()
    kw = _slurm_kwargs(kwargs, kv_budget, env)
    kw.pop("job_name", None)
    return jq.slurm.SLURMJob(scheduler=scheduler_address, name=JOB_NAME, job_name=JOB_NAME, **kw).job_script()
