"""The workflow gate on a real cluster, played by two tenants and the admin.

One place (half a run per worker, two workers): three workflows sent at once run one after
another, the later ones waiting in line, with text mode's tokens. A tenant can neither set
the limit nor take another's run out, nor see another's runs in its answers; a client that
dies inside, a run that stops asking, and a run inside that stops renewing free their
places (a long run renewing keeps its own); the admin raising the limit lets the line in
at once.
"""

from __future__ import annotations

import threading
import time

import pytest

from conftest import wait_until
from daskflow_kv.flow.executor import run_state_mode, run_text_mode
from daskflow_kv.plugins import kv_gate
from daskflow_kv.plugins.dashboard.data import collect
from daskflow_kv.plugins.dashboard.metrics import generate
from daskflow_kv.plugins.dashboard.render import render_sections
from daskflow_kv.runtime.workflow_gate import admitted
from daskflow_kv.plugins.tenants import AccessDenied
from daskflow_kv.workflows import WORKFLOWS
from tenancy_kit import plugin, runtime, tenant, tenant_cluster


@pytest.fixture(scope="module")
def cluster():
    with tenant_cluster(**{"scheduler.workflow-gate": 0.5}) as c:  # 2 workers: one place
        yield c


alice = tenant("alice")
bob = tenant("bob")
ops = tenant("ops")


def _compiled(rt, salt: str):
    wf = WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=96, max_new_tokens=4, agents=2,
                          question=f"{salt}: which prefix should the cache keep?")
    return wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)


def _gate(cluster) -> dict:
    return plugin(cluster).gate.view()


def test_one_place_runs_concurrent_workflows_one_after_another_exactly(alice, cluster):
    flows = [_compiled(alice, f"gate-{i}") for i in range(3)]
    results: list = [None] * 3

    def work(i):
        results[i] = run_state_mode(flows[i], alice)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert all(r is not None for r in results)
    spans = sorted((min(a.level_started_at for a in r.agents.values()), max(a.finished_at for a in r.agents.values()))
                   for r in results)
    assert all(end <= nxt_start for (_, end), (nxt_start, _) in zip(spans, spans[1:])), spans  # never two inside
    assert sum(r.gate_wait_s > 0.05 for r in results) >= 2  # the later ones waited in line
    for flow, r in zip(flows, results):
        text = run_text_mode(flow, alice)  # text mode passes the gate too
        assert {n: a.tokens for n, a in r.agents.items()} == {n: a.tokens for n, a in text.agents.items()}
    assert _gate(cluster)["running"] == 0 and _gate(cluster)["waiting"] == 0


def test_a_tenant_may_neither_set_the_limit_nor_take_anothers_run_out(alice, bob, cluster):
    with pytest.raises(AccessDenied, match="admin role"):
        bob.set_workflow_gate(8)
    assert _gate(cluster)["workflow_gate_per_worker"] == 0.5
    assert alice.plugin.gate_enter("alice-run", 1.0)["admitted"]
    assert bob.plugin.gate_leave("alice-run") is False  # his own (absent) run of that name, not hers
    assert not bob.plugin.gate_enter("bob-run", 0.2)["admitted"]  # her run still holds the place
    metrics = generate(cluster.scheduler).decode()  # /metrics: counts, no tenant's run named
    for line in ("daskflow_kv_workflows_running 1.0", "daskflow_kv_workflows_waiting 1.0",
                 "daskflow_kv_workflow_gate_slots 1.0"):
        assert line in metrics.splitlines(), line
    assert "alice-run" not in metrics and "bob-run" not in metrics
    page = render_sections(collect(cluster.scheduler))  # the KV page a browser not logged in gets
    cards = page["kv-cards"] if "kv-cards" in page else page["cards"]
    assert "Workflow gate" in cards and 'data-metric="workflows_waiting" data-value="1"' in cards
    assert "alice-run" not in str(page) and "bob-run" not in str(page)
    assert alice.plugin.gate_leave("alice-run") is True
    assert bob.plugin.gate_enter("bob-run", 2.0)["admitted"]
    assert bob.plugin.gate_leave("bob-run")


def test_a_client_that_dies_inside_frees_its_place(alice, cluster):
    doomed = runtime(cluster, "bob")
    assert doomed.plugin.gate_enter("holds-the-place", 1.0)["admitted"]
    assert alice.plugin.gate_enter("next", 0.2) == {"admitted": False}  # her own run's answer: nothing of bob's
    assert _gate(cluster)["running"] == 1
    doomed.client.close()  # its process could as well have died: the scheduler drops the client
    assert wait_until(lambda: alice.plugin.gate_enter("next", 1.0)["admitted"], timeout=20)
    assert alice.plugin.gate_leave("next")


