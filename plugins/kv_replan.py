"""Moving parked KV work to another worker: a task and what was planned to run after it.

The plan pins each KV task to a worker, and what reads its output (forks, replicas, the
resume that continues it, its result) to the same one. When admission moves a parked task
elsewhere - its planned worker's room is held by states that no preemption frees, and
another worker has room now - the tasks downstream of it that were planned on the old
worker and have not started go with it: left behind they would fetch its output back
there, into the room it could not have.
"""

from __future__ import annotations

from collections.abc import Mapping

from daskflow_kv import dask_internals as di

PENDING = ("waiting", "no-worker", "released")  # task states that have not started


def replan_downstream(scheduler, held: Mapping, ts, old: str, new: str) -> int:
    """Re-plan onto ``new`` the not-yet-started tasks downstream of ``ts`` that were planned on
    ``old``. ``held``: the tasks admission parks (key -> an object with ``worker`` and
    ``target``): a parked one gets the new target, admission sends it there; any other is
    pinned there. -> how many moved."""
    stack, seen, moved = [ts], {ts.key}, 0
    while stack:
        for d in stack.pop().dependents:
            if d.key in seen or d.state not in PENDING:
                continue
            seen.add(d.key)
            h = held.get(d.key)
            if h is not None and h.worker is None and h.target == old:
                h.target = new
            elif h is None and d.worker_restrictions == {old}:
                di.pin(scheduler, d, new)
            else:
                continue
            moved += 1
            stack.append(d)
    return moved
