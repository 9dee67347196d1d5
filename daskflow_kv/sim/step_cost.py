"""What a modeled step costs, fitted on the step loop's own measured steps.

A step of the worker's step loop (``model.step_engine``) may mix prompt chunks of some
requests with decode rows of many others, copy the prefixes of requests that join, and cut
the blocks of requests that leave. ``benchmarks/step_cost.py`` records such steps
(``model.step_shape.StepShape``: what was fed, and the wall time) and this module fits one
linear cost per term by non-negative least squares on relative error:

    fixed + prompt_fixed [any prompt row] + per_prompt_token n + per_attn n (p + n/2)
          + per_row r + per_key (cached tokens of the r rows)
          + per_join j + per_loaded (prefix tokens copied in) + per_finish f + per_exported (tokens cut)

Pure: plain dicts in (the records as JSON holds them), a ``StepCost`` out.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass

from ..policy.cost_model import least_squares

TERMS = ("fixed", "prompt_fixed", "per_prompt_token", "per_attn", "per_row", "per_key", "per_join", "per_loaded",
         "per_finish", "per_exported")


def features(s: dict) -> list[float]:
    """The multipliers of ``TERMS`` for one recorded step (a ``StepShape.as_dict()``)."""
    return [1.0, 1.0 if s.get("prompt_tokens") else 0.0, float(s.get("prompt_tokens", 0)),
            float(s.get("prompt_attn", 0.0)), float(s.get("decode_rows", 0)), float(s.get("decode_keys", 0)),
            float(s.get("joined", 0)), float(s.get("loaded_tokens", 0)), float(s.get("finished", 0)),
            float(s.get("exported_tokens", 0))]


@dataclass(frozen=True, slots=True)
class StepCost:
    fixed: float = 0.0  # s every step
    prompt_fixed: float = 0.0  # s more when it feeds a prompt chunk
    per_prompt_token: float = 0.0  # s per prompt token
    per_attn: float = 0.0  # s per query-key pair of prompt chunks
    per_row: float = 0.0  # s per decode row
    per_key: float = 0.0  # s per cached token a decode row attends to
    per_join: float = 0.0  # s per request joining
    per_loaded: float = 0.0  # s per prefix token copied in at a join
    per_finish: float = 0.0  # s per request leaving
    per_exported: float = 0.0  # s per token of the blocks cut as it leaves
    samples: int = 0  # steps it was fitted on

    def seconds(self, shape: dict) -> float:
        return sum(c * f for c, f in zip(self.coefficients, features(shape)))

    @property
    def coefficients(self) -> list[float]:
        return [getattr(self, t) for t in TERMS]

    def as_dict(self) -> dict:
        return asdict(self)

    def scaled(self, factor: float) -> "StepCost":
        """Every term ``factor`` times slower (a host that gives the worker less of a core)."""
        return StepCost(*(c * factor for c in self.coefficients), samples=self.samples)

    @classmethod
    def from_dict(cls, d: dict) -> "StepCost":
        return cls(**{k: float(d[k]) for k in TERMS if k in d}, samples=int(d.get("samples", 0)))

    def describe(self) -> str:
        ms = {"fixed": 1e3, "prompt_fixed": 1e3, "per_row": 1e3, "per_join": 1e3, "per_finish": 1e3}
        parts = []
        for t in TERMS:
            v = getattr(self, t)
            if v:
                parts.append(f"{t} {v * ms[t]:.2f} ms" if t in ms else f"{t} {v * 1e6:.3f} us")
        return ", ".join(parts)


def fit_step_cost(steps: list[dict]) -> StepCost:
    """Non-negative least squares on relative error: solve on every term the samples exercise,
    drop the most negative one, solve again, until none is negative."""
    steps = [s for s in steps if s.get("seconds", 0) > 0]
    if len(steps) < len(TERMS):
        raise ValueError(f"{len(steps)} recorded steps are too few to fit {len(TERMS)} terms")
    rows = [[f / s["seconds"] for f in features(s)] for s in steps]
    y = [1.0] * len(rows)
    cols = [j for j in range(len(TERMS)) if any(r[j] for r in rows)]
    while cols:
        coef = least_squares(rows, y, tuple(cols))
        if coef is None:  # collinear on these samples: the last (least basic) term goes first
            cols.pop()
            continue
        worst = min(range(len(cols)), key=lambda i: coef[i])
        if coef[worst] >= 0:
            full = dict.fromkeys(TERMS, 0.0)
            full.update({TERMS[j]: v for j, v in zip(cols, coef)})
            return StepCost(**full, samples=len(steps))
        cols.pop(worst)
    raise ValueError("no non-negative fit of the step cost")


def fit_report(cost: StepCost, steps: list[dict]) -> dict:
    """Relative errors of ``cost`` on ``steps``: RMS, and by kind of step."""
    kinds: dict[str, list[float]] = {}
    for s in steps:
        if s.get("seconds", 0) <= 0:
            continue
        kind = ("mixed" if s.get("decode_rows") else "prompt") if s.get("prompt_tokens") else "decode"
        kinds.setdefault(kind, []).append(cost.seconds(s) / s["seconds"] - 1.0)
    every = [e for errs in kinds.values() for e in errs]

    def rms(errs):
        return math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else None

    return {"rms_rel_error": rms(every),
            "by_kind": {k: {"steps": len(v), "rms_rel_error": rms(v), "mean_rel_error": sum(v) / len(v)}
                        for k, v in sorted(kinds.items())}}


def peer_shares(by_worker: dict[str, list[dict]]) -> dict[str, list[float]]:
    """For every step of every worker of one host: the fraction of its wall time during which
    another worker was mid-step (from each step's ``started`` and ``seconds``; None for steps
    recorded without ``started``)."""
    spans = {w: sorted((s["started"], s["started"] + s["seconds"]) for s in steps if s.get("started"))
             for w, steps in by_worker.items()}
    out = {}
    for w, steps in by_worker.items():
        others = sorted(iv for v, ivs in spans.items() if v != w for iv in ivs)
        starts = [a for a, _ in others]
        shares = []
        for s in steps:
            a, b = s.get("started", 0.0), s.get("started", 0.0) + s["seconds"]
            if not s.get("started") or b <= a:
                shares.append(None)
                continue
            i = max(bisect.bisect_left(starts, a) - 1, 0)  # the peer step in progress at ``a``, if any
            covered = 0.0
            while i < len(others) and others[i][0] < b:
                covered += max(0.0, min(b, others[i][1]) - max(a, others[i][0]))
                i += 1
            shares.append(min(covered / (b - a), 1.0))
        out[w] = shares
    return out


def steps_by_side(by_worker: dict[str, list[dict]]):
    """Every step of one row with its side: ``"paired"`` when a peer worker was mid-step for
    at least half of it, ``"alone"`` otherwise, None when it has no ``started`` time."""
    shares = peer_shares(by_worker)
    for w, steps in by_worker.items():
        for s, share in zip(steps, shares[w]):
            yield s, None if share is None else ("paired" if share >= 0.5 else "alone")


def row_steps(row: dict) -> dict[str, list[dict]]:
    """One bench row's recorded steps, by worker, as dicts (empty: it recorded none)."""
    fields = row.get("step_shape_fields") or ()
    return {w: [dict(zip(fields, s)) for s in steps] for w, steps in (row.get("step_shapes") or {}).items()}


