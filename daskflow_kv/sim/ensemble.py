"""The model's own spread beside the measured one: each exp 7 row replayed many times, every
modeled step's time drawn around its price as scattered as the measured steps are around the
same fit (``SimProfile.noisy``), against every measurement of that row. Pure but for the
simulations: bench JSONs and a profile in, plain rows out. MODELED.

Why: a per-row check holds one modeled number against one measured one, but under saturation
a row's outcome turns on timing (``repeatability``: two runs of the same ``local`` rows
prefilled up to half as much again). If the model is right, its draws spread as the
measurements do and cover them, and its median sits near theirs; if it is wrong, no spread
hides that.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from . import repeatability
from .report import LABEL, METRICS, measured_totals, replays, spread


def replay(path: str | Path, profile, draws: int, systems=("daskflow-kv", "local"), also=()) -> list[dict]:
    """Every exp 7 row of ``path`` replayed ``draws`` times with step noise (seeds 0 ..
    draws - 1); measured: the row in ``path`` and the same row (``repeatability.row_key``:
    the same workflows) in each of ``also``, other runs' rows as ``repeatability.matching``
    gives them. Per metric: the modeled min / median / max, the measured values, how many of
    them lie within the modeled range, and the modeled median's relative error against the
    measured median."""
    if draws < 2:
        raise ValueError(f"draws must be at least 2, got {draws}")
    out = []
    for case in replays(path, profile, systems):
        r = case.row
        key = repeatability.row_key(r)
        measured = [measured_totals(r)] + [o[key] for o in also if key in o]
        sims = [case.run(case.profile.noisy(seed)) for seed in range(draws)]
        row = {"label": LABEL, "system": case.system, "stream": case.stream, "rate": r["rate"],
               "rep": r.get("rep", 0), "draws": draws, "step_noise": case.profile.step_scatter,
               "measurements": len(measured)}
        for m in METRICS:
            modeled = sorted(s[m] for s in sims)
            values = [x[m] for x in measured if x.get(m) is not None]
            if not values:
                continue
            mid, meas_mid = statistics.median(modeled), statistics.median(values)
            row[m] = {"modeled_min": modeled[0], "modeled_median": mid, "modeled_max": modeled[-1],
                      "measured": values, "covered": sum(modeled[0] <= v <= modeled[-1] for v in values),
                      "median_error": (mid - meas_mid) / meas_mid if meas_mid else None}
        out.append(row)
    return out


def summary(rows: list[dict], tolerance: float = 0.10) -> list[dict]:
    """Per system and metric: the ``spread`` of the modeled medians' errors over the rows, and
    how many measurements fell within the modeled range (``covered`` of ``measured``)."""
    out = []
    for system in sorted({r["system"] for r in rows}):
        mine = [r for r in rows if r["system"] == system]
        for m in METRICS:
            have = [r[m] for r in mine if m in r and r[m]["median_error"] is not None]
            if have:
                out.append({"system": system, "metric": m, "covered": sum(x["covered"] for x in have),
                            "measured": sum(len(x["measured"]) for x in have)}
                           | spread([x["median_error"] for x in have], tolerance))
    return out
