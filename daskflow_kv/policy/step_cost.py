"""What a step of the step loop costs, by what it mixes: one linear cost per term.

A step of a worker's step loop (``model.step_engine``) may mix prompt chunks of some
requests with decode rows of many others, copy the prefixes of requests that join, and cut
the blocks of requests that leave (``model.step_shape.StepShape``):

    fixed + prompt_fixed [any prompt row] + per_prompt_token n + per_attn n (p + n/2)
          + per_row r + per_key (cached tokens of the r rows)
          + per_join j + per_loaded (prefix tokens copied in) + per_finish f + per_exported (tokens cut)

``fit_step_cost`` fits the terms on recorded steps (non-negative least squares on relative
error). The simulator prices modeled steps with a fit (``sim.step_cost``); an emulated
engine sleeps what a profile's terms price its steps at (``model.emulated_profile``).
Pure: plain dicts in (as a ``StepShape.as_dict()`` or its JSON holds them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .cost_model import least_squares

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
