"""Pure block arithmetic and prefix lookup: no model, no tensors."""

import pytest

from daskflow_kv.keys import content_key, is_block, namespace_tag, rebuilt_key, tag_of
from daskflow_kv.state.blocks import BlockRef, aligned_floor, block_key, chain_keys, reusable_prefix, split_spans
from daskflow_kv.state.prefix_index import PrefixIndex

FP = "fingerprint-a"


def _index(tokens, block_size, fp=FP):
    idx = PrefixIndex()
    parent = None
    for key, s, e in chain_keys(fp, tokens, block_size):
        idx.add(BlockRef(key, s, tuple(tokens[s:e]), 0), parent, fp)
        parent = key
    return idx


def test_equal_prefixes_give_equal_keys_and_divergence_changes_all_later_keys():
    a = list(range(40))
    b = list(range(20)) + [99] + list(range(21, 40))
    ka, kb = chain_keys(FP, a, 8), chain_keys(FP, b, 8)
    assert ka[:2] == kb[:2]
    assert all(x[0] != y[0] for x, y in zip(ka[2:], kb[2:]))  # chained: block 2 differs, so do 3, 4


def test_keys_depend_on_fingerprint_and_partial_blocks_differ_from_full():
    assert block_key("m1", None, [1, 2]) != block_key("m2", None, [1, 2])
    assert block_key(FP, None, [1, 2, 3]) != block_key(FP, None, [1, 2])


def test_spans_are_aligned():
    assert split_spans(16, 45, 16) == [(16, 32), (32, 45)]
    assert aligned_floor(45, 16) == 32
    with pytest.raises(ValueError):
        split_spans(5, 20, 16)


def test_longest_prefix_full_blocks_then_token_level_tail():
    cached = list(range(100, 150))  # 50 tokens: 3 full blocks of 16 + a partial of 2
    idx = _index(cached, 16)
    req = cached[:40] + [7, 7, 7]
    m = idx.longest_prefix(FP, req, 16)
    assert m.tokens == 40 and len(m.blocks) == 3 and m.blocks[-1].start == 32


def test_longest_prefix_other_fingerprint_matches_nothing():
    idx = _index(list(range(50)), 16)
    assert idx.longest_prefix("other", list(range(50)), 16).tokens == 0


def test_longest_prefix_picks_the_best_sibling():
    idx = _index([1] * 16 + [2, 3, 4], 16)
    parent = chain_keys(FP, [1] * 16, 16)[0][0]
    sib = [1] * 16 + [2, 3, 9, 9, 9]
    key = block_key(FP, parent, sib[16:])
    idx.add(BlockRef(key, 16, tuple(sib[16:]), 0), parent, FP)
    assert idx.longest_prefix(FP, [1] * 16 + [2, 3, 9, 5], 16).tokens == 19


def test_remove_forgets_blocks():
    tokens = list(range(32))
    idx = _index(tokens, 16)
    for key, _, _ in chain_keys(FP, tokens, 16):
        idx.remove(key)
    assert len(idx) == 0 and idx.longest_prefix(FP, tokens, 16).tokens == 0


def test_a_rebuilt_key_names_the_same_content_and_the_same_namespace():
    content = block_key(FP, None, [1, 2, 3], namespace="alice")
    again = rebuilt_key(content)
    assert again != content and again != rebuilt_key(content) and is_block(again)
    assert content_key(again) == content_key(rebuilt_key(again)) == content_key(content) == content
    assert tag_of(again) == tag_of(content) == namespace_tag("alice")
    untagged = block_key(FP, None, [1, 2, 3])
    assert content_key(rebuilt_key(untagged)) == untagged and tag_of(rebuilt_key(untagged)) is None


def test_a_rebuilt_block_takes_its_contents_place_and_the_old_key_cannot_remove_it():
    tokens = list(range(40))
    idx = _index(tokens, 16)
    (k0, _, _), (k1, s1, e1), (k2, _, _) = chain_keys(FP, tokens, 16)
    new = rebuilt_key(k1)
    idx.add(BlockRef(new, s1, tuple(tokens[s1:e1]), 0), k0, FP)  # its parent is named by content
    m = idx.longest_prefix(FP, tokens, 16)
    assert m.keys == (k0, new, k2) and m.tokens == 40  # the chain walks on through the content
    assert k1 not in idx and new in idx and idx.current(k1) == new and len(idx) == 3
    idx.remove(k1)  # Dask forgets the old key later: the rebuilt one stays
    assert idx.longest_prefix(FP, tokens, 16).keys == (k0, new, k2)
    idx.remove(new)
    assert idx.longest_prefix(FP, tokens, 16).tokens == 16 and idx.current(k1) is None


def test_reusable_prefix_keeps_whole_blocks_only_when_aligned():
    assert [reusable_prefix(n, 16, aligned=False) for n in (0, 15, 16, 40)] == [0, 15, 16, 40]
    assert [reusable_prefix(n, 16, aligned=True) for n in (0, 15, 16, 40)] == [0, 0, 16, 32]
