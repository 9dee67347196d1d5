"""KV blocks of modeled prompts, and what each modeled worker holds of them.

``chain``: the content-addressed blocks covering a prompt's first tokens, as the runtime
keys them (``keys``: hash of the parent block and the block's tokens): here a block's key
names the segment keys it covers and where it ends, so two prompts that share leading
segments share those blocks. Blocks also end where a segment ends, so a prefix shared up
to a segment boundary inside a 64-token block is matched to that boundary, as the
runtime's lookups match a cached block's tokens one by one past the last whole block.

``Ledger``: a daskflow-kv worker's share of the shared tier - its blocks with the fields
``policy.eviction.BlockUsage`` scores (last access, reuse count, pins, parent), the bytes it
holds and the bytes promised to admitted tasks. ``Directory``: block -> workers holding it
(the scheduler plugin's catalog / ``who_has``).

``LRUCache``: a ``local`` worker's engine cache (``bench.local_engine.LocalCache``): states
kept least recently used first out past ``retain_bytes``; a prompt reuses the longest
cached block prefix. Modeled here because the real one lives in the bench, on tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


BLOCK = 64  # tokens per KV block (the runtime's block_size)
_KEYS: dict[tuple, str] = {}  # content identity -> short block key
_CHAINS: dict[tuple, tuple] = {}  # (segments, tokens) -> chain


def _key(ident: tuple) -> str:
    k = _KEYS.get(ident)
    if k is None:
        k = _KEYS[ident] = f"b{len(_KEYS)}"
    return k


def chain(segments: tuple, tokens: int) -> tuple[tuple[str, int, int], ...]:
    """(key, start, end) of the blocks covering the first ``tokens`` tokens of ``segments``."""
    memo = (segments, tokens)
    hit = _CHAINS.get(memo)
    if hit is not None:
        return hit
    # Block ends: every BLOCK tokens, and every segment boundary. A lookup matches whole blocks by
    # key, then the next cached block token by token (``PrefixIndex.match``; the scheduler's
    # catalog the same way): two prompts share exactly the tokens of their common leading
    # segments, also when that run ends inside a block (a document's 29-token tail before each
    # workflow's own text). Here content is known per segment, so a block is cut where a
    # segment ends: its key names the content up to there, and a match stops there.
    cuts, pos = set(range(BLOCK, tokens, BLOCK)), 0
    for _, n in segments:
        pos += n
        if 0 < pos < tokens:
            cuts.add(pos)
    cuts.add(tokens)
    out, keys, seg_end, i, start = [], [], 0, 0, 0
    for end in sorted(c for c in cuts if c > 0):
        while seg_end < end and i < len(segments):  # segments this block touches
            keys.append(segments[i][0])
            seg_end += segments[i][1]
            i += 1
        out.append((_key((tuple(keys), end)), start, end))
        start = end
    _CHAINS[memo] = res = tuple(out)
    return res


def common_prefix(prompts: list[tuple]) -> int:
    """Tokens of the longest run of leading segments every prompt shares, as the compiler's
    ``group_by_prefix`` takes a group's prefix: the whole common prefix, not cut to blocks,
    less one token of the shortest prompt (every member feeds at least one token of its own:
    decoding needs its last token's logits)."""
    first, n = prompts[0], 0
    for i, (k, t) in enumerate(first):
        if any(len(p) <= i or p[i][0] != k for p in prompts[1:]):
            break
        n += t
    shortest = min(sum(t for _, t in p) for p in prompts)
    return max(0, min(n, shortest - 1))


@dataclass(slots=True)
class Held:
    """One block on one daskflow-kv worker. It carries ``policy.eviction.BlockUsage``'s fields,
    so a ledger hands its blocks to the eviction policy as they are: a ``BlockUsage`` made per
    block per admission was a sixth of a 512-worker run."""

    key: str  # its block key
    nbytes: int  # its K/V bytes
    parent: str | None  # previous block of its chain
    token_start: int  # first token position
    last_access: float  # virtual s of the last read or write
    reuse_count: int = 0  # reads since it was made here
    pins: int = 0  # admitted tasks on this worker that read or make it (never evicted while > 0)
    planned: bool = False  # a later level of a running workflow reads it (KVFlow's hint)
    owner = None  # no tenants in the simulation
    replica = False  # replicas are not told apart here

    @property
    def pinned(self) -> bool:
        return self.pins > 0


class Directory:
    """Block key -> the workers holding it."""

    __slots__ = ("where",)

    def __init__(self):
        self.where: dict[str, set[int]] = {}  # key -> holders

    def add(self, key: str, w: int) -> None:
        self.where.setdefault(key, set()).add(w)

    def drop(self, key: str, w: int) -> None:
        s = self.where.get(key)
        if s is not None:
            s.discard(w)
            if not s:
                del self.where[key]

    def holders(self, key: str) -> set[int]:
        return self.where.get(key) or set()


class Ledger:
    """A daskflow-kv worker's KV: cached blocks plus bytes promised to admitted tasks."""

    __slots__ = ("blocks", "held", "reserved", "peak")

    def __init__(self):
        self.blocks: dict[str, Held] = {}  # key -> the block here
        self.held = 0  # bytes of blocks here
        self.reserved = 0  # bytes admitted tasks will add and have not yet
        self.peak = 0  # max of held + reserved seen

    def note_peak(self) -> None:
        self.peak = max(self.peak, self.held + self.reserved)

    def usage(self):
        """Rows for ``policy.eviction``: the blocks themselves (``Held`` has ``BlockUsage``'s fields)."""
        return self.blocks.values()


class LRUCache:
    """A ``local`` engine's cache: states (block chains) kept LRU under ``retain_bytes``."""

    __slots__ = ("states", "refs", "nbytes", "retain", "evicted", "peak")

    def __init__(self, retain: int):
        self.states: OrderedDict[str, tuple] = OrderedDict()  # state id -> ((key, nbytes), ...)
        self.refs: dict[str, list] = {}  # block key -> [kept states holding it, nbytes]
        self.nbytes = 0  # bytes of distinct blocks kept
        self.retain = retain  # evict past this many bytes
        self.evicted = 0  # states dropped for the budget
        self.peak = 0  # most bytes kept at once

    def cached(self, blocks) -> int:
        """Leading tokens of ``blocks`` ((key, start, end) rows) this engine holds."""
        n = 0
        for k, _, end in blocks:
            if k not in self.refs:
                break
            n = end
        return n

    def keep(self, sid: str, rows) -> None:
        """Keep state ``sid`` (its (key, nbytes) rows), most recent; then evict LRU states."""
        if sid in self.states:
            self.states.move_to_end(sid)
        else:
            self.states[sid] = rows
            for k, nb in rows:
                r = self.refs.get(k)
                if r is None:
                    self.refs[k] = [1, nb]
                    self.nbytes += nb
                else:
                    r[0] += 1
        self.peak = max(self.peak, self.nbytes)
        while len(self.states) > 1 and self.nbytes > self.retain:
            _, old = self.states.popitem(last=False)
            self.evicted += 1
            for k, _ in old:
                r = self.refs[k]
                r[0] -= 1
                if r[0] == 0:
                    del self.refs[k]
                    self.nbytes -= r[1]
