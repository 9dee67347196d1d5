"""Admission under the KV budget on plain numbers, with and without tenants' quotas. Pure policy."""

from daskflow_kv.policy.admission import (ADMIT, FAIL, STUCK, WAIT, Room, Tenancy, admit, blocks_to_spill, make_room,
                                          runs_to_preempt, spill_order)
from daskflow_kv.policy.eviction import BlockUsage

NOW = 1000.0
QUOTAS = {"alice": 400, "bob": 400}


def blk(key, owner, nbytes=100, pinned=False, age=10.0):
    return BlockUsage(key, nbytes, NOW - age, 0, pinned, None, 0, owner)


def test_without_tenants_it_admits_evicts_waits_and_fails_only_what_can_never_fit():
    assert admit(100, 500, 0, 1000, [], NOW).action == ADMIT
    d = admit(300, 900, 0, 1000, [blk("x", None, 200), blk("y", None, 100, pinned=True)], NOW)
    assert (d.action, d.victims) == (ADMIT, ("x",))
    assert admit(300, 900, 0, 1000, [blk("y", None, 900, pinned=True)], NOW, busy=True).action == WAIT
    pinned = [blk("y", None, 900, pinned=True)]
    assert admit(300, 900, 0, 1000, pinned, NOW, waited=1.0, patience=3.0).action == WAIT  # in line
    d = admit(300, 900, 0, 1000, pinned, NOW, waited=3.0, patience=3.0)  # nothing ran, nothing freed
    assert d.action == STUCK and "are pinned" in d.reason and "quota" not in d.reason
    assert admit(1001, 0, 0, 1000, [], NOW).action == FAIL


def test_another_tenant_cannot_take_the_quota_alice_does_not_use_yet():
    # bob holds 500 B pinned; alice holds nothing: 400 B of the budget stay hers.
    bob = [blk(f"b{i}", "bob", pinned=True) for i in range(5)]
    t = Tenancy("bob", QUOTAS, {"bob": 500}, {})
    d = admit(200, 500, 0, 1000, bob, NOW, tenancy=t)
    assert d.action == STUCK and "quota" in d.reason  # 500 + 200 > 1000 - 400: no room (stuck, no patience)
    assert admit(100, 500, 0, 1000, bob, NOW, tenancy=t).action == ADMIT  # 600 fits beside alice's 400
    # alice's own task fits in what her quota kept free
    assert admit(400, 500, 0, 1000, bob, NOW, tenancy=Tenancy("alice", QUOTAS, {"bob": 500}, {})).action == ADMIT


def test_a_tenant_evicts_another_only_down_to_its_quota():
    alice = [blk(f"a{i}", "alice", age=900) for i in range(6)]  # 600 B, the oldest: cheapest to evict
    bob = [blk(f"b{i}", "bob", age=1) for i in range(3)]  # 300 B, unpinned
    t = Tenancy("bob", QUOTAS, {"alice": 600, "bob": 300}, {})
    d = admit(300, 900, 0, 1000, alice + bob, NOW, tenancy=t)
    assert d.action == ADMIT and sum(v.startswith("a") for v in d.victims) <= 2  # alice keeps >= 400
    d = admit(400, 900, 0, 1000, alice + [blk(f"b{i}", "bob", pinned=True) for i in range(3)], NOW, tenancy=t)
    assert d.action == STUCK  # 200 of alice's may go, not 300: her quota is guaranteed


def test_a_task_larger_than_what_the_others_quotas_leave_can_never_fit():
    d = admit(700, 0, 0, 1000, [], NOW, tenancy=Tenancy("alice", QUOTAS, {}, {}))
    assert d.action == FAIL and "other tenants' quotas" in d.reason
    assert admit(600, 0, 0, 1000, [], NOW, tenancy=Tenancy("alice", QUOTAS, {}, {})).action == ADMIT


def test_reserved_bytes_count_toward_a_tenants_quota():
    # alice has 400 B promised to her running task: her quota is in use, bob may fill the rest
    t = Tenancy("bob", QUOTAS, {}, {"alice": 400})
    assert admit(600, 0, 400, 1000, [], NOW, tenancy=t).action == ADMIT


