"""The workflow gate's line (``policy.workflow_gate``) on plain data: places, arrival order,
one tenant's burst against another's run, leaving from inside and from the line, a run sent
back after a preemption, backing off after deadlocks."""

import dask
import pytest

from daskflow_kv.policy.workflow_gate import CALM_S, BackOff, GateLine, gate_slots, valid_per_worker


def test_places_follow_the_workers_and_never_drop_to_zero():
    assert gate_slots(None, 8) is None
    assert gate_slots(4, 2) == 8
    assert gate_slots(0.5, 2) == 1
    assert gate_slots(0.5, 1) == 1  # half a place is still one: a run can always go in
    assert gate_slots(2, 0) == 1  # no worker yet: one run goes in and waits for one, as Dask's tasks do


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "4"])
def test_a_bad_limit_is_one_line(bad):
    with pytest.raises(ValueError, match="running workflows per worker") as e:
        valid_per_worker(bad)
    assert "\n" not in str(e.value)
    assert valid_per_worker(None) is None and valid_per_worker(3) == 3.0


def test_a_bad_configured_limit_names_the_setting_in_one_line():
    from daskflow_kv.plugins.kv_settings import KVSettings

    with dask.config.set({"daskflow-kv.scheduler.workflow-gate": 0}):
        with pytest.raises(ValueError, match="setting daskflow-kv.scheduler.workflow-gate must be a number > 0") as e:
            KVSettings.from_config()
    assert "\n" not in str(e.value)
    with dask.config.set({"daskflow-kv.scheduler.workflow-gate": 4}):
        assert KVSettings.from_config().workflow_gate == 4.0


def test_one_tenant_is_first_in_first_out():
    line = GateLine()
    for run in "abcde":
        line.arrive(run)
    assert line.admit(2) == ["a", "b"]
    assert line.admit(2) == []  # full
    assert (line.running, line.waiting, line.held(None)) == (2, 3, 5)
    assert line.leave("a") is True
    assert line.admit(2) == ["c"]
    assert line.leave("d") is False  # gave up waiting: out of the line, not counted as inside
    assert (line.running, line.waiting, line.held(None)) == (2, 1, 3)  # b, c inside; e waits
    assert line.leave("b") and line.admit(2) == ["e"]
    assert line.admit(None) == [] and line.running == 2


def test_arriving_twice_keeps_the_first_place():
    line = GateLine()
    line.arrive("a")
    line.arrive("b")
    line.arrive("a")
    assert line.admit(1) == ["a"]
    line.arrive("a")  # inside already: nothing changes
    assert (line.running, line.waiting) == (1, 1)


def test_a_burst_of_one_tenant_does_not_keep_another_out():
    line = GateLine()
    for i in range(5):
        line.arrive(("bob", i), "bob")  # bob's burst arrives first
    line.arrive(("alice", 0), "alice")
    assert line.admit(2) == [("bob", 0), ("alice", 0)]  # alice has none inside: she goes next
    line.arrive(("alice", 1), "alice")
    assert line.leave(("bob", 0))
    assert line.admit(2) == [("bob", 1)]  # one each inside now: the earlier arrival goes
    assert line.leave(("alice", 0))
    assert line.admit(2) == [("alice", 1)]  # alice has none inside again


def test_no_limit_lets_everyone_in_in_order():
    line = GateLine()
    for run in range(4):
        line.arrive(run)
    assert line.admit(None) == [0, 1, 2, 3]


def test_a_run_sent_back_waits_at_the_head_of_its_line():
    line = GateLine()
    for run in "abcd":
        line.arrive(run)
    assert line.admit(3) == ["a", "b", "c"]
    assert line.push_back("b") is True  # preempted: before d, who arrived after it
    assert line.push_back("d") is False  # not inside
    assert (line.running, line.waiting) == (2, 2)
    assert line.leave("a") and line.admit(3) == ["b", "d"]
    line.arrive("x")
    assert line.push_back("c") and line.admit(3) == ["c"]  # before x, who arrived after it


def test_backing_off_cuts_to_the_runs_inside_and_grows_by_one_per_calm_spell():
    bo = BackOff()
    assert bo.limit(None) is None and bo.limit(6) == 6  # no deadlock yet: the configured places
    bo.cut(running=5, now=100.0)
    assert bo.limit(None) == 5 and bo.limit(3) == 3
    bo.grow(now=100.0 + CALM_S / 2)
    assert bo.cap == 5  # not calm long enough
    bo.grow(now=100.0 + CALM_S)
    bo.grow(now=100.0 + CALM_S + 1)  # at most one more per spell
    assert bo.cap == 6
    bo.cut(running=0, now=200.0)
    assert bo.cap == 1  # never below one run: a run alone can always go in
