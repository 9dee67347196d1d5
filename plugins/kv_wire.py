"""What a graph may hold before Dask schedules it: values a worker message can carry.

The scheduler sends each task to its worker in one ``compute-task`` message: the key, its
priority and its annotations (every one but ``kv``, which the plugin strips), packed with
msgpack. A value it cannot pack - an integer outside 64 bits (``dask.annotate(foo=10**400)``,
a key ``10**400``, ``priority=-10**400``), a value nested too deep - does not fail that
task: Dask drops the worker's whole stream, and every tenant loses the K/V that worker
held. Any client can send one, with a session or without; so the plugin checks every
graph in ``update_graph`` and refuses the tasks carrying such a value before any of the
graph is scheduled (their dependents err with them).
"""

from __future__ import annotations

from daskflow_kv import dask_internals as di


def unsendable(task_keys, annotations: dict, priority: dict) -> dict:
    """Task key -> why a worker message could not carry it (one line); {} when the whole
    graph can travel (checked whole first: one pack for an ordinary graph)."""
    carried = {name: values for name, values in annotations.items() if name != "kv"}
    if di.wire_error([list(task_keys), priority, carried]) is None:
        return {}
    out = {}
    for key in task_keys:
        why = di.wire_error([key, priority.get(key), {n: v[key] for n, v in carried.items() if key in v}])
        if why is not None:
            out[key] = why
    return out
