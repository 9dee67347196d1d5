"""The model's own spread beside the measured one: each exp 7 row replayed many times, every
modeled step's time drawn around its price as scattered as the measured steps are around the
same fit (``SimProfile.noisy``), against the run's measurement of that row, for every run
given. Pure but for the simulations: bench JSONs and a profile in, plain rows out. MODELED.

Why: a per-row check holds one modeled number against one measured one, but under saturation
a row's outcome turns on timing (``repeatability``: two runs of the same ``local`` rows
prefilled up to half as much again). If the model is right, its draws spread as the
measurements do and cover them, and its medians' errors average out over rows and runs; if
it is wrong, no spread hides that. Each run is replayed with its own workflows, host load
and, where known, its ``local`` router's prices: the same rows of two runs are not the same
input when their routers priced differently.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .report import LABEL, METRICS, measured_totals, replays, spread


def replay(paths, profile, draws: int, systems=("daskflow-kv", "local"), router_prices: str = "as-run") -> list[dict]:
    """Every exp 7 row of each run in ``paths`` replayed ``draws`` times with step noise (seeds
    0 .. draws - 1), held against that run's measurement of it: that run's workflows and host
    load, and a ``local`` row's router pricing as ``router_prices`` says (``report.replays``;
    ``as-run``: as the run's router did where that is known, which differs from run to run);
    the steps are priced by ``profile`` for every run. Per metric: the modeled min / median /
    max, the measured value, whether it lies within the modeled range, and the modeled
    median's relative error against it."""
    if draws < 2:
        raise ValueError(f"draws must be at least 2, got {draws}")
    out = []
    for path in paths:
        for case in replays(path, profile, systems, router_prices):
            r = case.row
            measured = measured_totals(r)
            sims = [case.run(case.profile.noisy(seed)) for seed in range(draws)]
            row = {"label": LABEL, "run": Path(path).name, "system": case.system, "stream": case.stream,
                   "rate": r["rate"], "rep": r.get("rep", 0), "draws": draws, "step_noise": case.profile.step_scatter,
                   # a ``local`` router priced with prices from its run (its record or calibration), not the model's
                   "router_from_run": case.profile.router is not None}
            for m in METRICS:
                value = measured.get(m)
                if value is None:
                    continue
                modeled = sorted(s[m] for s in sims)
                mid = statistics.median(modeled)
                row[m] = {"modeled_min": modeled[0], "modeled_median": mid, "modeled_max": modeled[-1],
                          "measured": value, "covered": modeled[0] <= value <= modeled[-1],
                          "median_error": (mid - value) / value if value else None}
            out.append(row)
    return out


def summary(rows: list[dict], tolerance: float = 0.10) -> list[dict]:
    """Per system and metric: the ``spread`` of the modeled medians' errors over the rows, and
    how many measured values fell within the modeled range (``covered`` of ``measured``); for
    ``local``, also over the rows whose router priced with prices from its run (``rows_of: "run"``)."""
    out = []
    for system in sorted({r["system"] for r in rows}):
        mine = [r for r in rows if r["system"] == system]
        known = [r for r in mine if r.get("router_from_run")]
        for subset, which in ((mine, "all"), (known, "run")):
            if which == "run" and not known:
                continue
            for m in METRICS:
                have = [r[m] for r in subset if m in r and r[m]["median_error"] is not None]
                if have:
                    out.append({"system": system, "rows_of": which, "metric": m,
                                "covered": sum(x["covered"] for x in have), "measured": len(have)}
                               | spread([x["median_error"] for x in have], tolerance))
    return out
