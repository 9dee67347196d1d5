"""Where a stream's CPU went: each process's CPU seconds and each step loop's busy seconds.

On 2 cores the client threads, the scheduler and both workers share the machine; a model
(``daskflow-kv simulate``) that prices only the workers' forwards runs faster than the run it
models by however much CPU the rest took. Exp 7 records, per row, the delta of:

* ``cpu_s``: user + system CPU seconds of the bench process (both clients and their
  threads), the scheduler (None when it runs in the bench process, as a ``LocalCluster``'s
  does: counted in the client's), and each worker;
* ``step_busy_s``: seconds each worker's step loops spent inside forward steps.
"""

from __future__ import annotations

import os


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def worker_load(dask_worker=None) -> dict:
    """This worker process's CPU seconds and its step loops' busy seconds, since start."""
    from ..runtime.step_worker import engine_stats

    return {"cpu_s": _cpu_seconds(), "busy_s": sum(st["busy_s"] for st in engine_stats().values())}


def scheduler_cpu(dask_scheduler=None) -> tuple[int, float]:
    return os.getpid(), _cpu_seconds()


def snapshot(client) -> dict:
    """The cluster's counters now (cumulative; ``delta`` of two is a row's load). A scheduler
    in the client's own process (a ``LocalCluster``'s) reports None: its CPU is the client's."""
    pid, sched = client.run_on_scheduler(scheduler_cpu)
    return {"client": _cpu_seconds(), "scheduler": None if pid == os.getpid() else sched,
            "workers": client.run(worker_load)}


def delta(before: dict, after: dict) -> dict:
    """``cpu_s`` and ``step_busy_s`` of the interval between two snapshots (workers by address;
    a worker that restarted in between reports from its new start)."""
    workers = after["workers"]
    was = before["workers"]

    def d(addr: str, k: str) -> float:
        now, then = workers[addr][k], was.get(addr, {}).get(k, 0.0)
        return round(now - then if now >= then else now, 3)

    sched = None if after["scheduler"] is None else round(after["scheduler"] - before["scheduler"], 3)
    return {"cpu_s": {"client": round(after["client"] - before["client"], 3), "scheduler": sched,
                      "workers": {a: d(a, "cpu_s") for a in workers}},
            "step_busy_s": {a: d(a, "busy_s") for a in workers}}
