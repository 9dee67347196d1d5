"""The scheduler plugin's catalog as plain data: lifecycle, prefix index, pruning, Arrow export."""

from daskflow_kv.keys import rebuilt_key
from daskflow_kv.state.blocks import chain_keys
from daskflow_kv.state.catalog import ARROW_COLUMNS, KVCatalog, rows_to_arrow

FP = "fp0"


def _publish(cat: KVCatalog, tokens, state_id="s1", block_size=4):
    keys = []
    parent = None
    for key, s, e in chain_keys(FP, tokens, block_size):
        cat.add_block({"key": key, "start": s, "end": e, "nbytes": 10 * (e - s), "tokens": tokens[s:e],
                       "parent": parent, "fingerprint": FP, "state_id": state_id})
        keys.append(key)
        parent = key
    cat.add_state({"state_id": state_id, "block_keys": keys, "op": "materialize", "parents": [], "tokens": len(tokens)})
    return keys


def _lookup(cat, tokens, block_size=4, namespace=None):
    """As the plugin is asked: the request's own chain keys (full blocks) and its tokens."""
    full = len(tokens) - len(tokens) % block_size
    keys = [k for k, _, _ in chain_keys(FP, tokens[:full], block_size)]
    return cat.lookup(FP, keys, tokens, block_size, namespace)


def test_an_eviction_made_good_under_a_rebuilt_key_is_regretted_not_a_lineage_recompute():
    cat = KVCatalog()
    tokens = list(range(8))
    first, second = _publish(cat, tokens)
    for k in (first, second):
        cat.entered_memory(k)
    cat.set_status(second, "evicted")
    again = rebuilt_key(second)
    cat.add_block({"key": again, "start": 4, "end": 8, "nbytes": 40, "tokens": tokens[4:], "parent": first,
                   "fingerprint": FP, "state_id": "s2"})
    assert cat.entered_memory(again) is False  # its first run: planned, not Dask's rerun
    assert cat.counters["evictions_regretted"] == 1 and cat.counters["lineage_recomputes"] == 0
    assert _lookup(cat, tokens).keys == (first, again) and cat.current_key(second) == again
    cat.forget(second)  # Dask drops the old key's lineage later: the rebuilt block stays found
    assert _lookup(cat, tokens).keys == (first, again)


def test_lifecycle_counts_lineage_recomputes_and_keeps_history_while_listed():
    cat = KVCatalog()
    tokens = list(range(10))
    keys = _publish(cat, tokens)
    assert _lookup(cat, tokens + [99]).tokens == 10  # pending blocks are found too
    for k in keys:
        assert cat.entered_memory(k) is False
    cat.set_status(keys[-1], "lost")
    assert cat.entered_memory(keys[-1]) is True  # second time in memory: a recompute
    assert cat.blocks[keys[-1]].recomputes == 1 and cat.counters["lineage_recomputes"] == 1
    cat.forget(keys[-1])  # a live state lists it: the entry stays, the index forgets it
    assert keys[-1] in cat.blocks and cat.blocks[keys[-1]].status == "forgotten"
    assert _lookup(cat, tokens).tokens == 8
    cat.release_state("s1")
    assert keys[-1] not in cat.blocks  # nobody lists it any more: gone
    for k in keys[:-1]:
        cat.forget(k)
    assert not cat.blocks and cat.prune() == 1 and not cat.states


def test_rows_and_arrow_table():
    cat = KVCatalog()
    keys = _publish(cat, list(range(6)))
    cat.add_state({"state_id": "f1", "block_keys": keys, "op": "fork", "parents": ["s1"], "tokens": 6})
    cat.touch(keys[0])
    rows = cat.rows({keys[0]: ["tcp://a"]}, {keys[0]: 2}, {keys[0]})
    assert len(rows) == 4  # (s1, f1) x 2 blocks
    tbl = rows_to_arrow(rows)
    assert tbl.column_names == [c for c, _ in ARROW_COLUMNS] and tbl.num_rows == 4
    first = [r for r in tbl.to_pylist() if r["state_id"] == "f1"][0]
    assert (first["state_op"], first["state_parents"], first["workers"], first["refcount"]) == ("fork", "s1", "tcp://a", 2)
    assert first["cached"] and first["reuse_count"] == 1 and (first["token_start"], first["token_end"]) == (0, 4)


def test_lookups_see_only_their_namespace():
    cat = KVCatalog()
    tokens = list(range(12))
    for key, s, e in chain_keys(FP, tokens, 4):
        cat.add_block({"key": key, "start": s, "end": e, "nbytes": 1, "tokens": tokens[s:e], "parent": None if s == 0
                       else chain_keys(FP, tokens, 4)[s // 4 - 1][0], "fingerprint": FP}, namespace="alice")
    assert _lookup(cat, tokens, namespace="alice").tokens == 12
    assert _lookup(cat, tokens, namespace="bob").tokens == 0
    assert _lookup(cat, tokens).tokens == 12  # an admin (no namespace filter)
    assert {r["namespace"] for r in cat.rows({}, {}, set(), "alice")} == {"alice"}
    assert cat.rows({}, {}, set(), "bob") == []


def test_released_history_is_bounded_while_a_shared_context_stays_cached(monkeypatch):
    import daskflow_kv.state.catalog as catalog

    monkeypatch.setattr(catalog, "MAX_RELEASED_STATES", 3)
    cat = KVCatalog()
    keys = _publish(cat, list(range(8)), state_id="doc")  # the shared context, cached throughout
    for i in range(6):  # a workflow's state over it, released when the workflow ends
        cat.add_state({"state_id": f"wf{i}", "block_keys": keys, "op": "fork", "parents": ["doc"], "tokens": 8})
        cat.release_state(f"wf{i}")
    assert cat.prune() == 3
    assert list(cat.states) == ["doc", "wf3", "wf4", "wf5"]  # the live one and the newest history
    assert all(k in cat.blocks for k in keys)


def test_one_namespaces_history_does_not_push_out_anothers(monkeypatch):
    import daskflow_kv.state.catalog as catalog

    monkeypatch.setattr(catalog, "MAX_RELEASED_STATES", 2)
    cat = KVCatalog()
    keys = _publish(cat, list(range(8)), state_id="doc")
    cat.add_state({"state_id": "quiet", "block_keys": keys, "op": "fork", "parents": ["doc"], "tokens": 8}, "q")
    cat.release_state("quiet")
    for i in range(5):
        cat.add_state({"state_id": f"busy{i}", "block_keys": keys, "op": "fork", "parents": ["doc"], "tokens": 8},
                      "b")
        cat.release_state(f"busy{i}")
    assert cat.prune() == 3
    assert set(cat.states) == {"doc", "quiet", "busy3", "busy4"}