def test_a_run_that_stops_asking_leaves_the_line(alice, bob, cluster):
    assert alice.plugin.gate_enter("inside", 1.0)["admitted"]
    assert not bob.plugin.gate_enter("gone-quiet", 0)["admitted"]  # asks once, never again
    assert _gate(cluster)["waiting"] == 1
    assert wait_until(lambda: _gate(cluster)["waiting"] == 0, timeout=10)  # 3 missed answers of 1 s
    assert alice.plugin.gate_leave("inside")
    assert _gate(cluster)["running"] == 0  # the quiet run was not let in in its absence


def test_the_admin_raising_the_limit_lets_the_line_in_at_once(alice, bob, ops, cluster):
    assert alice.plugin.gate_enter("first", 1.0)["admitted"]
    assert not bob.plugin.gate_enter("second", 0.2)["admitted"]
    waiting = threading.Thread(target=lambda: bob.plugin.gate_enter("second", 10.0))
    t0 = time.perf_counter()
    waiting.start()
    try:  # the call is waiting on the scheduler before the limit changes
        assert wait_until(lambda: any(r[2] == "second" for r in plugin(cluster).gate._woken), timeout=5)
        assert ops.set_workflow_gate(1)["slots"] == 2
        waiting.join(timeout=10)
        assert time.perf_counter() - t0 < 5  # woken by the change, not by its 10 s wait running out
        assert _gate(cluster)["running"] == 2
    finally:
        ops.set_workflow_gate(0.5)
        alice.plugin.gate_leave("first")
        bob.plugin.gate_leave("second")


def test_a_run_inside_that_stops_renewing_loses_its_place_and_is_not_put_back(alice, bob, cluster, monkeypatch):
    monkeypatch.setattr(kv_gate, "RENEW_S", 0.3)  # the scheduler runs in this process: 0.9 s without renewal
    assert alice.plugin.gate_enter("vanished", 1.0)["admitted"]  # and never renewed, nor left
    assert not bob.plugin.gate_enter("behind-it", 0.2)["admitted"]
    assert wait_until(lambda: bob.plugin.gate_enter("behind-it", 1.0)["admitted"], timeout=10)
    assert alice.plugin.gate_enter("vanished", 0, renew=True) == {"admitted": False}  # a renewal queues nothing
    assert _gate(cluster)["waiting"] == 0 and _gate(cluster)["running"] == 1
    assert bob.plugin.gate_leave("behind-it") and not alice.plugin.gate_leave("vanished")


def test_a_long_run_keeps_its_place_by_renewing_it(alice, bob, cluster, monkeypatch):
    monkeypatch.setattr(kv_gate, "RENEW_S", 0.3)
    with admitted(alice.plugin, "long-run", renew_s=0.1):
        time.sleep(2.5)  # nearly three times what losing it would take without renewals
        assert _gate(cluster)["running"] == 1
        assert not bob.plugin.gate_enter("after-it", 0.2)["admitted"]
    assert wait_until(lambda: bob.plugin.gate_enter("after-it", 1.0)["admitted"], timeout=5)
    assert bob.plugin.gate_leave("after-it")


def test_a_bad_limit_is_refused_before_the_scheduler_hears_of_it(ops, cluster):
    with pytest.raises(ValueError, match="running workflows per worker") as e:
        ops.set_workflow_gate(0)
    assert "\n" not in str(e.value)
    assert _gate(cluster)["workflow_gate_per_worker"] == 0.5
    with pytest.raises(ValueError, match=r"wait \(seconds\) must be a number from 0 to 30"):
        ops.plugin.gate_enter("too-patient", 31)  # the scheduler refuses a wait past its longest
    assert _gate(cluster)["waiting"] == 0


def test_a_run_the_budget_preempts_goes_back_to_the_head_of_the_line_and_the_gate_backs_off(alice, bob, ops,
                                                                                               cluster):
    """What the KV budget's deadlock breaker does with a run it preempts (``on_preempt``)."""
    gate = plugin(cluster).gate
    ops.set_workflow_gate(1)  # two places
    try:
        assert alice.plugin.gate_enter("first", 1.0)["admitted"]
        assert bob.plugin.gate_enter("second", 1.0)["admitted"]
        assert not alice.plugin.gate_enter("third", 0.2)["admitted"]
        assert gate.send_back("bob", "second")
        view = _gate(cluster)
        assert (view["running"], view["waiting"], view["backed_off_to"], view["slots"]) == (1, 2, 1, 1)
        assert not bob.plugin.gate_enter("second", 0.2)["admitted"]  # it waits for a place, asking again
        assert alice.plugin.gate_leave("first")
        assert bob.plugin.gate_enter("second", 1.0)["admitted"]  # the head of the line: before "third"
        assert not alice.plugin.gate_enter("third", 0.2)["admitted"]  # one place until a calm spell passes
        assert not gate.send_back("bob", "nobody-inside")
    finally:
        alice.plugin.gate_leave("third")
        bob.plugin.gate_leave("second")
        ops.set_workflow_gate(0.5)
