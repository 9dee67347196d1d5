"""Exp 7's measured rows beside their simulation (MODELED), for the run just made.

After a run with exp 7 rows the bench replays each of them with ``daskflow_kv.sim`` - the
same fidelity check ``daskflow-kv simulate --profile-from <this run>`` makes: the run's own
fitted profile (the prefill profiles it ended on; its workers' step costs when it recorded
step shapes, each row priced by a fit on the others), and a ``local`` row's router pricing
with what it priced with in the run. The bench prints a line per row and keeps the rows in
its JSON (``exp7_modeled``) and SUMMARY, so a reader sees at once where the model and the
measurement part.
"""

from __future__ import annotations

import json
from pathlib import Path

SYSTEMS = ("daskflow-kv", "local")
METRICS = (("completed_per_min", "workflows/min", "{:.1f}"), ("latency_p95_s", "p95 s", "{:.1f}"),
           ("tokens_prefilled", "tokens prefilled", "{:,.0f}"))


def replay(path: str | Path) -> dict:
    """``{"profile": where its prices come from, "rows": sim.report.fidelity rows}`` for every
    exp 7 row of the bench JSON at ``path``."""
    from ..sim.profile import fitted_profile
    from ..sim.report import fidelity
    from ..sim.step_cost import bench_step_rows

    profile = fitted_profile(path)
    if bench_step_rows(json.loads(Path(path).read_text())):
        profile = profile.with_step_costs(path)
    return {"profile": profile.source, "rows": fidelity(path, profile, SYSTEMS)}


def line(r: dict) -> str:
    """One row, measured beside MODELED, for the bench's log."""
    parts = []
    for m, name, fmt in METRICS:
        x = r[m]
        err = "" if x["error"] is None else f" ({100 * x['error']:+.0f} %)"
        parts.append(f"{name} {_f(x['measured'], fmt)} measured, {_f(x['simulated'], fmt)} MODELED{err}")
    return f"exp7 {r['stream']} r{r['rep']} {r['system']}: " + "; ".join(parts)


def lines(doc: dict) -> list[str]:
    """The SUMMARY section: one table row per measured row (nothing when the run had none)."""
    modeled = doc.get("exp7_modeled") or {}
    if not modeled and not doc.get("exp7_modeled_error"):
        return []
    out = ["## Exp 7 beside its simulation (MODELED)", ""]
    if doc.get("exp7_modeled_error"):
        return out + [f"Not simulated: {doc['exp7_modeled_error']}", ""]
    rows = modeled["rows"]
    out += ["Each exp 7 row replayed by `daskflow_kv.sim` on this run's own fitted profile, as `daskflow-kv simulate "
            f"--profile-from` this JSON does (docs/simulation.md); prices: {modeled['profile']}. Without recorded "
            "step shapes a step costs its prefill and decode terms added up, which a Dask worker's steps exceed "
            "(docs/simulation.md, 2026-12-03). Error: (MODELED - measured) / measured.", ""]
    out += ["| system | stream | rep | " + " | ".join(f"{n} measured / MODELED (error)" for _, n, _ in METRICS) + " |",
            "|---|---|---|" + "---|" * len(METRICS)]
    for r in rows:
        cells = []
        for m, _, fmt in METRICS:
            x = r[m]
            err = "n/a" if x["error"] is None else f"{100 * x['error']:+.0f} %"
            cells.append(f"{_f(x['measured'], fmt)} / {_f(x['simulated'], fmt)} ({err})")
        out.append(f"| {r['system']} | {r['stream']} | {r['rep']} | " + " | ".join(cells) + " |")
    return out + [""]


def _f(v, fmt: str) -> str:
    return "n/a" if v is None else fmt.format(v)
