"""fork shares blocks without copying; merge is exact or refuses."""

import pytest
import torch
from conftest import CONTEXT, SUFFIXES, assert_same_generation, make_engine

from daskflow_kv.state.blocks import common_prefix_len
from daskflow_kv.errors import MergeError


def test_fork_copies_no_tensor_bytes():
    eng = make_engine()
    root = eng.materialize(CONTEXT)
    bytes_before, copied_before = eng.store.nbytes, eng.store.bytes_copied
    ptrs = [eng.store.get(k).data_ptr() for k in root.block_keys]
    children = eng.fork(root, 8)
    assert eng.store.nbytes == bytes_before
    assert eng.store.bytes_copied == copied_before
    for child in children:
        assert child.block_keys == root.block_keys
        assert child.state_id != root.state_id
        assert [eng.store.get(k).data_ptr() for k in child.block_keys] == ptrs
        assert child.lineage[-1].op == "fork" and child.lineage[-1].parents == (root.state_id,)
    assert all(eng.store.refcount(k) == 9 for k in root.block_keys)


def test_resuming_branches_leaves_parent_unchanged_and_reusable():
    eng = make_engine()
    ctx = eng.encode(CONTEXT)
    root = eng.materialize(ctx)
    snapshot = [eng.store.get(k).clone() for k in root.block_keys]
    firsts = [eng.resume(b, eng.encode(s), max_new_tokens=8).tokens for b, s in zip(eng.fork(root, 4), SUFFIXES)]
    for key, before in zip(root.block_keys, snapshot):
        assert torch.equal(eng.store.get(key), before)
    again = [eng.resume(root, eng.encode(s), max_new_tokens=8).tokens for s in SUFFIXES]
    assert again == firsts


def test_release_frees_only_unshared_blocks():
    eng = make_engine()
    root = eng.materialize(CONTEXT)
    a, b = eng.fork(root, 2)
    ga = eng.resume(a, eng.encode(SUFFIXES[0]), max_new_tokens=4)
    assert eng.release(root) == 0 and eng.release(a) == 0  # b and ga still hold the prefix
    freed = eng.release(ga.state)
    assert freed == sum(blk.nbytes for blk in ga.own_blocks)
    assert all(eng.store.has(k) for k in b.block_keys)
    eng.release(b)
    assert eng.store.nbytes == 0 and len(eng.index) == 0


def test_merge_concat_of_a_continuation(engine):
    ctx = engine.encode(CONTEXT)
    root = engine.materialize(ctx)
    cont = engine.resume(engine.fork(root, 1)[0], engine.encode(SUFFIXES[0]), max_new_tokens=6).state
    merged = engine.merge(root, cont, how="concat")
    assert merged.block_keys == cont.block_keys  # nothing recomputed
    assert set(merged.lineage[-1].parents) == {root.state_id, cont.state_id}


def test_merge_text_reduction_is_exact(engine):
    ctx = engine.encode(CONTEXT)
    a, b = engine.fork(engine.materialize(ctx), 2)
    ga = engine.resume(a, engine.encode(SUFFIXES[0]), max_new_tokens=6)
    gb = engine.resume(b, engine.encode(SUFFIXES[1]), max_new_tokens=6)
    merged = engine.merge(ga.state, gb.state, how="auto")  # divergent: b's part is re-prefilled after a
    p = common_prefix_len(ga.state.tokens, gb.state.tokens)
    assert p >= len(ctx)
    b_part = list(gb.state.tokens[p:])
    assert merged.tokens == ga.state.tokens + tuple(b_part)
    assert merged.lineage[-1].as_dict()["how"] == "text"
    judge = engine.encode(" Judge:")
    got = engine.resume(merged, judge, max_new_tokens=8, return_logits=True)
    want = engine.generate_text(list(merged.tokens) + judge, max_new_tokens=8, return_logits=True)
    assert_same_generation(got, want)


def test_merge_refuses_divergent_concat():
    eng = make_engine()
    a, b = eng.fork(eng.materialize(CONTEXT), 2)
    ga = eng.resume(a, eng.encode(SUFFIXES[0]), max_new_tokens=4)
    gb = eng.resume(b, eng.encode(SUFFIXES[1]), max_new_tokens=4)
    with pytest.raises(MergeError, match="differ at position"):
        eng.merge(ga.state, gb.state, how="concat")


def test_merge_refuses_non_contiguous_states():
    """b does not start where a ends: a is longer than b, so b cannot continue it."""
    eng = make_engine()
    ctx = eng.encode(CONTEXT)
    short = eng.materialize(ctx[:10])
    long = eng.materialize(ctx)
    with pytest.raises(MergeError, match="differ at position|not computed on top"):
        eng.merge(long, short, how="concat")


def test_merge_refuses_unrelated_lineage():
    """Same tokens computed by two engines: equal content, but no shared lineage to prove it."""
    e1, e2 = make_engine(), make_engine()
    ctx = e1.encode(CONTEXT)
    a = e1.materialize(ctx[:20])
    b_other = e2.materialize(ctx)
    # Bring b's descriptor into e1 (as a transfer would) with its blocks.
    for blk in b_other.blocks:
        e1.store.put(blk.key, e2.store.get(blk.key), owner=b_other.state_id)
    e1.store.register(b_other)
    with pytest.raises(MergeError, match="lineage"):
        e1.merge(a, b_other, how="concat")
