"""Where each KV consumer runs, and how its prefix gets there. Pure: plain data in and out.

Given what the scheduler plugin reports (where the matched blocks are or will be, measured
bandwidth per worker pair, fitted prefill profiles, load), ``plan_placements`` spreads k
branches over workers and, per destination that lacks some of the blocks, asks the cost
model whether to transfer them or recompute the prefix there. Each destination pays that
once: all its branches share one ``Decision`` (the same object), and the first branch
placed there (``first``) is the one that pays for it.

A ``match`` is the plugin's lookup answer: ``{"tokens": int, "blocks": [{"key", "start",
"end", "nbytes", "where": [worker, ...]}, ...]}`` where ``where`` lists the workers that
hold the block, or, while it is still being computed, the worker it is planned on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .cost_model import Decision, LinkProfile, NeedsCalibration, PrefillProfile, decide

POLICIES = ("auto", "transfer", "recompute", "pin")


@dataclass(slots=True)
class ClusterView:
    workers: dict[str, dict]  # address -> {"nthreads", "processing", "kv_bytes"}
    bandwidth: dict[tuple[str, str], float]  # (src, dst) -> measured bytes/s
    prefill: dict[str, PrefillProfile]  # worker -> fitted profile
    memory_weight: float = 0.0  # lambda, s per byte left on a destination
    bandwidth_override: float | None = None  # what-if: every pair at this bandwidth
    prefill_override: PrefillProfile | None = None  # what-if: every worker with this profile

    @classmethod
    def from_snapshot(cls, snap: dict, bandwidth_override=None, prefill_override=None) -> ClusterView:
        bw = {}
        for pair, value in snap["bandwidth"].items():
            src, dst = pair.split("->")
            bw[(src, dst)] = value
        profiles = {w: PrefillProfile(p["a"], p["b"], p["c"]) for w, p in snap["prefill_profiles"].items()}
        return cls(snap["workers"], bw, profiles, snap.get("memory_weight") or 0.0, bandwidth_override, prefill_override)

    def link(self, src: str, dst: str) -> LinkProfile | None:
        if self.bandwidth_override is not None:
            return LinkProfile(self.bandwidth_override)
        bw = self.bandwidth.get((src, dst)) or self.bandwidth.get((dst, src))
        return LinkProfile(bw) if bw else None

    def profile(self, worker: str) -> PrefillProfile | None:
        return self.prefill_override or self.prefill.get(worker)


@dataclass(slots=True)
class Placement:
    worker: str | None  # where the consumer runs (None: let Dask choose)
    reused: int  # prefix tokens the consumer reads from blocks instead of prefilling
    decision: Decision | None  # how the prefix reaches ``worker`` (None: nothing cached)
    recompute_tokens: int = 0  # >0 on the first branch of a "recompute" worker: tokens rebuilt there
    first: bool = False  # the first branch placed on ``worker``: it pays the transfer or recompute

    @property
    def action(self) -> str:
        return "none" if self.decision is None else self.decision.action

    def decision_dict(self) -> dict | None:
        return None if self.decision is None else asdict(self.decision)


def _where(block: dict) -> list[str]:
    return list(block.get("where", block.get("who_has", ())))


def holder_of(blocks: list[dict]) -> str | None:
    """The worker holding (or about to hold) the most bytes of ``blocks``; ties by name."""
    held: dict[str, int] = {}
    for b in blocks:
        for w in _where(b):
            held[w] = held.get(w, 0) + b["nbytes"]
    return max(sorted(held), key=held.get) if held else None


def read_blocks(match: dict, reused: int) -> list[dict]:
    """The blocks a consumer that reuses ``reused`` tokens depends on."""
    return [b for b in match["blocks"] if b["start"] < reused]


def plan_placements(
    view: ClusterView,
    match: dict,
    reused: list[int],
    n: int,
    policy: str = "auto",
    worker: str | None = None,
    workers: list[str] | None = None,
) -> list[Placement]:
    """One placement per branch. ``reused[i]``: prefix tokens branch i can take from blocks.

    policy: auto (cost model per destination) | transfer | recompute (forced for every
    destination that lacks blocks) | pin (every branch where the blocks are). ``worker``
    puts every branch on one worker; ``workers`` limits the pool branches spread over.
    Raises NeedsCalibration when auto needs a measurement nobody has taken yet.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown state policy {policy!r}; expected one of {POLICIES}")
    if len(reused) != n:
        raise ValueError(f"{n} branches but {len(reused)} reuse counts")
    holder = holder_of(match["blocks"])
    pool = [w for w in (workers or sorted(view.workers)) if w in view.workers] or sorted(view.workers)
    if worker is not None:
        targets = [worker] * n
    elif policy == "pin":
        targets = [holder if holder in view.workers else _least_loaded(view, pool)] * n
    else:
        targets = _spread(pool, holder, n)

    need: dict[str | None, int] = {}  # destination -> largest prefix one of its branches reads
    for dst, r in zip(targets, reused):
        need[dst] = max(need.get(dst, 0), r)
    forced = policy if policy in ("transfer", "recompute") else None
    decisions = {dst: _decide(view, match, r, dst, forced) for dst, r in need.items()}

    out, seen = [], set()
    for dst, r in zip(targets, reused):
        d, first = decisions[dst], dst not in seen
        seen.add(dst)
        rebuild = need[dst] if (first and d is not None and d.action == "recompute") else 0
        out.append(Placement(dst, r, d, rebuild, first))
    return out


def _decide(view: ClusterView, match: dict, reused: int, dst: str | None, forced: str | None) -> Decision | None:
    """How ``dst`` gets the blocks covering ``reused`` tokens; None when nothing is read."""
    reads = read_blocks(match, reused)
    if not reads or dst is None:
        return None
    missing = [b for b in reads if dst not in _where(b)]
    if not missing:  # everything is (or will be) on dst already
        return decide(0, 0, reused, dst, dst, None, None, view.memory_weight)
    src = holder_of(missing)
    if src is None:  # being recomputed somewhere Dask has not chosen yet: let Dask place it
        return None
    nbytes = sum(b["nbytes"] for b in missing)
    return decide(nbytes, reused, 0, src, dst, view.link(src, dst), view.profile(dst), view.memory_weight, forced)


def _least_loaded(view: ClusterView, pool: list[str]) -> str | None:
    if not pool:
        return None
    return min(pool, key=lambda w: (view.workers[w].get("processing", 0), w))


def _spread(pool: list[str], holder: str | None, n: int) -> list[str | None]:
    """Round-robin, the holder first so it gets the extra branch on odd counts."""
    order = ([holder] if holder in pool else []) + [w for w in pool if w != holder]
    if not order:
        return [None] * n
    return [order[i % len(order)] for i in range(n)]


__all__ = ["POLICIES", "ClusterView", "NeedsCalibration", "Placement", "holder_of", "plan_placements", "read_blocks"]
