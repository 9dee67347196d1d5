"""Where each KV consumer runs, and how its prefix gets there: earliest finish time. Pure.

Under load the rule prices compute, not only time (Preble's E2, with a move): when every
worker in the pool has work queued, a destination that lacks the prefix fetches it
whenever fetching is cheaper than prefilling (``cost_model.decide``'s ``loaded``), so the
less loaded worker takes the branch *and* the prefix moves to it - a rebuild would spend
compute other requests are queued for. With spare workers, rebuilding on an idle one may
still win on time.

For every branch the planner estimates, on each candidate worker, when the branch would
finish: when the worker is free (the KV work already queued there), when its prefix can
be there - already there, fetched after the source has made it, or prefilled on the
worker itself from the part of it the worker already holds (partial recompute) - and how
long the branch's own suffix prefill and decode take, batched with the branches already
placed there. It picks the earliest finish (ties: the worker that already holds the
blocks - no bytes moved, no extra memory - then the pool's order). Parallel recompute on
idle workers, transfer to busy ones and pinning to the holder are all outcomes of that
one rule, not special cases. Each destination pays for its prefix once: all its branches
share one ``Decision`` and the first branch placed there (``first``) carries it.

Its inputs are the frozen dataclasses of ``cluster_view``: a ``PrefixMatch`` (the plugin's
lookup answer) and a ``ClusterView`` (its snapshot).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from .cluster_view import CachedBlock, ClusterView, PrefixMatch, WorkerLoad
from .cost_model import Decision, NeedsCalibration, PrefillProfile, decide

POLICIES = ("auto", "transfer", "recompute", "pin")
TIE = 0.10  # finish times this close (relative) count as equal: see _pick


@dataclass(slots=True)
class Placement:
    worker: str | None  # where the consumer runs (None: let Dask choose)
    reused: int  # prefix tokens the consumer reads from blocks instead of prefilling
    decision: Decision | None  # how the prefix reaches ``worker`` (None: nothing cached)
    recompute_tokens: int = 0  # >0 on the first branch of a "recompute" worker: prefix tokens rebuilt there
    first: bool = False  # the first branch placed on ``worker``: it pays the transfer or recompute
    held_tokens: int = 0  # leading prefix tokens ``worker`` already holds (a recompute starts there)
    finish_s: float = 0.0  # predicted seconds from now until this branch's batch finishes on ``worker``
    candidates: dict[str, float] = field(default_factory=dict)  # worker -> predicted finish, when it was placed

    @property
    def action(self) -> str:
        return "none" if self.decision is None else self.decision.action

    @property
    def rebuilt_tokens(self) -> int:
        """Prefix tokens a recompute actually prefills here: from where ``worker``'s own
        leading blocks end (``held_tokens``) up to ``recompute_tokens``, not the whole prefix."""
        return max(0, self.recompute_tokens - self.held_tokens) if self.recompute_tokens else 0

    def decision_dict(self) -> dict | None:
        return None if self.decision is None else asdict(self.decision)


def _ready_on(block: CachedBlock, worker: str, view: ClusterView) -> float:
    """Seconds until ``block`` exists on ``worker`` (0 when cached there; else when its prefill ends)."""
    return 0.0 if worker in block.who_has else view.busy(worker)


def holder_of(blocks: Iterable[CachedBlock], busy: Callable[[str], float] | None = None) -> str | None:
    """The worker holding (or about to hold) the most bytes of ``blocks``; ties: the least
    ``busy`` (seconds queued), then the name.

    Why load before name: once a hot prefix has replicas, every holder ties on bytes, and a
    name order sends every materialize (and every transfer's source) to the same replica -
    measured as one worker carrying 65 % of a 2-worker stream's prefill, and most of a
    128-worker simulation's work on the lexically first workers (w0, w1, w10, w100...).
    """
    held: dict[str, int] = {}
    for b in blocks:
        for w in b.where:
            held[w] = held.get(w, 0) + b.nbytes
    if not held:
        return None
    load = busy or (lambda w: 0.0)
    return min(held, key=lambda w: (-held[w], load(w), w))


def read_blocks(match: PrefixMatch, reused: int) -> list[CachedBlock]:
    """The blocks a consumer that reuses ``reused`` tokens depends on."""
    return [b for b in match.blocks if b.start < reused]


def held_prefix(match: PrefixMatch, reused: int, worker: str) -> int:
    """Leading tokens of the first ``reused`` that ``worker`` already holds, block by block."""
    held = 0
    for b in read_blocks(match, reused):
        if worker not in b.where:
            break
        held = min(b.end, reused)
    return held


def prefix_decision(view: ClusterView, match: PrefixMatch, reused: int, dst: str | None,
                    forced: str | None = None, loaded: bool = False, sources: dict | None = None) -> Decision | None:
    """How ``dst`` gets the blocks covering ``reused`` tokens; None when nothing is read.

    Only the blocks ``dst`` lacks count: a transfer fetches them from the worker holding the
    most of them, a recompute prefills from where ``dst``'s own leading blocks end.
    ``sources``: a plan's memo of that holder per set of missing blocks (every worker that
    holds none of them asks the same question).
    """
    reads = read_blocks(match, reused)
    if not reads or dst is None:
        return None
    held = held_prefix(match, reused, dst)
    missing = [b for b in reads if dst not in b.where]
    if not missing:  # everything is (or will be) on dst already: it starts when its queue is done
        ready = max(_ready_on(b, dst, view) for b in reads)
        return decide(0, 0, reused, dst, dst, None, None, view.memory_weight, src_ready=ready,
                      dst_wait=view.busy(dst))
    memo = None if sources is None else tuple(b.key for b in missing)
    found = None if memo is None else sources.get(memo)
    if found is None:
        src = holder_of(missing, view.busy)
        found = src, sum(b.nbytes for b in missing), src and max(_ready_on(b, src, view) for b in missing)
        if memo is not None:
            sources[memo] = found
    src, nbytes, src_ready = found
    if src is None:  # being recomputed somewhere Dask has not chosen yet: let Dask place it
        return None
    return decide(nbytes, reused - held, held, src, dst, view.link(src, dst), view.profile(dst),
                  view.memory_weight, forced, src_ready=src_ready, dst_wait=view.busy(dst), loaded=loaded)


def batch_seconds(profile: PrefillProfile, reused: int, suffixes: list[int], max_new: int) -> float:
    """Suffix prefill and decode of branches batched over one prefix of ``reused`` tokens.

    One forward feeds every suffix (their tokens attend to the prefix and half their own
    length on average), then ``max_new - 1`` steps each feed one token per branch: a step
    costs what a prefill of ``len(suffixes)`` tokens over the grown context costs.
    """
    if not suffixes:
        return 0.0
    t = profile.seconds(sum(suffixes), reused)
    steps = max(0, max_new - 1)
    if steps:
        ctx = reused + max(suffixes) + steps / 2
        t += steps * profile.seconds(len(suffixes), int(ctx))
    return t


def materialize_policy(view: ClusterView, cached: int, missing: int) -> str:
    """Where a prefill of ``missing`` tokens after ``cached`` cached ones runs: Preble's E2.

    Exploit (``pin``: on the worker holding the cached part) when the cached share is at
    least the part still to prefill; otherwise explore by earliest finish (``auto``: the
    least loaded worker, the short cached part moved there or rebuilt, whichever is cheaper).
    Why: pinning on *any* cached prefix sent every new document's prefill to the worker
    holding a 36-token system line (exp 7: one worker queued 30-60 s of prefill while the
    other idled). Before the cluster is calibrated nothing can be priced: pin.
    """
    if cached >= missing or not view.prefill or len(view.workers) < 2:
        return "pin"
    return "auto"


def plan_placements(
    view: ClusterView,
    match: PrefixMatch,
    reused: list[int],
    n: int,
    policy: str = "auto",
    worker: str | None = None,
    workers: list[str] | None = None,
    new_tokens: list[int] | None = None,
    max_new_tokens: int = 1,
) -> list[Placement]:
    """One placement per branch. ``reused[i]``: prefix tokens branch i can take from blocks;
    ``new_tokens[i]``: tokens it prefills itself (default 1); ``max_new_tokens``: its decode.

    policy: auto (earliest finish time, the cost model choosing each destination's
    transfer or recompute) | transfer | recompute (forced for every destination that lacks
    blocks; branches still spread by finish time) | pin (every branch where the blocks are).
    ``worker`` puts every branch on one worker; ``workers`` limits the pool.
    Raises NeedsCalibration when auto needs a measurement nobody has taken yet.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown state policy {policy!r}; expected one of {POLICIES}")
    if len(reused) != n:
        raise ValueError(f"{n} branches but {len(reused)} reuse counts")
    new_tokens = [1] * n if new_tokens is None else list(new_tokens)
    if len(new_tokens) != n:
        raise ValueError(f"{n} branches but {len(new_tokens)} new-token counts")
    holder = holder_of(match.blocks, view.busy)
    pool = [w for w in (workers or sorted(view.workers)) if w in view.workers] or sorted(view.workers)
    forced = policy if policy in ("transfer", "recompute") else None
    if worker is not None or policy == "pin" or not pool:
        target = worker if worker is not None else (holder if holder in view.workers else _least_busy(view, pool))
        return _fixed(view, match, reused, [target] * n, forced)
    return _earliest_finish(view, match, reused, new_tokens, max_new_tokens, pool, holder, forced)


