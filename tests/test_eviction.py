"""Eviction policy on plain rows: pins, budget, chain order, score preferences, determinism."""

import random

import pytest

from daskflow_kv.policy.eviction import (
    BlockUsage,
    EvictionPlan,
    EvictionWeights,
    choose_victims,
    evictable_bytes,
    eviction_score,
)

NOW = 1000.0


def blk(key, nbytes=100, age=0.0, reuse=0, pinned=False, parent=None, start=0):
    return BlockUsage(key, nbytes, NOW - age, reuse, pinned, parent, start)


def chain(prefix, n, nbytes=100, **kw):
    out, parent = [], None
    for i in range(n):
        out.append(blk(f"{prefix}{i}", nbytes, parent=parent, start=64 * i, **kw))
        parent = out[-1].key
    return out


def test_score_formula():
    w = EvictionWeights(half_life=10.0, reuse_weight=1.0, size_exponent=1.0)
    assert eviction_score(blk("a", 200, age=10.0, reuse=1), NOW, w) == pytest.approx(2 * 0.5 / 200)
    assert eviction_score(blk("a", 200, age=0.0, reuse=3), NOW, w) == pytest.approx(4 / 200)
    flat = EvictionWeights(half_life=10.0, size_exponent=0.0)
    assert eviction_score(blk("a", 5000), NOW, flat) == eviction_score(blk("a", 5), NOW, flat) == 1.0
    assert eviction_score(blk("a", 100, age=-5.0), NOW, w) == pytest.approx(1 / 100)  # clock skew


def test_within_budget_evicts_nothing():
    plan = choose_victims(chain("a", 3), used_bytes=300, budget_bytes=300, now=NOW)
    assert plan == EvictionPlan((), 0, 300, False)


def test_stops_as_soon_as_within_budget():
    blocks = [blk(f"k{i}", 100, age=i) for i in range(10)]
    plan = choose_victims(blocks, used_bytes=1000, budget_bytes=750, now=NOW)
    assert plan.victims == ("k9", "k8", "k7")  # the three oldest
    assert (plan.freed_bytes, plan.remaining_bytes, plan.over_budget_pinned) == (300, 700, False)


def test_never_picks_pinned_and_reports_over_budget():
    blocks = [blk("p1", 500, age=999, pinned=True), blk("u1", 100, age=1), blk("p2", 500, pinned=True)]
    plan = choose_victims(blocks, used_bytes=1100, budget_bytes=200, now=NOW)
    assert plan.victims == ("u1",)
    assert (plan.freed_bytes, plan.remaining_bytes) == (100, 1000)
    assert plan.over_budget_pinned is True


def test_chain_is_cut_from_the_end():
    a0, a1, a2 = chain("a", 3)
    # The root is the least valuable by score, the leaf the most: order must still be leaf-first.
    a0 = blk("a0", 100, age=500, start=0)
    a2 = blk("a2", 100, age=0, reuse=50, parent="a1", start=128)
    plan = choose_victims([a0, a1, a2], used_bytes=300, budget_bytes=200, now=NOW)
    assert plan.victims == ("a2",)
    plan = choose_victims([a0, a1, a2], used_bytes=300, budget_bytes=0, now=NOW)
    assert plan.victims == ("a2", "a1", "a0")


def test_pinned_child_protects_its_prefix():
    blocks = [blk("a0", age=900), blk("a1", age=900, parent="a0"), blk("a2", pinned=True, parent="a1"),
              blk("b0", age=1)]
    plan = choose_victims(blocks, used_bytes=400, budget_bytes=0, now=NOW)
    assert plan.victims == ("b0",)
    assert plan.over_budget_pinned is True
    assert evictable_bytes(blocks) == 100


def test_branches_compete_on_score_once_they_are_leaves():
    # root <- x0 <- x1 (old) and root <- y0 (fresh): both of x's blocks go before y0 and root.
    blocks = [blk("root", age=50), blk("x0", age=400, parent="root", start=64),
              blk("x1", age=400, parent="x0", start=128), blk("y0", age=10, parent="root", start=64)]
    plan = choose_victims(blocks, used_bytes=400, budget_bytes=100, now=NOW)
    assert plan.victims == ("x1", "x0", "y0")
    assert plan.remaining_bytes == 100


def test_prefers_old_then_unused_then_large():
    old_new = [blk("new", age=1), blk("old", age=300)]
    assert choose_victims(old_new, 200, 100, NOW).victims == ("old",)
    reuse = [blk("hot", reuse=5), blk("cold", reuse=0)]
    assert choose_victims(reuse, 200, 100, NOW).victims == ("cold",)
    size = [blk("small", 100), blk("large", 1000)]
    assert choose_victims(size, 1100, 1050, NOW).victims == ("large",)
    # A recent, much reused block outlives an old unused one of the same size.
    mix = [blk("a", age=120, reuse=0), blk("b", age=120, reuse=8)]
    assert choose_victims(mix, 200, 100, NOW).victims == ("a",)


def test_ties_are_deterministic_deeper_first_then_key():
    same = [blk("b"), blk("a"), blk("c")]
    assert choose_victims(same, 300, 0, NOW).victims == ("a", "b", "c")
    depth = [blk("x", start=0), blk("y", start=640), blk("z", start=64)]
    assert choose_victims(depth, 300, 100, NOW).victims == ("y", "z")


