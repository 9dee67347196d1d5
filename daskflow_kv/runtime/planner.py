"""Where each KV consumer runs, and how its prefix gets there. Pure: plain data in and out.

Given what the scheduler plugin reports (who holds the matched blocks, measured bandwidth
per worker pair, fitted prefill profiles, load), ``plan_placements`` spreads k branches
over workers and, per destination that lacks the blocks, asks the cost model whether to
transfer them or recompute them there. Each destination pays that once: the first branch
placed there carries the decision, later ones reuse what it brought.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..cost_model import Decision, LinkProfile, NeedsCalibration, PrefillProfile, decide

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
    def from_snapshot(cls, snap: dict, bandwidth_override=None, prefill_override=None) -> "ClusterView":
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
    recompute_tokens: int = 0  # >0: this branch's worker must first rebuild that many tokens
    replica: tuple | None = field(default=None, repr=False)  # futures of the rebuilt blocks

    def decision_dict(self) -> dict | None:
        return None if self.decision is None else asdict(self.decision)


def holder_of(match: dict) -> str | None:
    """The worker holding the most bytes of the matched blocks."""
    held: dict[str, int] = {}
    for b in match["blocks"]:
        for w in b["who_has"]:
            held[w] = held.get(w, 0) + b["nbytes"]
    return max(sorted(held), key=held.get) if held else None


def _needed_bytes(match: dict, reused: int) -> int:
    return sum(b["nbytes"] for b in match["blocks"] if b["start"] < reused)


def plan_placements(
    view: ClusterView,
    match: dict,
    reused: list[int],
    n: int,
    policy: str = "auto",
    worker: str | None = None,
    workers: list[str] | None = None,
) -> list[Placement]:
    """One placement per branch. ``reused[i]``: prefix tokens branch i can take from blocks."""
    if policy not in POLICIES:
        raise ValueError(f"unknown state policy {policy!r}; expected one of {POLICIES}")
    holder = holder_of(match)
    pool = [w for w in (workers or sorted(view.workers)) if w in view.workers] or sorted(view.workers)
    if worker is not None:
        targets = [worker] * n
    elif policy == "pin" or n == 1:
        targets = [holder if holder in view.workers else _least_loaded(view, pool, {})] * n
    else:
        targets = _spread(view, pool, holder, n)
    out, decided = [], {}
    for i, dst in enumerate(targets):
        if reused[i] == 0 or holder is None or dst is None:
            out.append(Placement(dst, reused[i] if holder is not None else 0, None))
            continue
        first = dst not in decided
        if first:
            forced = policy if policy in ("transfer", "recompute") else None
            nbytes = _needed_bytes(match, reused[i])
            src = None if holder is None else holder
            decided[dst] = decide(
                nbytes, reused[i], 0, src, dst, view.link(src, dst), view.profile(dst), view.memory_weight, forced
            )
        d = decided[dst]
        rebuild = reused[i] if (first and d.action == "recompute") else 0
        out.append(Placement(dst, reused[i], d, rebuild))
    return out


def _least_loaded(view: ClusterView, pool: list[str], assigned: dict[str, int]) -> str | None:
    if not pool:
        return None
    return min(pool, key=lambda w: (assigned.get(w, 0) + view.workers[w]["processing"], w))


def _spread(view: ClusterView, pool: list[str], holder: str | None, n: int) -> list[str | None]:
    """Round-robin by load, the holder first so it gets the extra branch on odd counts."""
    order = ([holder] if holder in pool else []) + [w for w in pool if w != holder]
    assigned: dict[str, int] = {}
    targets = []
    for _ in range(n):
        w = min(order, key=lambda w: (assigned.get(w, 0), order.index(w))) if order else None
        assigned[w] = assigned.get(w, 0) + 1
        targets.append(w)
    return targets


__all__ = ["ClusterView", "Placement", "NeedsCalibration", "plan_placements", "holder_of", "POLICIES"]
