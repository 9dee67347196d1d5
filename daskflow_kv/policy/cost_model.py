"""Transfer vs recompute: the policy pi(S) of the AAFLOW+ paper, as pure functions on numbers.

A consumer task on worker ``dst`` needs the K/V of ``missing_tokens`` tokens that sit right
after ``prefix_tokens`` tokens dst already holds. Those blocks are cached on ``src`` (or
nowhere). dst can fetch them (T_transfer = latency + nbytes / bandwidth) or prefill the
tokens itself (T_recompute, from a profile fitted to *measured* prefills on the worker).
The cheaper one wins; every choice comes back as a ``Decision`` carrying its numbers and a
sentence, the only thing the planner and the scheduler plugin see of this module.

No torch, no dask, no numpy: the planner calls this for every state edge of a graph, and
the tests run it on plain data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import DaskflowKVError

DEFAULT_LATENCY = 0.014  # s per dependent fetch between two Dask workers (measured, loopback TCP)
REFERENCE_TOKENS = 512  # prompt size at which a profile's tokens/s is quoted
ACTIONS = ("reuse", "transfer", "recompute")


class NeedsCalibration(DaskflowKVError):
    """A decision needs a measurement (link bandwidth or prefill profile) nobody has taken."""


@dataclass(frozen=True, slots=True)
class PrefillSample:
    new_tokens: int  # tokens prefilled by the call
    prefix_tokens: int  # tokens already in the cache the new ones attended to
    seconds: float  # measured wall time of the call


@dataclass(frozen=True, slots=True)
class PrefillProfile:
    """t(n, p) = a + b*n + c*n*(p + n/2): fixed cost, per-token MLP/projections, attention.

    Each of the n new tokens attends to the p cached keys plus on average n/2 new ones, so
    the attention work is n*(p + n/2) query-key pairs.
    """

    a: float  # s, fixed cost of one prefill call (launch, Python overhead)
    b: float  # s per new token (projections, MLP)
    c: float  # s per query-key pair (attention)
    samples: tuple[PrefillSample, ...] = ()  # the measurements it was fitted to (a window)

    @classmethod
    def from_rate(cls, tokens_per_second: float) -> PrefillProfile:
        """A profile from a single quoted rate (a=0, c=0), e.g. before any measurement."""
        if tokens_per_second <= 0:
            raise ValueError(f"tokens_per_second must be positive, got {tokens_per_second}")
        return cls(0.0, 1.0 / tokens_per_second, 0.0)

    def seconds(self, new_tokens: int, prefix_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0  # nothing to prefill: no call, no fixed cost
        return self.a + self.b * new_tokens + self.c * new_tokens * (prefix_tokens + new_tokens / 2)

    @property
    def tokens_per_second(self) -> float:
        return REFERENCE_TOKENS / self.seconds(REFERENCE_TOKENS)

    def updated(self, samples: Iterable[PrefillSample], max_samples: int = 64) -> PrefillProfile:
        """Refit on the last ``max_samples`` of (old samples + new ones): tracks drift, bounded."""
        window = (self.samples + tuple(samples))[-max_samples:]
        return fit_prefill_profile(window) if window else self


def _features(s: PrefillSample) -> tuple[float, float, float]:
    n, p = s.new_tokens, s.prefix_tokens
    return (1.0, float(n), n * (p + n / 2))


def least_squares(rows: list[list[float]], y: list[float], cols: tuple[int, ...]) -> list[float] | None:
    """Unconstrained least squares on a subset of columns; None when singular."""
    k = len(cols)
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in cols]  # columns span ~10 decades
    x = [[r[j] / scale[i] for i, j in enumerate(cols)] for r in rows]
    gram = [[sum(r[i] * r[j] for r in x) for j in range(k)] + [sum(r[i] * t for r, t in zip(x, y))]
            for i in range(k)]
    top = max(abs(gram[i][i]) for i in range(k))
    for i in range(k):  # Gauss-Jordan with partial pivoting on a small system (a few unknowns)
        piv = max(range(i, k), key=lambda r: abs(gram[r][i]))
        if abs(gram[piv][i]) <= 1e-12 * top:
            return None
        gram[i], gram[piv] = gram[piv], gram[i]
        for r in range(k):
            if r != i:
                f = gram[r][i] / gram[i][i]
                gram[r] = [u - f * v for u, v in zip(gram[r], gram[i])]
    return [gram[i][k] / gram[i][i] / scale[i] for i in range(k)]


# Supports tried by the exact small NNLS; on equal fit the earlier (simpler) one wins.
_SUPPORTS = [(1,), (0,), (2,), (0, 1), (1, 2), (0, 2), (0, 1, 2)]


def fit_prefill_profile(samples: Sequence[PrefillSample]) -> PrefillProfile:
    """Least squares on *relative* error with a, b, c >= 0. With 1-2 samples: a per-token rate.

    Each sample's equation is divided by its measured time, so a 64-token probe and a
    4,096-token prefill count alike: plain least squares lets the longest samples decide
    everything and mispredicts short ones, or (fitted on short ones only) extrapolates the
    attention term far off at long contexts. Non-negative least squares in 3 unknowns is
    solved exactly by trying every support (the optimum is the unconstrained fit on its own
    support) and keeping the best feasible one: 7 tiny solves, no numpy or scipy.
    """
    used = [s for s in samples if s.new_tokens > 0]
    if not used:
        raise ValueError("fit_prefill_profile needs at least one sample with new_tokens > 0")
    if any(s.seconds < 0 or s.prefix_tokens < 0 for s in used):
        raise ValueError("prefill samples must have seconds >= 0 and prefix_tokens >= 0")
    if len(used) < 3:  # too few points to separate three terms: a rate is the honest model
        return PrefillProfile(0.0, sum(s.seconds for s in used) / sum(s.new_tokens for s in used),
                              0.0, tuple(samples))
    weight = [1.0 / max(s.seconds, 1e-9) for s in used]
    rows = [[f * w for f in _features(s)] for s, w in zip(used, weight)]
    y = [s.seconds * w for s, w in zip(used, weight)]  # all 1: each sample's relative error
    tol = 1e-12 * sum(t * t for t in y)
    fits = []
    for rank, cols in enumerate(_SUPPORTS):
        coef = least_squares(rows, y, cols)
        if coef is None or min(coef) < 0:
            continue
        full = [0.0, 0.0, 0.0]
        for j, v in zip(cols, coef):
            full[j] = v
        sse = sum((sum(f * w for f, w in zip(r, full)) - t) ** 2 for r, t in zip(rows, y))
        fits.append((sse, rank, full))
    best = min(f[0] for f in fits)  # (1,) is always feasible: sum(n*y)/sum(n^2) >= 0
    _, _, (a, b, c) = min((f for f in fits if f[0] <= best + tol), key=lambda f: f[1])
    return PrefillProfile(a, b, c, tuple(samples))


@dataclass(frozen=True, slots=True)
class LinkProfile:
    bandwidth: float  # bytes/s between src and dst (scheduler.bandwidth_workers or a probe)
    latency: float = DEFAULT_LATENCY  # s per dependent fetch, paid once per transfer

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


def calibration_lengths(longest: int, shortest: int = 64) -> list[int]:
    """Prefill lengths to calibrate on: every 4x from ``shortest``, then half and all of
    ``longest``. Spread over the range the planner will predict (a profile fitted on short
    prefills alone mispredicts long ones: 4x at 4k tokens, measured)."""
    longest = max(int(longest), 8)
    out = {longest, max(8, longest // 2)}
    n = min(shortest, longest)
    while n < longest // 2:
        out.add(n)
        n *= 4
    return sorted(out)


def fit_link(samples: Sequence[tuple[int, float]]) -> LinkProfile:
    """A link from timed transfers of several sizes: seconds = latency + nbytes / bandwidth.

    The line through the points (least squares); with one size, or a fit that would make
    either term non-positive, the bandwidth of the largest transfer and the default latency.
    """
    pts = [(float(n), float(s)) for n, s in samples if n > 0 and s > 0]
    if not pts:
        raise ValueError("fit_link needs at least one transfer with bytes > 0 and seconds > 0")
    biggest = max(pts)
    fallback = LinkProfile(biggest[0] / biggest[1], DEFAULT_LATENCY)
    if len({n for n, _ in pts}) < 2:
        return fallback
    mean_n = sum(n for n, _ in pts) / len(pts)
    mean_s = sum(s for _, s in pts) / len(pts)
    slope = sum((n - mean_n) * (s - mean_s) for n, s in pts) / sum((n - mean_n) ** 2 for n, _ in pts)
    latency = mean_s - slope * mean_n
    if slope <= 0 or latency <= 0:
        return fallback
    return LinkProfile(1.0 / slope, latency)


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # "reuse" | "transfer" | "recompute"
    t_transfer: float  # s to fetch the blocks to dst (inf when no worker holds them)
    t_recompute: float  # s to prefill the missing tokens on dst (nan when not measured)
    memory_cost: float  # s-equivalent, lambda * bytes the action adds on dst
    score_transfer: float  # t_transfer + memory_cost
    score_recompute: float  # t_recompute + memory_cost
    nbytes: int  # K/V bytes dst lacks
    missing_tokens: int  # tokens those bytes cover
    prefix_tokens: int  # tokens already on dst before them
    src: str | None  # a worker holding the blocks (None: cached nowhere)
    dst: str  # the worker that runs the consumer
    bandwidth: float  # bytes/s used for t_transfer (nan when unknown)
    reason: str  # one human sentence
    src_ready: float = 0.0  # s until the blocks exist on src (their prefill may still be running)
    dst_wait: float = 0.0  # s of work queued on dst before it could start a recompute
    loaded: bool = False  # every candidate worker had queued work: compute was priced, not only time

    @property
    def start_transfer(self) -> float:
        """When dst could start the consumer with fetched blocks (a fetch runs beside dst's work)."""
        return max(self.dst_wait, self.src_ready + self.t_transfer)

    @property
    def start_recompute(self) -> float:
        """When dst could start the consumer after prefilling the tokens itself (its thread does it)."""
        return self.dst_wait + self.t_recompute

    @property
    def cost(self) -> float:
        """Score of the chosen action: lets a planner compare candidate dst workers."""
        return {"reuse": 0.0, "transfer": self.score_transfer}.get(self.action, self.score_recompute)


def needs_calibration(link: LinkProfile | None, prefill: PrefillProfile | None) -> list[str]:
    """What the caller must measure before ``decide`` can compare the two options."""
    return ([] if link else ["link bandwidth src->dst"]) + ([] if prefill else ["prefill profile on dst"])


def decide(nbytes: int, missing_tokens: int, prefix_tokens: int, src: str | None, dst: str,
           link: LinkProfile | None, prefill: PrefillProfile | None,
           memory_weight: float = 0.0, forced: str | None = None,
           src_ready: float = 0.0, dst_wait: float = 0.0, loaded: bool = False) -> Decision:
    """Reuse, transfer or recompute the ``missing_tokens`` tokens after ``prefix_tokens`` on dst.

    The option that lets dst *start* its consumer earlier wins: a transfer can begin once
    the blocks exist on src (``src_ready`` s from now) and runs beside dst's queued work; a
    recompute runs on dst's own thread after its ``dst_wait`` s of queued work. On idle
    workers with blocks already cached this is plain "transfer time < recompute time".
    ``memory_weight`` (lambda, s per byte) charges the bytes the action leaves on dst. Both a
    transfer and a recompute leave the same ``nbytes`` there, so it never flips this choice;
    it is reported so a planner ranking candidate dst workers sees that running where the
    blocks already are (reuse, no new bytes) saves memory as well as time.
    Ties go to recompute: it needs no other worker and no network.

    ``loaded``: every worker the plan could use has work queued (the cluster is saturated).
    A rebuild then spends compute that other requests are waiting for, where a fetch spends
    almost none (1-2 % of the prefill here): a rebuild's compute is charged again as the work
    it takes from others, so the fetch wins - even if the blocks will exist on src only
    later - unless that wait exceeds the compute it saves. That is Preble's E2 with a move:
    explore the less loaded worker, and bring the prefix to it rather than rebuild it; but a
    few tokens still queued behind src's long backlog are rebuilt, not waited for.
    """
    if forced not in (None, "transfer", "recompute"):
        raise ValueError(f"forced must be None, 'transfer' or 'recompute', got {forced!r}")
    bw = link.bandwidth if link else math.nan

    def make(action: str, t_tr: float, t_rc: float, reason: str) -> Decision:
        mem = 0.0 if action == "reuse" else memory_weight * nbytes
        return Decision(action, t_tr, t_rc, mem, t_tr + mem, t_rc + mem, nbytes, missing_tokens,
                        prefix_tokens, src, dst, bw, reason, src_ready, dst_wait, loaded)

    if missing_tokens <= 0 or src == dst:
        why = "nothing is missing on dst" if missing_tokens <= 0 else "the blocks are already on dst"
        return make("reuse", 0.0, 0.0, why)
    t_rc = prefill.seconds(missing_tokens, prefix_tokens) if prefill else math.nan
    if src is None:
        if forced == "transfer":
            raise ValueError("forced transfer, but no worker holds the blocks")
        return make("recompute", math.inf, t_rc, "no worker holds the blocks")
    t_tr = link.seconds(nbytes) if link else math.nan
    if forced:
        return make(forced, t_tr, t_rc, "forced by policy")
    missing = needs_calibration(link, prefill)
    if missing:
        raise NeedsCalibration(f"cannot compare transfer and recompute: measure {', '.join(missing)}")
    start_tr, start_rc = max(dst_wait, src_ready + t_tr), dst_wait + t_rc
    if loaded:
        # A rebuild's compute is charged twice: as this request's time, and as the work it
        # takes from the requests queued behind it. The fetch wins unless waiting for the
        # blocks delays dst by more than the compute it saves (a few tokens' rebuild beats
        # waiting behind a long queue on src for them).
        if t_tr < t_rc and start_tr < start_rc + (t_rc - t_tr):
            return make("transfer", t_tr, t_rc, "every worker has queued work: moving the blocks costs less compute "
                                                "than prefilling them again")
        if t_tr < t_rc:
            return make("recompute", t_tr, t_rc, "every worker has queued work, but the blocks are ready on src so "
                                                 "late that rebuilding them costs less than the wait")
        return make("recompute", t_tr, t_rc, "every worker has queued work, and prefilling is still cheaper than "
                                             "fetching over this link")
    if start_tr < start_rc:
        return make("transfer", t_tr, t_rc, "fetching the blocks lets dst start sooner than prefilling them")
    return make("recompute", t_tr, t_rc, "prefilling the tokens on dst lets it start no later than fetching them")


def crossover_bandwidth(nbytes: int, missing_tokens: int, prefill: PrefillProfile,
                        latency: float = DEFAULT_LATENCY, prefix_tokens: int = 0) -> float:
    """Bandwidth at which both options cost the same: below (and at) it, recompute wins.

    inf when recomputing is no slower than the fixed latency alone: no link beats it.
    """
    spare = prefill.seconds(missing_tokens, prefix_tokens) - latency
    return nbytes / spare if spare > 0 else math.inf


def crossover_tokens(bytes_per_token: float, link: LinkProfile, prefill: PrefillProfile,
                     prefix_tokens: int = 0, limit: int = 1 << 24) -> int | None:
    """Fewest missing tokens for which transfer strictly wins (None if not up to ``limit``).

    Both costs grow with n, recompute at least as fast (b, c >= 0) once latency is paid,
    so the winning region is n >= answer; found by bisection.
    """
    def wins(n: int) -> bool:
        return link.seconds(n * bytes_per_token) < prefill.seconds(n, prefix_tokens)

    if not wins(limit):
        return None
    lo, hi = 0, limit  # wins(lo) is False (n=0 costs nothing to recompute), wins(hi) is True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi


def explain(d: Decision) -> str:
    """One line with the numbers, for logs and the catalog."""
    ms = lambda t: "n/a" if math.isnan(t) else ("inf" if math.isinf(t) else f"{t * 1e3:.1f} ms")
    bw = "n/a" if math.isnan(d.bandwidth) else f"{d.bandwidth / 1e9:.2f} GB/s"
    waits = (f", src ready in {ms(d.src_ready)}, dst busy for {ms(d.dst_wait)}"
             if (d.src_ready or d.dst_wait) else "")
    waits += ", cluster loaded: compute priced" if d.loaded else ""
    return (f"{d.action} {d.src}->{d.dst}: transfer {d.nbytes / 1e6:.2f} MB @ {bw} = "
            f"{ms(d.t_transfer)}, recompute {d.missing_tokens} tok after {d.prefix_tokens} = "
            f"{ms(d.t_recompute)}{waits}, memory {ms(d.memory_cost)} ({d.reason})")


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V for one token across all layers (SmolLM2-135M fp32: 46,080)."""
    return 2 * num_layers * kv_heads * head_dim * dtype_bytes