def test_duplicate_keys_rejected():
    with pytest.raises(ValueError, match="twice"):
        choose_victims([blk("a"), blk("a")], 200, 0, NOW)


def test_random_forests_keep_every_invariant():
    rng = random.Random(7)
    for trial in range(200):
        blocks = []
        for i in range(rng.randint(1, 30)):
            parent = rng.choice([None] + [b.key for b in blocks]) if blocks else None
            blocks.append(blk(f"k{i:02d}", rng.randint(1, 500), age=rng.uniform(0, 600),
                              reuse=rng.randint(0, 5), pinned=rng.random() < 0.15, parent=parent,
                              start=rng.randint(0, 20) * 64))
        used = sum(b.nbytes for b in blocks) + rng.randint(0, 300)
        budget = rng.randint(0, used)
        shuffled = blocks[:]
        rng.shuffle(shuffled)
        plan = choose_victims(blocks, used, budget, NOW)
        assert plan == choose_victims(shuffled, used, budget, NOW), "input order changed the plan"

        by_key = {b.key: b for b in blocks}
        gone = set()
        for v in plan.victims:
            assert not by_key[v].pinned
            kids = [b.key for b in blocks if b.parent == v]
            assert all(k in gone for k in kids), f"{v} evicted before its child"
            gone.add(v)
        assert plan.freed_bytes == sum(by_key[v].nbytes for v in plan.victims)
        assert plan.remaining_bytes == used - plan.freed_bytes
        assert plan.over_budget_pinned == (plan.remaining_bytes > budget)
        if plan.victims:  # minimal: without the last victim we were still over budget
            assert plan.remaining_bytes + by_key[plan.victims[-1]].nbytes > budget
        if plan.over_budget_pinned:  # nothing evictable was left behind
            for b in blocks:
                if b.key not in gone and not b.pinned:
                    assert any(c.parent == b.key and c.key not in gone for c in blocks)


# -- tenants' quotas: floors per owner ----------------------------------------------------------
def owned(key, owner, nbytes=100, age=0.0, **kw):
    return BlockUsage(key, nbytes, NOW - age, 0, kw.pop("pinned", False), kw.pop("parent", None), 0, owner)


def test_a_floor_keeps_an_owner_at_its_quota_whatever_the_scores():
    # alice's blocks are the oldest, so by score they would all go first; her floor keeps 200 B.
    blocks = [owned(f"a{i}", "alice", age=900) for i in range(4)] + [owned(f"b{i}", "bob", age=1) for i in range(4)]
    plan = choose_victims(blocks, 800, 300, NOW, floors={"alice": 200})
    assert {"a0", "a1"} <= set(plan.victims) and sum(v.startswith("a") for v in plan.victims) == 2
    assert sum(v.startswith("b") for v in plan.victims) == 3 and plan.remaining_bytes == 300
    # floors for everyone, summing past the budget: the plan stops there, over budget
    plan = choose_victims(blocks, 800, 300, NOW, floors={"alice": 300, "bob": 300})
    assert plan.freed_bytes == 200 and plan.over_budget_pinned


def test_a_floor_counts_what_the_owner_holds_besides_its_blocks():
    # alice holds 250 B here (an output beside her two blocks): one block may go, down to 150 >= 100
    blocks = [owned("a0", "alice", age=900), owned("a1", "alice", age=800)]
    plan = choose_victims(blocks, 250, 0, NOW, floors={"alice": 100}, held={"alice": 250})
    assert plan.victims == ("a0",) and plan.over_budget_pinned


def test_floors_never_change_a_plan_without_owners():
    rng = random.Random(11)
    for _ in range(50):
        blocks = [blk(f"k{i}", rng.randint(1, 300), age=rng.uniform(0, 600)) for i in range(rng.randint(1, 15))]
        used = sum(b.nbytes for b in blocks)
        budget = rng.randint(0, used)
        assert choose_victims(blocks, used, budget, NOW, floors={"alice": 10 ** 6}) == \
            choose_victims(blocks, used, budget, NOW)


def test_a_block_announced_for_reuse_goes_last_but_still_goes_under_pressure():
    planned = BlockUsage("plan", 100, NOW - 999, 0, planned=True)  # oldest: by score alone it goes first
    fresh = [blk(f"k{i}", 100, age=i) for i in range(3)]
    plan = choose_victims([planned, *fresh], used_bytes=400, budget_bytes=200, now=NOW)
    assert plan.victims == ("k2", "k1")  # the hint wins over age
    plan = choose_victims([planned, *fresh], used_bytes=400, budget_bytes=0, now=NOW)
    assert plan.victims[-1] == "plan" and not plan.over_budget_pinned  # soft: never a deadlock


def test_a_replica_goes_before_any_sole_copy_and_one_copy_stays_longest():
    replica = BlockUsage("copy", 100, NOW, 9, replica=True)  # fresh and read often: by score it would stay
    sole = [blk(f"k{i}", 100, age=500) for i in range(2)]
    plan = choose_victims([replica, *sole], used_bytes=300, budget_bytes=200, now=NOW)
    assert plan.victims == ("copy",)
    planned_replica = BlockUsage("pcopy", 100, NOW, 0, planned=True, replica=True)
    plan = choose_victims([planned_replica, *sole], used_bytes=300, budget_bytes=200, now=NOW)
    assert plan.victims == ("pcopy",)  # the hint protects the last copy, not an extra one
