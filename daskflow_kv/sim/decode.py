"""What a decode row costs, fitted on a bench run's own decode timings.

The prefill profile (t(n, p) = a + b n + c n (p + n/2)) is fitted on prompt prefills, where
a token is one of hundreds multiplied through the weights at once. A decode row is one
token per request: on the measured CPU workers it costs far more than b (each request's
attention runs on its own, over its cache), and a decode-only step far less than a (no
prompt chunk). ``bench_full.json``'s exp 1 / exp 2 rows say so: one branch decodes at
~48 ms a step where the profile gives 86-100 ms; four at ~83 ms where it gives 100-114.

A ``DecodeSample`` is one measured run: its branches' decode seconds (``decode_s``, summed
over agents), how many branches each worker decoded together, and their prompt length. A
``DecodeProfile`` is fitted on them by least squares on relative error, no sample's
configuration tuned by hand:

    decode-only step of rows at positions p_i:  fixed + sum(per_row + per_key p_i)
                                                 + shared  (another worker of the host steps too)

``shared`` is the measured cost of two worker processes stepping at once on one host
(memory traffic and cores they share): fitted on the samples where both workers decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from ..policy.cost_model import least_squares

STEP_SYSTEMS = ("local", "dkv")  # bench systems whose decodes run in the worker's step loop


@dataclass(frozen=True, slots=True)
class DecodeSample:
    rows: tuple[int, ...]  # branches decoded together, per worker that decoded (1 or 2 entries)
    position: int  # tokens in each branch's cache when it decodes (its prompt)
    step_s: float  # measured seconds a branch's decode step took, averaged over its branches


@dataclass(frozen=True, slots=True)
class DecodeProfile:
    fixed: float  # s per decode-only step (weights read once)
    per_row: float  # s per decoding request in a step
    per_key: float  # s per cached token a decoding request attends to
    shared: float = 0.0  # s added to a decode-only step while another worker of its host steps
    samples: int = 0  # measured runs it was fitted on

    def row_seconds(self, position: int) -> float:
        return self.per_row + self.per_key * position

    def step_seconds(self, positions, shared: bool = False) -> float:
        return self.fixed + sum(self.row_seconds(p) for p in positions) + (self.shared if shared else 0.0)


def decode_samples(runs) -> list[DecodeSample]:
    """The decode timings in a bench JSON's ``runs``: step-loop systems (``local``, ``dkv``)
    whose every branch decoded all its tokens (so steps = max_new - 1 each), split over at
    most two workers (``batched_branches``: the most one worker decoded together)."""
    out = []
    for r in runs:
        if r.get("exp") == "exp7":  # the rows the fidelity check compares against: never fitted on
            continue
        k, new = r.get("agents"), r.get("max_new_tokens")
        if r.get("system") not in STEP_SYSTEMS or not k or not new or new < 2 or r.get("decode_s") is None:
            continue
        if r.get("generated_tokens") != k * new:  # an early stop: fewer steps than counted
            continue
        used, bb = len(r.get("workers_used") or ()), int(r.get("batched_branches") or k)
        if used == 1:
            rows = (k,)
        elif used == 2 and 0 < bb < k:
            rows = (bb, k - bb)
        else:
            continue
        out.append(DecodeSample(rows, int(r.get("prompt_tokens") or 0), r["decode_s"] / k / (new - 1)))
    return out


def _features(s: DecodeSample) -> list[float]:
    """Mean over a sample's branches of (fixed, per_row, per_key, shared) multipliers."""
    k = sum(s.rows)
    both = len(s.rows) > 1
    return [1.0, sum(r * r for r in s.rows) / k, s.position * sum(r * r for r in s.rows) / k, 1.0 if both else 0.0]


def fit_decode(samples, min_samples: int = 4) -> DecodeProfile | None:
    """Non-negative least squares on relative error over every support of the four terms
    (the simplest of equal fits wins); None with too few samples or one batch size only."""
    samples = [s for s in samples if s.step_s > 0]
    if len(samples) < min_samples or len({s.rows for s in samples}) < 2:
        return None
    scale = [1.0, 1e-2, 1e-5, 1.0]  # columns span decades: solve in comparable units
    rows = [[f / sc / s.step_s for f, sc in zip(_features(s), scale)] for s in samples]
    y = [1.0] * len(samples)
    best = None
    for n in range(1, 5):
        for cols in combinations(range(4), n):
            coef = least_squares(rows, y, cols)
            if coef is None or min(coef) < 0:
                continue
            full = [0.0] * 4
            for j, v in zip(cols, coef):
                full[j] = v
            sse = sum((sum(f * c for f, c in zip(r, full)) - 1.0) ** 2 for r in rows)
            if best is None or sse < best[0] - 1e-12:
                best = (sse, full)
    if best is None:
        return None
    f = [v / sc for v, sc in zip(best[1], scale)]
    return DecodeProfile(f[0], f[1], f[2], f[3], len(samples))
