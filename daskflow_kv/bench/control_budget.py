"""What one workflow asks of the scheduler, counted: ``kv_*`` RPCs by name and Dask task
transitions (by cause), per workflow, in state mode and as plain Dask tasks (text mode) for the same
calls. The counts are the control plane's deterministic cost (CPU seconds are noisy on a
shared host): ``tests/test_control_budget.py`` holds them to a budget, and
``benchmarks/control_plane.py`` reports them beside its CPU figures.

RPCs are counted by the scheduler plugin where they enter (``plugins/kv_rpc_counts``), read
through the admin's ``kv_counters`` view; the read itself is left out.
"""

from __future__ import annotations

from collections import Counter

from ..dask_internals import recent_transitions
from ..keys import REPLICA
from .chaos import agent_tokens, run_flow
from .load_stream import Arrival, build, documents

READ_CALL = "kv_counters"  # the call that reads the counts: not the workflows' traffic


def rpc_calls(rt) -> Counter:
    """The ``kv_*`` RPCs the scheduler has answered so far, by name (an admin's view)."""
    return Counter(rt.counters().get("rpc_calls", {}))


def rpc_spent(rt, since: Counter, n: int) -> dict[str, float]:
    """RPCs by name per workflow since the count ``since`` (``rpc_calls``), over ``n`` workflows;
    this read and the one that took ``since`` left out."""
    spent = rpc_calls(rt) - since
    spent[READ_CALL] -= 1  # the read that took ``since`` was counted after it
    return {k: v / max(1, n) for k, v in sorted((+spent).items())}


# What a workflow's own traffic makes the scheduler do: its graphs arriving, their tasks
# finishing or failing, its client letting results go. Anything else in the window (work
# stealing, a worker lost or paused and the plugin's recovery from it) is the cluster's
# weather, counted apart: a noisy host can make it, a change to the control plane cannot.
OWN_CAUSES = ("update-graph", "task-finished", "task-erred", "client-releases-keys", "client-desires-keys")


def scheduler_transitions(client) -> int:
    return client.run_on_scheduler(_transition_counter)


def _transition_counter(dask_scheduler=None) -> int:
    return dask_scheduler.transition_counter


def transitions_since(client, counter: int) -> tuple[int, list | None]:
    """Transitions since the scheduler's counter read ``counter``: how many, and each as (key,
    start, finish, stimulus id) - None when Dask's log no longer holds them all. One call."""
    return client.run_on_scheduler(_since, counter)


def _since(counter: int, dask_scheduler=None) -> tuple[int, list | None]:
    n = dask_scheduler.transition_counter - counter
    return n, recent_transitions(dask_scheduler, n)


def by_cause(seen: list | None) -> Counter | None:
    """Transitions by cause: their stimulus id without its serial number."""
    return None if seen is None else Counter(stimulus.rsplit("-", 1)[0] for *_, stimulus in seen)


def rebuilds(seen: list | None) -> int:
    """Prefixes the cost model chose to rebuild on the worker that reads them (``kvreplica``
    tasks) in ``seen``: a placement decision, each a task and its blocks."""
    return sum(1 for key, start, finish, _ in seen or () if str(key).startswith(REPLICA) and finish == "waiting")


def own_transitions(causes: Counter | None, total: int) -> int:
    """Of ``total`` transitions, those the workflows' own traffic caused (all of them, failing
    closed, when the causes are unknown)."""
    return total if causes is None else sum(v for k, v in causes.items() if k in OWN_CAUSES)


def workflow_pool(rt, n: int, docs: int, context: int, max_new: int, salt: str) -> list:
    """``n`` load-stream workflows (RAG and debate in turn) over ``docs`` shared documents."""
    texts = documents(rt.tokenizer, docs, context)
    return [build(Arrival(i, 0.0, 0, i % docs), texts[i % docs], salt, max_new) for i in range(n)]


def per_workflow(rt, pool: list, mode: str, ref: list | None = None) -> dict:
    """Run ``pool`` once, one workflow after another, in ``mode``; -> RPCs by name and
    transitions per workflow, their RPC total, and whether every output equals ``ref``."""
    calls, moves = rpc_calls(rt), scheduler_transitions(rt.client)
    outs = [agent_tokens(run_flow(rt, wf, mode)) for wf in pool]
    n = len(pool)
    by_kind = rpc_spent(rt, calls, n)
    total, seen = transitions_since(rt.client, moves)
    causes = by_cause(seen)
    return {"mode": mode, "workflows": n, "rpc_per_workflow": by_kind, "rpc_total": sum(by_kind.values()),
            "transitions_per_workflow": total / n, "own_transitions_per_workflow": own_transitions(causes, total) / n,
            "transitions_by_cause": dict(causes or {}), "rebuilds_per_workflow": rebuilds(seen) / n, "exact": ref is None or outs == ref, "outputs": outs}