def _fixed(view, match, reused, targets, forced) -> list[Placement]:
    """Every branch where it was told to go; one decision per destination."""
    need: dict[str | None, int] = {}
    for dst, r in zip(targets, reused):
        need[dst] = max(need.get(dst, 0), r)
    decisions = {dst: prefix_decision(view, match, r, dst, forced) for dst, r in need.items()}
    out, seen = [], set()
    for dst, r in zip(targets, reused):
        d, first = decisions[dst], dst not in seen
        seen.add(dst)
        rebuild = need[dst] if (first and d is not None and d.action == "recompute") else 0
        held = held_prefix(match, need[dst], dst) if dst else 0
        out.append(Placement(dst, r, d, rebuild, first, held))
    return out


@dataclass(slots=True)
class _Dest:
    """A destination while branches are being placed on it."""

    decision: Decision | None  # how its prefix gets there
    start: float  # when its batch can start (its queue done and its prefix there)
    reused: int  # prefix tokens its branches read
    branches: list[int] = field(default_factory=list)  # indices placed there
    suffixes: list[int] = field(default_factory=list)  # their own tokens


def _earliest_finish(view, match, reused, new_tokens, max_new, pool, holder, forced) -> list[Placement]:
    profiles = {w: view.profile(w) for w in pool}
    if any(p is None for p in profiles.values()) and (len(reused) > 1 or len(pool) > 1):
        raise NeedsCalibration("cannot estimate finish times: measure the prefill profile on every worker")
    order = sorted(pool, key=lambda w: (w != holder, pool.index(w)))  # ties: the holder, then pool order
    loaded = view.loaded(pool)  # no spare compute: a rebuild is priced as the work it takes from others
    seen: dict[tuple[str, int], Decision | None] = {}  # (worker, reused) -> its decision: one per plan
    sources: dict = {}  # missing blocks -> where they would come from (prefix_decision's memo)
    dests: dict[str, _Dest] = {}
    placed: list[tuple[str, dict[str, float]]] = []
    for i, (r, s) in enumerate(zip(reused, new_tokens)):
        options = {}
        for w in order:
            d = dests.get(w) or _open(view, match, r, w, forced, loaded, seen, sources)
            if d is None:
                continue
            prof = profiles[w] or PrefillProfile(0.0, 0.0, 0.0)
            finish = d.start + batch_seconds(prof, max(d.reused, r), d.suffixes + [s], max_new)
            options[w] = (finish, d)
        if not options:
            raise NeedsCalibration("no destination can be costed: measure link bandwidth and prefill profiles")
        best = _pick(options, order, dests)
        finish, d = options[best]
        d.branches.append(i)
        d.suffixes.append(s)
        d.reused = max(d.reused, r)
        dests[best] = d
        placed.append((best, {w: f for w, (f, _) in options.items()}))

    finishes = {w: d.start + batch_seconds(profiles[w] or PrefillProfile(0.0, 0.0, 0.0), d.reused, d.suffixes,
                                           max_new) for w, d in dests.items()}
    out, seen = [], set()
    for (w, cands), r in zip(placed, reused):
        d = dests[w]
        first = w not in seen
        seen.add(w)
        rebuild = d.reused if (first and d.decision is not None and d.decision.action == "recompute") else 0
        out.append(Placement(w, r, d.decision, rebuild, first, held_prefix(match, d.reused, w), finishes[w], cands))
    return out


