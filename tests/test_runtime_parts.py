"""The runtime's parts on plain data, without a cluster: what each one promises its callers.

The cluster tests (test_runtime_dask.py, ...) run them together; these pin down the small
contracts between them, and that no module reaches into another module's private methods.
"""

import ast
from pathlib import Path

import pytest

from daskflow_kv.policy.cluster_view import CachedBlock, PrefixMatch
from daskflow_kv.policy.placement import Placement
from daskflow_kv.runtime import tasks
from daskflow_kv.runtime.delegate import Delegate
from daskflow_kv.runtime.prefix_cache import HeldPrefix
from daskflow_kv.runtime.publish import BlockSource, blocks_of
from daskflow_kv.runtime.resume_planner import Branch, batch_groups
from daskflow_kv.runtime.submit import Submitter

ROOT = Path(__file__).resolve().parent.parent
A, B = "tcp://a:1", "tcp://b:1"


def _held(n_blocks=3, partial=0):
    blocks = [CachedBlock(f"k{i}", 4 * i, 4 * (i + 1), 40, (A,), (A,)) for i in range(n_blocks)]
    if partial:
        blocks.append(CachedBlock("tail", 4 * n_blocks, 4 * n_blocks + partial, 10 * partial, (A,), (A,)))
    match = PrefixMatch(blocks[-1].end, tuple(blocks))
    return HeldPrefix(match, {b.key: f"future-{b.key}" for b in blocks}, list(range(100, 100 + match.tokens + 3)))


def test_held_prefix_keeps_whole_blocks_with_the_requests_tokens():
    held = _held(partial=2)
    kept = held.kept(8)
    assert [(r.key, r.start, r.token_ids, r.nbytes) for r, _ in kept] == [
        ("k0", 0, (100, 101, 102, 103), 40), ("k1", 4, (104, 105, 106, 107), 40)]
    assert [f for _, f in kept] == ["future-k0", "future-k1"]
    assert len(held.kept(14)) == 4 and held.futures_of(held.blocks[1:2]) == ["future-k1"]


def test_held_prefix_extended_with_loaded_blocks():
    held = _held(n_blocks=3)
    loaded = CachedBlock("s2", 8, 12, 40, (), (B,)), CachedBlock("s3", 12, 16, 40, (), (B,))
    more = held.extended(2, [(loaded[0], "f-s2"), (loaded[1], "f-s3")])
    assert more.tokens == 16 and [b.key for b in more.blocks] == ["k0", "k1", "s2", "s3"]
    assert dict(more.futures) == {"k0": "future-k0", "k1": "future-k1", "s2": "f-s2", "s3": "f-s3"}
    assert more.request == held.request and held.tokens == 12  # the original is unchanged


def test_block_sources_name_the_task_that_cuts_each_block():
    assert blocks_of("out", 2, A) == [BlockSource("out", 0, A), BlockSource("out", 1, A)]
    assert BlockSource("out", 1, A).task() == (tasks.take_block, "out", 1)
    assert BlockSource("block", 3, A, cut=True).task() == (tasks.cut_block, "block", 3)


def test_branches_batch_by_prefix_worker_reuse_and_action():
    one, other = _held(), _held()
    p = lambda w, r=8: Placement(w, r, None)  # noqa: E731
    branches = [Branch(one, p(A)), Branch(one, p(B)), Branch(one, p(A)), Branch(other, p(A)),
                Branch(one, p(A, 4)), Branch(one, p(None))]
    assert batch_groups(branches, True) == [[0, 2], [1], [3], [4], [5]]
    assert batch_groups(branches, False) == [[0], [1], [2], [3], [4], [5]]


def test_out_bytes_count_from_the_aligned_floor_to_the_end_of_generation():
    spec = tasks.ModelSpec("tiny-llama", "float32", 16, "default", "cpu")
    sub = Submitter(object(), spec, bytes_per_token=10)
    req = tasks.PrefillRequest(tuple(range(40)), 20, max_new_tokens=8)
    assert sub.out_bytes(req) == (40 + 8 - 16) * 10
    batch = tasks.BatchPrefillRequest((req, req), 20, "resume", "b")
    assert sub.out_bytes(batch) == 2 * (40 + 8 - 16) * 10


class _Part:
    __slots__ = ("value", "inner")

    def __init__(self):
        self.value, self.inner = 1, None


class _Facade:
    __slots__ = ("part",)
    value = Delegate("part.value")
    settable = Delegate("part.value", settable=True)
    nested = Delegate("part.inner.value")

    def __init__(self):
        self.part = _Part()
        self.part.inner = _Part()


def test_delegates_read_and_set_the_parts_own_attribute():
    f = _Facade()
    assert f.value == 1 and f.nested == 1
    f.settable = 5
    assert f.part.value == 5 and f.value == 5
    with pytest.raises(AttributeError, match="read-only"):
        f.value = 3
    assert isinstance(_Facade.value, Delegate)


def _private_calls(path: Path) -> list[str]:
    """Calls of another object's private method (``x._name(...)``), and imports of private names."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, node.func.value
            if not name.startswith("_") or name.startswith("__"):
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                continue
            out.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
        elif isinstance(node, ast.ImportFrom):
            out += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


# Known exceptions (none left: a helper another module uses is public).
KNOWN: set[str] = set()


@pytest.mark.parametrize("folder", ["daskflow_kv/runtime", "daskflow_kv/policy"])
def test_no_module_calls_another_modules_private_methods(folder):
    found = [hit for path in sorted((ROOT / folder).glob("*.py")) for hit in _private_calls(path)]
    assert [h for h in found if h.split(":")[0] + " " + h.split(" ", 1)[1] not in KNOWN] == []


def test_a_batch_is_cut_to_what_one_task_may_take_under_the_budget():
    from daskflow_kv.runtime.resume_planner import split_by_bytes

    sizes = {0: 40, 1: 40, 2: 40, 3: 100, 4: 10}
    assert split_by_bytes([[0, 1, 2], [3, 4]], sizes.get, None) == [[0, 1, 2], [3, 4]]
    assert split_by_bytes([[0, 1, 2], [3, 4]], sizes.get, 80) == [[0, 1], [2], [3], [4]]  # 100 alone: never cut
