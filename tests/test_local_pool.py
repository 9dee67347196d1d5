"""The ``local`` baseline's hard KV pool, on a real engine: admission by bytes, LRU eviction, a line."""

import threading
import time

import pytest

from daskflow_kv.bench.local_pool import KVPool, group_need
from daskflow_kv.errors import KVBudgetError
from daskflow_kv.model.sampling import GREEDY

from conftest import make_engine, wait_until


def test_group_need_counts_the_uncached_prefix_and_every_branch():
    # 100-token prefix, 64 cached (one 64-token block): 36 to prefill; each branch copies the
    # 36-token tail of the prefix past its aligned floor, then its suffix and its answer.
    assert group_need(100, 64, [5, 7], 4, 64, 10) == 10 * (36 + (36 + 5 + 4) + (36 + 7 + 4))
    assert group_need(128, 0, [1], 2, 64, 1) == 128 + 0 + 1 + 2  # aligned prefix: branches copy nothing
    assert group_need(128, 200, [1], 2, 64, 1) == 1 + 2  # more cached than asked: the prefix is all there


def _run(pool, prefix, suffixes, max_new=2):
    eng = pool.engine
    t = pool.admit(prefix, [len(s) for s in suffixes], max_new, eng.runner.bytes_per_token)
    made = []
    try:
        root = eng.materialize(prefix)
        made.append(root)
        gens = eng.resume_forks(root, suffixes, max_new, GREEDY)
        made += [g.state for g in gens]
    finally:
        pool.finish(t, *made)
    return gens


def test_pool_evicts_lru_cache_and_never_passes_its_budget():
    eng = make_engine(block_size=16)
    bpt = eng.runner.bytes_per_token
    docs = [[(7 * d + i) % 200 + 3 for i in range(48)] for d in range(4)]
    one = group_need(48, 0, [3, 3], 2, 16, bpt)
    pool = KVPool(eng, 2 * one + bpt)  # room for two groups' KV, not four
    for d in docs:
        _run(pool, d, [[5, 6, 7], [8, 9, 10]])
        assert eng.store.nbytes + pool.reserved <= pool.budget
    assert pool.evicted_states > 0
    # the most recent document is still cached: a group over it prefills nothing of it
    cached, held = eng.hold_prefix(docs[-1])
    eng.drop_hold(held)
    assert cached == 48


def test_a_group_waits_for_room_in_line_and_runs_when_it_frees():
    eng = make_engine(block_size=16)
    bpt = eng.runner.bytes_per_token
    need = group_need(32, 0, [2], 2, 16, bpt)
    pool = KVPool(eng, need + bpt)  # one group at a time
    first = pool.admit([3] * 32, [2], 2, bpt)
    admitted = threading.Event()

    def second():
        t = pool.admit([4] * 32, [2], 2, bpt)
        admitted.set()
        pool.finish(t)

    th = threading.Thread(target=second, daemon=True)
    th.start()
    assert wait_until(lambda: pool.waiting == 1)
    time.sleep(0.2)
    assert not admitted.is_set()  # no room while the first holds its reservation
    pool.finish(first)
    assert admitted.wait(5)
    th.join(5)


def test_a_group_whose_own_hold_pins_the_cache_it_evicts_is_admitted():
    """The cached blocks a waiting group holds (a prefix ending inside a longer cached block)
    survive the eviction of their states until the group drops its hold: it must look again
    then, not wait for a finish that never comes (exp 7 zipf-budget hung so, 2026-12-07)."""
    eng = make_engine(block_size=16)
    bpt = eng.runner.bytes_per_token
    longer = [(5 * i) % 200 + 3 for i in range(64)]
    pool = KVPool(eng, 60 * bpt)  # the group fits alone (57 tokens), not beside the held 64-token cache
    st = eng.materialize(longer)
    pool.kept[st.state_id] = st
    assert group_need(50, 0, [3], 2, 16, bpt) == 57 * bpt
    out = []
    th = threading.Thread(target=lambda: out.append(pool.admit(longer[:50], [3], 2, bpt)), daemon=True)
    th.start()
    th.join(5)
    assert out, "admission waited with nothing left to wake it"
    pool.finish(out[0])
    assert pool.evicted_states == 1 and pool.reserved == 0


def test_a_group_larger_than_the_pool_fails_at_once():
    eng = make_engine(block_size=16)
    pool = KVPool(eng, 1000)
    with pytest.raises(KVBudgetError, match="more than the whole pool"):
        pool.admit([3] * 64, [2], 2, eng.runner.bytes_per_token)
    assert pool.waiting == 0 and pool.reserved == 0