def _pick(options: dict, order: list[str], dests: dict) -> str:
    """The earliest finish; within ``TIE`` of it, a worker that needs no new copy or rebuild
    of the prefix (the holder, or one this plan already sends it to), then the pool's order.

    Predictions carry noise of this order: without the margin, a rebuild predicted 2% sooner
    on another worker wastes the prefill already running where the blocks are.
    """
    best = min(f for f, _ in options.values())
    close = [w for w in order if w in options and options[w][0] <= best * (1 + TIE) + 1e-9]

    def fresh_work(w):
        d = options[w][1]
        return w not in dests and d.decision is not None and d.decision.action in ("transfer", "recompute")

    return min(close, key=lambda w: (fresh_work(w), options[w][0], order.index(w)))


def _open(view, match, reused, w, forced, loaded, seen: dict, sources: dict) -> _Dest | None:
    """A destination before any branch is placed on it: how its prefix would get there.
    ``seen`` keeps each (worker, reused) decision for the plan: branches over one prefix ask
    the same question of every worker again (70 % of a 128-worker simulation's time)."""
    if (w, reused) not in seen:
        seen[(w, reused)] = prefix_decision(view, match, reused, w, forced, loaded, sources)
    d = seen[(w, reused)]
    if d is None:
        return _Dest(None, view.busy(w), reused)
    if d.action == "reuse":
        return _Dest(d, d.start_transfer, reused)
    return _Dest(d, d.start_transfer if d.action == "transfer" else d.start_recompute, reused)


def _least_busy(view: ClusterView, pool: list[str]) -> str | None:
    if not pool:
        return None
    return min(pool, key=lambda w: (view.busy(w), view.workers[w].processing, w))


__all__ = ["POLICIES", "CachedBlock", "ClusterView", "NeedsCalibration", "Placement", "PrefixMatch", "WorkerLoad",
           "batch_seconds", "held_prefix", "holder_of", "materialize_policy", "plan_placements", "prefix_decision",
           "read_blocks"]
