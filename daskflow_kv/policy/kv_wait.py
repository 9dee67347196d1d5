"""What a conversation's KV does while it waits for a tool: keep it, spill it, or drop it.

A ReAct agent that called a tool holds a continuation state (``nbytes`` of K/V over
``tokens`` tokens) that its next step resumes once the tool returns. Meanwhile:

keep   the blocks stay pinned in worker memory: the next step reuses them at once, but
       whoever needs that room during the wait waits for it (t_keep = q * W).
spill  the blocks are written to the store and released; a prefetch reads them back
       ``prefetch_after`` seconds into the call (``spill_timing``: the time that least
       costs the reload left visible plus the holding after it), so the reload is hidden
       unless the tool returns early (t_spill = write + q * that cost).
drop   the blocks are released; if the budget evicts them meanwhile the next step
       prefills them again (t_drop = q * R).

One currency, seconds of someone's delay: W is the tool's wait (its measured durations),
L a store read of the bytes, R a prefill of the tokens (the fitted profile), and q the
memory pressure on the worker that holds them - the chance that someone needs their room
before the tool returns: 0 without a budget or below ``LOW`` of it, 1 above ``HIGH``,
linear between. With no pressure every choice costs nothing but spill's write: keep.
Ties go to keep (no I/O), then spill (no prefill). Continuum (pin with a time-to-live
weighed against the reload) and Tokencake (offload during the call, bring it back before
it returns) are the two ideas this prices against each other.

Pure: plain numbers in and out, no torch, no Dask, no I/O. ``flow.kv_wait`` acts on it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .cost_model import PrefillProfile
from .store_read import StoreProfile

WAIT_ACTIONS = ("keep", "spill", "drop")
LOW, HIGH = 0.5, 0.9  # fractions of the KV budget between which pressure q rises from 0 to 1
DEFAULT_WAIT_S = 1.0  # a tool's expected wait before any run of it was measured


@dataclass(frozen=True, slots=True)
class WaitFacts:
    nbytes: int  # K/V bytes of the waiting conversation's state
    tokens: int  # tokens those bytes cover (what a drop prefills again)
    durations: tuple[float, ...]  # the tool's measured durations, s (newest last; may be empty)
    kv_bytes: int  # KV bytes in memory on the worker that holds the state
    budget_bytes: int | None  # that worker's KV budget (None: none)
    prefill: PrefillProfile | None  # that worker's fitted prefill profile (None: not measured)
    store: StoreProfile | None  # store read speed (None: no store, or never measured: no spill)


@dataclass(frozen=True, slots=True)
class WaitDecision:
    action: str  # keep | spill | drop
    t_keep: float  # s of delay charged to keeping (nan: not priced)
    t_spill: float  # s charged to spilling (nan: no store)
    t_drop: float  # s charged to dropping (nan: no prefill profile)
    expected_wait: float  # s, mean of the measured durations (or the default)
    pressure: float  # q in [0, 1]
    prefetch_after: float | None  # s after the call starts to read a spilled state back
    nbytes: int
    tokens: int
    reason: str  # one human sentence

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


def pressure(kv_bytes: int, budget_bytes: int | None) -> float:
    """q: 0 without a budget or below LOW of it, 1 above HIGH, linear between."""
    if not budget_bytes:
        return 0.0
    return min(1.0, max(0.0, (kv_bytes / budget_bytes - LOW) / (HIGH - LOW)))


def expected_wait(durations: Sequence[float], default: float = DEFAULT_WAIT_S) -> float:
    return statistics.fmean(durations) if durations else default


def spill_timing(durations: Sequence[float], reload_s: float, default: float = DEFAULT_WAIT_S) -> tuple[float, float]:
    """(prefetch_after, expected cost) of reading a spilled state back ``p`` s into the call.

    For a tool that returns at w: before p the read is not started and the next turn reads
    the state itself (L visible); after p + L it waits in memory, held for w - (p + L);
    between, the rest of the read shows. p is the candidate (0, or a measured wait minus L)
    with the least mean of visible + held over the measured waits - both weighed alike, as
    seconds someone waits - the earliest on a tie: a fast store reads late (holding costs
    more than reading), a slow one early."""
    waits = sorted(durations) or [default]

    def cost(p: float) -> float:
        return statistics.fmean((reload_s if w <= p else max(0.0, p + reload_s - w)) + max(0.0, w - p - reload_s)
                                for w in waits)

    candidates = sorted({0.0, *(max(0.0, w - reload_s) for w in waits)})
    best = min(candidates, key=lambda p: (round(cost(p), 9), p))
    return best, cost(best)


def decide_wait(f: WaitFacts, forced: str | None = None, default_wait: float = DEFAULT_WAIT_S) -> WaitDecision:
    """Keep, spill or drop the state of ``f`` for the tool call it waits on."""
    if forced not in (None, *WAIT_ACTIONS):
        raise ValueError(f"forced must be None or one of {WAIT_ACTIONS}, got {forced!r}")
    if f.nbytes < 0 or f.tokens < 0 or f.kv_bytes < 0 or any(not (d >= 0) for d in f.durations):
        raise ValueError("nbytes, tokens, kv_bytes and durations must be non-negative")
    w = expected_wait(f.durations, default_wait)
    q = pressure(f.kv_bytes, f.budget_bytes)
    t_keep = q * w
    t_drop = q * f.prefill.seconds(f.tokens) if f.prefill is not None else math.nan
    prefetch_after, t_spill = None, math.nan
    if f.store is not None:
        reload_s = f.store.seconds(f.nbytes)
        prefetch_after, spread = spill_timing(f.durations, reload_s, default_wait)
        t_spill = f.store.latency + q * spread  # the write's task, whatever the pressure

    def make(action: str, reason: str) -> WaitDecision:
        return WaitDecision(action, t_keep, t_spill, t_drop, w, q, prefetch_after if action == "spill" else None,
                            f.nbytes, f.tokens, reason)

    if forced:
        return make(forced, "forced")
    if q == 0.0:
        return make("keep", "no memory pressure on its worker: holding it costs no one")
    costs = {"keep": t_keep, "spill": t_spill, "drop": t_drop}  # in tie order
    best = min((a for a in WAIT_ACTIONS if not math.isnan(costs[a])), key=lambda a: costs[a])
    why = {
        "keep": "the wait is shorter than re-reading or re-prefilling it",
        "spill": "reading it back from the store before the tool returns costs less than holding it",
        "drop": "prefilling it again costs less than holding it" + ("" if f.store else " (no store to spill to)"),
    }
    return make(best, why[best])


def explain_wait(d: WaitDecision) -> str:
    s = lambda t: "n/a" if math.isnan(t) else f"{t:.3f} s"  # noqa: E731
    when = f", read back {d.prefetch_after:.2f} s into the call" if d.prefetch_after is not None else ""
    return (f"{d.action}: {d.nbytes / 1e6:.2f} MB / {d.tokens} tok, expected wait {d.expected_wait:.2f} s, "
            f"pressure {d.pressure:.2f}; keep {s(d.t_keep)}, spill {s(d.t_spill)}, drop {s(d.t_drop)}{when} "
            f"({d.reason})")
