"""Load from the persistent store, or prefill again: a third price next to transfer and recompute.

When a request's prefix is in no worker's memory but the persistent store holds its
blocks, the worker that will run the request can read them (T_load = latency + bytes /
measured store bandwidth) or prefill the tokens itself (T_recompute, the same fitted
profile ``cost_model.decide`` uses). The cheaper one wins; a ``StoreDecision`` carries the
numbers and a sentence, like ``cost_model.Decision``.

Transfer is not an option for these tokens: no worker holds them (a memory lookup found
them first otherwise). The bandwidth is measured end to end on workers - read, checksum,
decode - from real block loads and a calibration probe (``fit_store_profile``).

Pure: plain numbers in and out, no torch, no Dask, no I/O. Plugs in at one call site
(``KVRuntime``'s store lookup); a planner that ranks destinations can call
``store_read_seconds`` as a third per-destination cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .cost_model import NeedsCalibration, PrefillProfile

# s: what a load costs besides reading bytes - a load task and a tiny summary task through
# the scheduler (~14 ms each on loopback TCP, see cost_model.DEFAULT_LATENCY), and opening
# the first object. Added to the fitted per-object latency.
TASK_OVERHEAD = 0.03
STORE_ACTIONS = ("load", "recompute")


@dataclass(frozen=True, slots=True)
class StoreSample:
    nbytes: int  # tensor bytes one load read
    seconds: float  # its wall time on the worker (read + verify + decode)


@dataclass(frozen=True, slots=True)
class StoreProfile:
    bandwidth: float  # bytes/s, end to end on a worker
    latency: float = TASK_OVERHEAD  # s per load, whatever its size

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


def store_read_seconds(nbytes: int, profile: StoreProfile) -> float:
    """Seconds to load ``nbytes`` of blocks from the store onto a worker."""
    return 0.0 if nbytes <= 0 else profile.seconds(nbytes)


def fit_store_profile(samples: Sequence[StoreSample]) -> StoreProfile:
    """seconds = l + nbytes / bw, least squares with l >= 0 (a pure rate when it would go
    negative or one size is all there is); ``TASK_OVERHEAD`` is added to l."""
    used = [s for s in samples if s.nbytes > 0 and s.seconds > 0]
    if not used:
        raise ValueError("fit_store_profile needs a sample with nbytes > 0 and seconds > 0")
    n = len(used)
    mx = sum(s.nbytes for s in used) / n
    my = sum(s.seconds for s in used) / n
    sxx = sum((s.nbytes - mx) ** 2 for s in used)
    slope = sum((s.nbytes - mx) * (s.seconds - my) for s in used) / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    if slope <= 0 or intercept < 0:  # noise or one size: the honest model is the mean rate
        slope, intercept = sum(s.seconds for s in used) / sum(s.nbytes for s in used), 0.0
    return StoreProfile(1.0 / slope, TASK_OVERHEAD + intercept)


@dataclass(frozen=True, slots=True)
class StoreDecision:
    action: str  # "load" | "recompute"
    t_load: float  # s to read the blocks onto dst
    t_recompute: float  # s to prefill the same tokens on dst
    nbytes: int  # K/V bytes the store holds for them
    missing_tokens: int  # tokens those bytes cover beyond what memory has
    prefix_tokens: int  # tokens before them that dst will have anyway
    dst: str | None  # the worker that would load or prefill
    bandwidth: float  # bytes/s used for t_load
    reason: str  # one human sentence

    def as_dict(self) -> dict:
        """The fields a cost-model decision shows on the dashboard (src "store")."""
        return {"action": self.action, "src": "store", "dst": self.dst, "nbytes": self.nbytes,
                "missing_tokens": self.missing_tokens, "prefix_tokens": self.prefix_tokens,
                "bandwidth": self.bandwidth, "t_transfer": self.t_load, "t_recompute": self.t_recompute,
                "reason": self.reason}


def decide_store_read(nbytes: int, missing_tokens: int, prefix_tokens: int, dst: str | None,
                      store: StoreProfile | None, prefill: PrefillProfile | None,
                      forced: str | None = None) -> StoreDecision:
    """Load ``nbytes`` covering ``missing_tokens`` after ``prefix_tokens``, or prefill them.

    Ties go to recompute (no store I/O), as ``cost_model.decide`` gives ties to recompute.
    """
    if forced not in (None, *STORE_ACTIONS):
        raise ValueError(f"forced must be None, 'load' or 'recompute', got {forced!r}")
    bw = store.bandwidth if store else math.nan
    t_load = store_read_seconds(nbytes, store) if store else math.nan
    t_rc = prefill.seconds(missing_tokens, prefix_tokens) if prefill else math.nan

    def make(action: str, reason: str) -> StoreDecision:
        return StoreDecision(action, t_load, t_rc, nbytes, missing_tokens, prefix_tokens, dst, bw, reason)

    if forced:
        return make(forced, "forced by policy")
    if missing_tokens <= 0:
        return make("recompute", "the store adds nothing memory lacks")
    missing = ([] if store else ["store read bandwidth"]) + ([] if prefill else ["prefill profile on dst"])
    if missing:
        raise NeedsCalibration(f"cannot price a store read: measure {', '.join(missing)}")
    if t_load < t_rc:
        return make("load", "reading the blocks from the store is faster than prefilling them")
    return make("recompute", "prefilling the tokens is no slower than reading them from the store")


def explain_store(d: StoreDecision) -> str:
    ms = lambda t: "n/a" if math.isnan(t) else f"{t * 1e3:.1f} ms"  # noqa: E731
    bw = "n/a" if math.isnan(d.bandwidth) else f"{d.bandwidth / 1e9:.2f} GB/s"
    return (f"{d.action} store->{d.dst}: read {d.nbytes / 1e6:.2f} MB @ {bw} = {ms(d.t_load)}, recompute "
            f"{d.missing_tokens} tok after {d.prefix_tokens} = {ms(d.t_recompute)} ({d.reason})")