def bench_step_rows(data: dict, skip: int | None = None) -> list[dict[str, list[dict]]]:
    """Each exp 7 row's recorded steps, by worker, as dicts (a bench JSON written with
    ``DASKFLOW_KV_BENCH_STEP_SHAPES=1``), but the row at ``runs[skip]``."""
    return [row_steps(r) for i, r in enumerate(data.get("runs") or ())
            if r.get("exp") == "exp7" and r.get("step_shapes") and i != skip]


def fit_in_workers(data: dict, min_steps: int = 4 * len(TERMS), skip: int | None = None) -> dict:
    """Step costs fitted on the steps exp 7's Dask workers really ran - in a loaded worker
    process, on a host the clients and scheduler share - split by whether a peer worker was
    mid-step for at least half of the step: ``{"alone", "paired": StepCost, "steps": {...}}``.
    A side with too few steps (a saturated run steps side by side nearly always) takes the
    other's fit; steps recorded without ``started`` times count only in the fit of all steps,
    which serves both when neither side has enough. ``skip``: leave out ``runs[skip]`` (to
    replay that row on a fit it did not feed)."""
    alone, paired, every = [], [], []
    for by_worker in bench_step_rows(data, skip):
        for s, side in steps_by_side(by_worker):
            every.append(s)
            if side is not None:
                (paired if side == "paired" else alone).append(s)
    if not every:
        raise ValueError("no exp 7 row carries step shapes (run the bench with DASKFLOW_KV_BENCH_STEP_SHAPES=1)")
    fit_every = fit_step_cost(every)
    fit_paired = fit_step_cost(paired) if len(paired) >= min_steps else fit_every
    fit_alone = fit_step_cost(alone) if len(alone) >= min_steps else fit_paired
    return {"alone": fit_alone, "paired": fit_paired,
            "steps": {"alone": len(alone), "paired": len(paired), "every": len(every)},
            "rms_rel_error": fit_report(fit_every, every)["rms_rel_error"]}


def row_speed(by_worker: dict[str, list[dict]], alone: StepCost, paired: StepCost) -> float | None:
    """Measured step seconds of one row over what ``alone`` / ``paired`` price its steps at:
    how slow the host ran during that row (>1: slower than the fit), apart from what work it
    did. None when the row has no steps."""
    measured = priced = 0.0
    for s, side in steps_by_side(by_worker):
        measured += s["seconds"]
        priced += (paired if side == "paired" else alone).seconds(s)
    return measured / priced if priced > 0 else None
