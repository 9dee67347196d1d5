"""Which cached KV blocks a worker releases when it is over its byte budget. Pure policy.

The mechanism (a block store, the scheduler plugin releasing futures) hands in a snapshot
of its blocks as ``BlockUsage`` rows and gets back an ``EvictionPlan``; nothing here
touches a tensor or a Dask key.

Rules, in order of strength:
1. A pinned block (held by a live state, or needed by a waiting/running task) is never chosen.
   Nor is a block whose owner (its tenant) would drop below its floor on this worker: a
   tenant's quota is guaranteed against every other tenant's tasks (``floors``).
2. Chains are cut from the end: a block is a candidate only once every cached child of it
   is gone (or chosen earlier in the same plan). A prefix without its suffix still serves
   a shorter prompt; a suffix without its prefix serves nobody.
3. A replica (another worker holds the block too) goes before any sole copy: dropping it
   loses nothing the cluster cannot fetch, so one copy of each prefix stays longest. A
   block announced for reuse (``planned``: a later step of a running workflow reads it,
   KVFlow's workflow-aware hint) goes only after every other sole copy: evicting it
   means prefilling it again soon. A hint is soft - under pressure it still goes, so a
   workflow's plans can never deadlock the budget.
4. Among candidates, the lowest keep score goes first (see ``eviction_score``), ties broken
   by deeper ``token_start``, then by key, so a plan is reproducible.
5. Stop as soon as the worker is back within budget: evicting more wastes future reuse.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockUsage:
    key: str  # block key (content address)
    nbytes: int  # bytes the block holds on this worker
    last_access: float  # s, monotonic clock reading of the last read or write
    reuse_count: int = 0  # how many tasks have read it since it was made
    pinned: bool = False  # referenced by a live state or a waiting/running task: never evicted
    parent: str | None = None  # key of the previous block of the chain (None: first block)
    token_start: int = 0  # position of the block's first token: deeper goes first on ties
    owner: str | None = None  # the tenant (namespace) whose block it is; None: nobody's
    planned: bool = False  # a later step of a running workflow will read it: evicted last
    replica: bool = False  # another worker holds it too: evicted first


@dataclass(frozen=True, slots=True)
class EvictionWeights:
    half_life: float = 60.0  # s after which an untouched block's keep score halves
    reuse_weight: float = 1.0  # how much each past reuse raises the keep score
    size_exponent: float = 1.0  # 1: score per byte; 0: ignore size; between: soften it


DEFAULT_WEIGHTS = EvictionWeights()


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    victims: tuple[str, ...]  # keys to release, in order (leaves of a chain before parents)
    freed_bytes: int  # sum of the victims' nbytes
    remaining_bytes: int  # used_bytes - freed_bytes
    over_budget_pinned: bool  # still over budget: all that is left is pinned, under a pinned block or at a floor


def eviction_score(b: BlockUsage, now: float, weights: EvictionWeights = DEFAULT_WEIGHTS) -> float:
    """Keep score, higher = keep: expected future reuse per byte held.

        score = (1 + reuse_weight * reuse_count) * 2 ** (-age / half_life) / nbytes ** size_exponent

    A block read often is likely read again (frequency); one untouched for long is less
    likely to be (recency, decaying by halves); a big block frees more memory per
    eviction, so for equal odds of reuse it is the better one to drop (as in GDSF caches).
    """
    age = max(0.0, now - b.last_access)  # clocks of different hosts can disagree a little
    recency = 2.0 ** (-age / weights.half_life) if weights.half_life > 0 else 0.0
    frequency = 1.0 + weights.reuse_weight * max(0, b.reuse_count)
    return frequency * recency / max(1, b.nbytes) ** weights.size_exponent


def owner_bytes(blocks: Iterable[BlockUsage]) -> dict[str | None, int]:
    """Bytes each owner's listed blocks hold."""
    out: dict[str | None, int] = {}
    for b in blocks:
        out[b.owner] = out.get(b.owner, 0) + b.nbytes
    return out


def choose_victims(blocks: Iterable[BlockUsage], used_bytes: int, budget_bytes: int, now: float,
                   weights: EvictionWeights = DEFAULT_WEIGHTS, floors: Mapping[str, int] | None = None,
                   held: Mapping[str | None, int] | None = None) -> EvictionPlan:
    """The fewest-regret set of unpinned blocks whose release brings ``used_bytes`` to budget.

    ``used_bytes`` may include memory that is not blocks (it is what the worker measures);
    only the listed blocks can be freed. Greedy over a heap of chain leaves: releasing a
    leaf may turn its parent into a leaf, which then competes on score like any other.

    ``floors``: owner -> bytes its blocks keep on this worker (a tenant's quota, against
    other tenants' tasks): a block of that owner goes only if the owner still holds at
    least its floor without it. ``held``: owner -> bytes it holds here now (default: its
    listed blocks).
    """
    by_key: dict[str, BlockUsage] = {}
    for b in blocks:
        if b.key in by_key:
            raise ValueError(f"block {b.key!r} listed twice")
        by_key[b.key] = b
    if used_bytes <= budget_bytes:
        return EvictionPlan((), 0, used_bytes, False)

    children = {k: 0 for k in by_key}  # cached children still present, per block
    for b in by_key.values():
        if b.parent in children and b.parent != b.key:
            children[b.parent] += 1

    def entry(b: BlockUsage) -> tuple[int, float, int, str]:
        tier = 0 if b.replica else (2 if b.planned else 1)
        return (tier, eviction_score(b, now, weights), -b.token_start, b.key)

    floors = floors or {}
    # owner -> bytes it still holds (only floors read it)
    left = {} if not floors else dict(owner_bytes(by_key.values()) if held is None else held)

    def above_floor(b: BlockUsage) -> bool:
        return b.owner not in floors or left.get(b.owner, 0) - b.nbytes >= floors[b.owner]

    heap = [entry(b) for b in by_key.values() if not b.pinned and children[b.key] == 0]
    heapq.heapify(heap)
    victims: list[str] = []
    freed = 0
    while heap and used_bytes - freed > budget_bytes:
        *_, key = heapq.heappop(heap)
        b = by_key[key]
        if not above_floor(b):  # its owner holds no more than its floor: it only shrinks, so never in this plan
            continue
        victims.append(key)
        freed += b.nbytes
        left[b.owner] = left.get(b.owner, 0) - b.nbytes
        if b.parent in children and b.parent != key:
            children[b.parent] -= 1
            parent = by_key[b.parent]
            if children[b.parent] == 0 and not parent.pinned:
                heapq.heappush(heap, entry(parent))  # its last child went: it is a leaf now
    remaining = used_bytes - freed
    return EvictionPlan(tuple(victims), freed, remaining, remaining > budget_bytes)


def evictable_bytes(blocks: Iterable[BlockUsage]) -> int:
    """Bytes an unbounded plan could free: every block not pinned and not above a pinned one."""
    rows = list(blocks)
    return choose_victims(rows, sum(b.nbytes for b in rows) + 1, 0, 0.0).freed_bytes
