"""The step loop's lane pool: slots keep their tokens through growth, and give memory back."""

import pytest
import torch

from daskflow_kv.model.lane_pool import FIRST_BYTES, FIRST_SLOTS, MAX_STRETCH, ROUND, LanePool


class _Group:  # what the pool touches of a step_cache.Group
    slot = None
    ws = None


def _pool():
    return LanePool(layers=2, kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu")


def _fill(group, value):
    for k, v in group.ws:
        k.fill_(value)
        v.fill_(-value)


def test_slots_keep_their_tokens_when_the_pool_grows():
    pool = _pool()
    groups = [_Group() for _ in range(5)]
    for i, g in enumerate(groups[:4]):
        pool.place(g, 10)
        _fill(g, i + 1)
    assert [g.slot for g in groups[:4]] == [0, 1, 2, 3] and pool.capacity == ROUND
    pool.place(groups[4], 3 * ROUND)  # no free slot and longer than every slot: both dimensions grow
    assert len(pool.owners) == 8 and pool.capacity == 3 * ROUND
    for i, g in enumerate(groups[:4]):  # views point into the new tensors and hold what was written
        assert g.ws[0][0].shape == (1, 3, 10, 4)
        assert g.ws[0][0].data_ptr() == pool.k[0][g.slot : g.slot + 1].data_ptr()
        assert all(bool((k == i + 1).all()) and bool((v == -(i + 1)).all()) for k, v in g.ws)
    assert float(pool.k[0][4].abs().sum()) == 0.0  # a new slot starts finite (zeros)


def test_a_freed_slot_is_reused_and_the_last_lane_frees_the_pool():
    pool = _pool()
    a, b, c = _Group(), _Group(), _Group()
    pool.place(a, 5)
    pool.place(b, 5)
    pool.release(a)
    assert a.slot is None and pool.place(c, 5) == 0  # the lowest free slot: the rows stay close together
    pool.release(b)
    pool.release(c)
    assert pool.k == [] and pool.nbytes == 0


def test_a_much_longer_lane_is_not_pooled_while_others_run():
    pool = _pool()
    assert pool.accepts(10**6)  # an empty pool takes anything
    pool.place(_Group(), 100)
    assert pool.accepts(MAX_STRETCH * pool.capacity)
    assert not pool.accepts(MAX_STRETCH * pool.capacity + 1)


@pytest.mark.parametrize("n", [2, 9])
def test_place_gives_views_of_the_asked_length(n):
    pool = _pool()
    gs = [_Group() for _ in range(n)]
    for i, g in enumerate(gs):
        pool.place(g, 7 + i)
    assert [g.ws[1][1].shape[2] for g in gs] == [7 + i for i in range(n)]
    assert len({g.slot for g in gs}) == n


def test_a_new_pool_takes_its_first_slots_only_while_they_stay_small():
    """Short workspaces: four slots at once, so the next lanes join without a copy. A long
    one: only the slots that fit ``FIRST_BYTES``, at least its own (a lone resume over a long
    prefix zeroed four workspaces, 778 MB for SmolLM2 at 4,096 tokens, to use one)."""
    small = _pool()
    small.place(_Group(), 10)
    assert len(small.owners) == FIRST_SLOTS
    big = LanePool(layers=30, kv_heads=3, head_dim=64, dtype=torch.float32, device="cpu")  # SmolLM2's K/V shape
    g = _Group()
    big.place(g, 4096 + 16)
    assert len(big.owners) == 1 and big.nbytes <= FIRST_BYTES and g.ws[0][0].shape[2] == 4096 + 16
    h = _Group()
    big.place(h, 100)  # a second lane: the pool doubles, the first keeps its place
    assert len(big.owners) == 2 and (g.slot, h.slot) == (0, 1)


def test_the_pool_never_grows_past_its_bound_and_a_lane_past_it_is_not_pooled():
    """Unbounded, a stream of long prompts doubled the pool until Dask's nanny restarted the
    worker (2026-12-06). A lane that would take the pool past ``max_bytes`` is refused (the
    step loop gives it a workspace of its own); freeing a slot lets the next one in again."""
    slot = 2 * 2 * 3 * ROUND * 4 * 4  # K and V, 2 layers, 3 heads, ROUND tokens, 4 dims, fp32
    pool = LanePool(layers=2, kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu", max_bytes=8 * slot)
    groups = [_Group() for _ in range(8)]
    for g in groups:
        assert pool.accepts(10)
        pool.place(g, 10)
    assert pool.nbytes == 8 * slot
    assert not pool.accepts(10)  # a ninth slot would double the pool to 16
    assert not pool.accepts(ROUND + 1)  # nor may a longer lane lengthen every slot past the bound
    pool.release(groups[3])
    assert pool.accepts(10) and pool.place(_Group(), 10) == 3 and pool.nbytes == 8 * slot
    tiny = LanePool(layers=2, kv_heads=3, head_dim=4, dtype=torch.float32, device="cpu", max_bytes=slot)
    tiny.place(_Group(), 10)  # an empty pool takes one lane, its first slots cut to the bound
    assert len(tiny.owners) == 1 and not tiny.accepts(10)