# -- whom to preempt when a line is deadlocked --------------------------------------------------
def test_runs_to_preempt_takes_the_youngest_that_free_enough():
    pins = [(100, frozenset({"young"})), (300, frozenset({"mid"})), (50, frozenset({"old"}))]
    assert runs_to_preempt(pins, ["young", "mid", "old"], 80) == ["young"]
    assert runs_to_preempt(pins, ["young", "mid", "old"], 250) == ["mid"]  # young alone falls short; mid suffices
    assert runs_to_preempt(pins, ["young", "mid", "old"], 380) == ["young", "mid"]
    assert runs_to_preempt(pins, ["young", "mid", "old"], 420) == ["young", "mid", "old"]


def test_a_block_several_runs_share_is_freed_only_when_all_of_them_go():
    pins = [(200, frozenset({"a", "b"})), (10, frozenset({"b"}))]
    assert runs_to_preempt(pins, ["a", "b"], 150) == ["a", "b"]
    assert runs_to_preempt(pins, ["b"], 150) == []  # a is no candidate (the waiting task's own run): b alone frees 10


def test_what_no_preemption_frees_is_never_counted():
    pins = [(500, None), (20, frozenset({"a"}))]  # leased, or kept by a reader no run claims
    assert runs_to_preempt(pins, ["a"], 100) == []
    assert runs_to_preempt(pins, ["a"], 0) == []  # nothing lacking: nobody goes


# -- where a stuck line's oldest task gets its room ----------------------------------------------
def test_a_stuck_task_moves_where_it_fits_now_rather_than_preempt_anyone():
    planned = Room("a", 300, [(400, frozenset({"young"}))])  # preempting young would free it here
    assert make_room([planned, Room("b", 50, []), Room("c", 0, [])], ["young"]) == ("c", [])


def test_otherwise_its_planned_worker_is_cleared_first_then_where_the_fewest_runs_go():
    planned = Room("a", 300, [(200, frozenset({"y1"})), (200, frozenset({"y2"}))])  # two runs to go here
    other = Room("b", 100, [(150, frozenset({"y1"}))])  # one here
    assert make_room([planned, other], ["y1", "y2"]) == ("a", ["y1", "y2"])
    held_by_its_own_run = Room("a", 300, [(400, frozenset({"mine", "y1"}))])  # no younger run frees it
    two_to_go = Room("c", 100, [(100, frozenset({"y1"})), (100, frozenset({"y2"}))])
    assert make_room([held_by_its_own_run, other, two_to_go], ["y1", "y2"]) == ("b", ["y1"])


def test_no_room_anywhere_that_younger_runs_can_free_gives_none():
    rooms = [Room("a", 300, [(400, frozenset({"mine"}))]), Room("b", 100, [(500, None)])]
    assert make_room(rooms, ["y1"]) is None


# -- what a blocked line spills instead --------------------------------------------------------
def test_spill_order_takes_younger_runs_first_then_the_waiting_run_then_older_ones():
    ranks = {"old": 1.0, "mine": 2.0, "young": 3.0, "younger": 4.0, "idle": None}
    assert spill_order(ranks, "mine", 2.0) == ["idle", "younger", "young", "mine", "old"]
    assert spill_order({"old": 1.0}, "mine", 2.0) == ["old"]  # the waiting run pins nothing there


def test_blocks_to_spill_frees_the_room_with_the_fewest_runs_and_keeps_what_the_task_reads():
    pins = [("doc", 400, frozenset({"young", "mine"})), ("y1", 300, frozenset({"young"})),
            ("m1", 200, frozenset({"mine"})), ("running", 900, None), ("view", 0, frozenset({"young"}))]
    assert blocks_to_spill(pins, ["young", "mine"], 250) == ["y1"]  # young alone frees 300
    assert blocks_to_spill(pins, ["young", "mine"], 600) == ["doc", "y1", "m1"]  # both go: the shared doc too
    assert blocks_to_spill(pins, ["young", "mine"], 600, keep=frozenset({"doc"})) == []  # 500 is all there is
    assert blocks_to_spill(pins, ["young"], 50) == ["y1"]  # a view of an output frees nothing: never listed
    assert blocks_to_spill(pins, ["young", "mine"], 2000) == []  # a running task's block is never spilled
