"""Where a stream's CPU went: each process's CPU seconds and each step loop's busy seconds.

On 2 cores the client threads, the scheduler and both workers share the machine; a model
(``daskflow-kv simulate``) that prices only the workers' forwards runs faster than the run it
models by however much CPU the rest took. Exp 7 records, per row, the delta of:

* ``cpu_s``: user + system CPU seconds of the bench process (both clients and their
  threads), the scheduler (None when it runs in the bench process, as a ``LocalCluster``'s
  does: counted in the client's), and each worker;
* ``step_busy_s``: seconds each worker's step loops spent inside forward steps;
* ``prompt_by_op``: each worker's prompt tokens by the operator of their request: ``fed`` by
  its step loops, ``dropped`` (fed for requests that left without a result: their task was
  cancelled or failed) and ``reported`` (in the prefill events its finished tasks sent the
  scheduler): set beside what the workflows counted, it says where prompt work went uncounted;
* ``transitions``: task state transitions the scheduler and each worker made (their Dask
  state machines' counters): the event-loop work the row's tasks cost, beside the steps;
* ``step_shapes`` (only with ``DASKFLOW_KV_BENCH_STEP_SHAPES=1``: a row's steps weigh ~100 KB):
  every step each worker ran in the row, as ``model.step_shape.StepShape`` records it
  (``step_shape_fields`` names the columns), to set beside the same shapes measured on a
  lone engine (``benchmarks/step_cost.py``).
"""

from __future__ import annotations

import os

from ..model.step_shape import StepShape

STEP_FIELDS = tuple(StepShape.__dataclass_fields__)


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def worker_load(dask_worker=None) -> dict:
    """This worker process's CPU seconds and its step loops' busy seconds, since start."""
    from ..runtime.step_worker import engine_stats, prompt_tokens_by_op
    from ..runtime.tasks import reported_by_op

    stats = engine_stats().values()
    return {"cpu_s": _cpu_seconds(), "busy_s": sum(st["busy_s"] for st in stats),
            "steps": sum(st["steps"] for st in stats),
            "transitions": dask_worker.state.transition_counter if dask_worker is not None else 0,
            "prompt": prompt_tokens_by_op() | {"reported": reported_by_op()}}


def worker_steps(n: int, dask_worker=None) -> list[list]:
    """The last ``n`` steps of this worker's step loops (at most what they keep), as rows."""
    from ..runtime.step_worker import recent_steps

    return [[getattr(s, f) for f in STEP_FIELDS] for s in recent_steps()[-n:]] if n > 0 else []


def prompt_delta(now: dict, then: dict) -> dict:
    """Two of a worker's ``prompt`` counts (``{"fed" | "dropped" | "reported": {op: tokens}}``)
    apart, ops that did not move left out; a worker that restarted in between counts from its
    new start."""
    out = {}
    for kind, counts in now.items():
        old = then.get(kind, {})
        diff = {op: n - old.get(op, 0) if n >= old.get(op, 0) else n for op, n in counts.items()}
        out[kind] = {op: n for op, n in diff.items() if n}
    return out


def step_shapes(client, before: dict, after: dict) -> dict:
    """Every step each worker ran between two snapshots: ``{"step_shape_fields", "step_shapes"}``."""
    out = {}
    for addr, now in after["workers"].items():
        n = now.get("steps", 0) - before["workers"].get(addr, {}).get("steps", 0)
        out[addr] = client.run(worker_steps, n, workers=[addr])[addr]
    return {"step_shape_fields": list(STEP_FIELDS), "step_shapes": out}


def scheduler_cpu(dask_scheduler=None) -> tuple[int, float, int]:
    return os.getpid(), _cpu_seconds(), dask_scheduler.transition_counter if dask_scheduler is not None else 0


def snapshot(client) -> dict:
    """The cluster's counters now (cumulative; ``delta`` of two is a row's load). A scheduler
    in the client's own process (a ``LocalCluster``'s) reports None: its CPU is the client's."""
    pid, sched, transitions = client.run_on_scheduler(scheduler_cpu)
    return {"client": _cpu_seconds(), "scheduler": None if pid == os.getpid() else sched,
            "scheduler_transitions": transitions, "workers": client.run(worker_load)}


def delta(before: dict, after: dict) -> dict:
    """``cpu_s`` and ``step_busy_s`` of the interval between two snapshots (workers by address;
    a worker that restarted in between reports from its new start)."""
    workers = after["workers"]
    was = before["workers"]

    def d(addr: str, k: str) -> float:
        now, then = workers[addr].get(k, 0), was.get(addr, {}).get(k, 0)
        return round(now - then if now >= then else now, 3)

    sched = None if after["scheduler"] is None else round(after["scheduler"] - before["scheduler"], 3)
    return {"cpu_s": {"client": round(after["client"] - before["client"], 3), "scheduler": sched,
                      "workers": {a: d(a, "cpu_s") for a in workers}},
            "step_busy_s": {a: d(a, "busy_s") for a in workers},
            "prompt_by_op": {a: prompt_delta(workers[a].get("prompt", {}), was.get(a, {}).get("prompt", {}))
                             for a in workers},
            "transitions": {"scheduler": after.get("scheduler_transitions", 0) - before.get("scheduler_transitions", 0),
                            "workers": {a: int(d(a, "transitions")) for a in workers}}}
