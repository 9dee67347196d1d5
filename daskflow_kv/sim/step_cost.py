"""What a modeled step costs, fitted on the step loop's own measured steps.

A step of the worker's step loop (``model.step_engine``) may mix prompt chunks of some
requests with decode rows of many others, copy the prefixes of requests that join, and cut
the blocks of requests that leave. ``benchmarks/step_cost.py`` records such steps
(``model.step_shape.StepShape``: what was fed, and the wall time) and this module fits one
linear cost per term by non-negative least squares on relative error (the terms and the
fit are ``policy.step_cost``'s, which the emulated engine prices its steps with too); here,
what fits and prices the steps of bench rows, split by whether a peer worker of the host
was mid-step. Pure: plain dicts in (the records as JSON holds them).
"""

from __future__ import annotations

import bisect

from ..policy.step_cost import TERMS, StepCost, features, fit_report, fit_step_cost  # noqa: F401 -- re-exported


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
