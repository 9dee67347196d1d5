"""How many threads a worker's torch runs with: its share of the host's cores.

Dask spawns workers with ``OMP_NUM_THREADS=1``, so that the tasks of a worker's threads do
not each start a thread pool of their own. A KV worker's model work runs in one thread, its
step loop (KV tasks secede while they wait on it), and a step of several decode rows or a
prefill chunk is compute-bound: with one thread a lone worker on a 2-core host left a core
idle, and an 8-row SmolLM2 fp32 decode step took 91 ms against 63 ms with two (one row:
42 ms either way; 2026-12-05). The setting ``daskflow-kv.cluster.torch-threads``: a count,
or ``auto``: ``local_cluster`` splits the host's cores over the workers it starts, and a
worker started any other way (Slurm, ``dask worker``, a plain LocalCluster) takes its own
Dask threads, Dask's share of its host's cores.

Set as a worker first loads a model (``tasks.get_runner``): torch ops before it are few,
and threads made later (the step loop's) take the new count as they start.
"""

from __future__ import annotations

from .. import validation

SETTING = "cluster.torch-threads"


def split_cores(cores: int, workers: int) -> int:
    """Each of ``workers`` processes' share of ``cores`` (at least 1; 1 while unknown)."""
    return max(1, cores // workers) if workers > 0 else 1


def setting(override=None) -> str | int:
    """The setting (or ``override``) checked: ``"auto"`` or a count >= 1."""
    return validation.setting(SETTING, override, "torch_threads", validation.auto_or_count)


def for_this_worker() -> int | None:
    """The threads this process's torch should run with, or None outside a Dask worker with
    ``auto`` (an in-process ``Engine`` keeps torch's own default)."""
    chosen = setting()
    if chosen != "auto":
        return chosen
    from distributed import get_worker

    try:
        return get_worker().state.nthreads
    except ValueError:  # not in a worker
        return None


def apply() -> int:
    """Size this process's torch as ``for_this_worker`` says -> the threads it now runs with."""
    import torch

    n = for_this_worker()
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def of_a_new_thread() -> int:
    """The threads torch runs with in a thread started now, as the step loop is (OpenMP keeps
    a count per thread: one that already ran torch, like a worker's event loop, keeps its)."""
    import torch
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(torch.get_num_threads).result()
