"""The control plane's cost budget per workflow (issue 54), measured on a real cluster.

A short stream of the load-stream workflows (RAG and debate over shared documents, the tiny
model) runs one after another, as plain Dask tasks (text mode) and in state mode, at 2 and
4 workers. The scheduler plugin counts every ``kv_*`` RPC where it enters
(``plugins/kv_rpc_counts``) and Dask counts its task transitions: per workflow, both are
held to the budget below, which sits just above what the code achieves now. A change that
adds a round trip per level, or one per agent or per worker, fails here. (Scheduler CPU
is too noisy on a shared host for a hard gate: ``benchmarks/control_plane.py`` measures it.)
"""

import asyncio

import pytest

from daskflow_kv.plugins.kv_rpc_counts import RpcCounts

# kv_* RPCs per workflow, state mode, by name: the stream is 2.5 levels a workflow. Per level
# one lookup each for the materialize and the resume (each carrying the planner's snapshot:
# no kv_snapshot call, the cluster calibrated first), one acquire and one register for the
# materialize, one acquire and one register per group of branches resumed together (one group
# when every branch batches on one worker; the margin allows a level now and then split over
# two), and two releases (the group prefix, carrying the fork's registration, then the level's
# states in one call); per workflow the gate's enter and leave, the run's end and its report.
RPC_BUDGET = {"kv_lookup": 5.0, "kv_acquire": 5.5, "kv_register_states": 5.5, "kv_release_states": 5.0,
              "kv_gate_enter": 1.0, "kv_gate_leave": 1.0, "kv_run_done": 1.0, "kv_workflow_done": 1.0}
# 24 measured at 2 and 4 workers: 31.5 before the lookup carried the snapshot (26.5) and the
# fork's registration rode on the release after it
RPC_TOTAL_BUDGET = 25.0
TRANSITIONS_BUDGET = 90.0  # Dask task transitions per workflow, state mode (76-82 measured, placement varies; plain Dask: 18)
PER_REBUILD = 8.0  # a rebuild: its task's 4 transitions and its blocks' (4.8 measured in all)
TEXT_RPCS = {"kv_gate_enter": 1.0, "kv_gate_leave": 1.0}  # plain Dask's calls ask the plugin only for the gate


def test_rpc_counts_count_sync_and_async_handlers_and_refusals():
    counts = RpcCounts()

    def plain(x):
        if x < 0:
            raise PermissionError("refused")
        return x

    async def waits(x):
        return x + 1

    h = counts.counted({"kv_plain": plain, "kv_waits": waits})
    assert h["kv_plain"](1) == 1 and asyncio.run(h["kv_waits"](1)) == 2
    with pytest.raises(PermissionError):
        h["kv_plain"](-1)  # a refused call cost a message all the same
    assert asyncio.iscoroutinefunction(h["kv_waits"]) and not asyncio.iscoroutinefunction(h["kv_plain"])
    assert counts.snapshot() == {"kv_plain": 2, "kv_waits": 1}


@pytest.mark.parametrize("workers", [2, 4])
def test_control_plane_budget_per_workflow(workers):
    from distributed import Client

    from daskflow_kv.bench.control_budget import per_workflow, workflow_pool
    from daskflow_kv.runtime.cluster import local_cluster
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    with local_cluster(n_workers=workers, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        rt = KVRuntime(client, "tiny-llama")
        rt.calibrate(probe_bytes="1MiB", probe_tokens=256, probe_repeats=1)  # no calibration inside the stream
        pool = workflow_pool(rt, 6, 2, 256, 4, f"budget-{workers}")
        text = per_workflow(rt, pool, "text")
        state = per_workflow(rt, pool, "state", text["outputs"])
    print(f"{workers} workers: state {state['rpc_per_workflow']} = {state['rpc_total']:.1f} RPCs, "
          f"{state['transitions_per_workflow']:.1f} transitions {state['transitions_by_cause']}, {state['rebuilds_per_workflow']:.2f} rebuilds; text {text['rpc_total']:.1f} RPCs, "
          f"{text['transitions_per_workflow']:.1f} transitions a workflow")
    assert state["exact"], "state mode's tokens differ from text mode's"
    assert text["rpc_per_workflow"] == TEXT_RPCS
    over = {k: v for k, v in state["rpc_per_workflow"].items() if v > RPC_BUDGET.get(k, 0.0)}
    assert not over, f"RPCs a workflow over budget: {over} (budget {RPC_BUDGET})"
    assert state["rpc_total"] <= RPC_TOTAL_BUDGET
    # The gate holds the transitions the workflows' own traffic caused (``OWN_CAUSES``); the
    # cluster's weather (stealing, a paused worker) is printed with the causes when it fails.
    # A prefix the cost model rebuilt where it is read rather than moved (its choice follows
    # the host's measured speeds) is allowed its task and blocks. A CI run on a loaded host
    # counted 101.3 in all at 4 workers, every RPC on budget (77-82 here, 0-0.8 rebuilds).
    allowed = TRANSITIONS_BUDGET + PER_REBUILD * state["rebuilds_per_workflow"]
    assert state["own_transitions_per_workflow"] <= allowed, (state["transitions_by_cause"], state["rebuilds_per_workflow"])
    assert text["own_transitions_per_workflow"] <= 20, text["transitions_by_cause"]  # one task an agent, and its result


def test_prefill_profiles_are_fitted_once_per_new_sample(monkeypatch):
    """Every planning snapshot reads the fitted profiles: a worker is refitted only after a
    new sample of its own (refitting every worker each time grew the cost with workers)."""
    from types import SimpleNamespace

    from daskflow_kv.plugins import kv_profiles
    from daskflow_kv.policy.cost_model import PrefillSample

    fits = []
    real_fit = kv_profiles.fit_prefill_profile
    monkeypatch.setattr(kv_profiles, "fit_prefill_profile", lambda s: fits.append(len(s)) or real_fit(s))
    book = kv_profiles.ProfileBook(SimpleNamespace(workers={"w1": None, "w2": None}), 8)
    for w in ("w1", "w2"):
        for n in (64, 128, 256):
            book.add_sample(w, PrefillSample(n, 0, n / 1000))
    first = book.prefill_profiles()
    assert book.prefill_profiles() == first and len(fits) == 2  # the second read fits nothing
    book.add_sample("w1", PrefillSample(512, 0, 0.6))
    again = book.prefill_profiles()
    assert len(fits) == 3 and again["w1"]["samples"] == 4 and again["w2"] == first["w2"]
    again["w2"]["a"] = -1.0  # an answer is the caller's: the kept fit is not changed through it
    assert book.prefill_profiles()["w2"] == first["w2"]
    book.forget_worker("w1")
    assert set(book.prefill_profiles()) == {"w2"}


def test_transitions_are_split_by_cause_and_unknown_causes_count_as_the_workflows():
    from daskflow_kv.bench.control_budget import by_cause, own_transitions, rebuilds

    seen = [("kvreplica-a", "released", "waiting", "update-graph-17.5"),
            ("kvreplica-a", "waiting", "processing", "task-finished-18.0"),
            ("kvprefill-b", "processing", "released", "steal-3"),
            ("kvprefill-b", "released", "waiting", "kv-tick-19.25")]
    causes = by_cause(seen)
    assert causes == {"update-graph": 1, "task-finished": 1, "steal": 1, "kv-tick": 1}
    assert own_transitions(causes, 4) == 2 and rebuilds(seen) == 1
    assert by_cause(None) is None and own_transitions(None, 4) == 4 and rebuilds(None) == 0
