"""Exp 7's measured rows beside their simulation (MODELED), for the run just made: the log
lines and the SUMMARY section. The simulation itself is ``sim.beside.simulate`` (the
simulator sits above the bench), handed to ``bench.run.main`` by ``daskflow-kv bench``.

After a run with exp 7 rows the bench replays each of them with ``daskflow_kv.sim``'s
fidelity check on the run's own fitted profile: the prefill profiles it ended on, its
workers' step costs when it recorded step shapes (each row priced by a fit on the others;
``daskflow-kv simulate --profile-from X --step-cost X`` does the same), and a ``local``
row's router priced with what it priced with in the run. The bench prints a line per row
and keeps the rows in its JSON (``exp7_modeled``) and SUMMARY, so a reader sees at once
where the model and the measurement part.
"""

from __future__ import annotations

import math

from .load_stream import gate_label

METRICS = (("completed_per_min", "workflows/min", "{:.1f}"), ("latency_p95_s", "p95 s", "{:.1f}"),
           ("tokens_prefilled", "tokens prefilled", "{:,.0f}"))


def line(r: dict) -> str:
    """One row, measured beside MODELED, for the bench's log."""
    return f"exp7 {_stream(r)} r{r['rep']} {r['system']}: " + "; ".join(
        f"{name} {_cell(r[m], fmt, ' measured, ', ' MODELED')}" for m, name, fmt in METRICS)


def lines(doc: dict) -> list[str]:
    """The SUMMARY section: one table row per measured row (nothing when the run had none)."""
    modeled = doc.get("exp7_modeled") or {}
    if not modeled and not doc.get("exp7_modeled_error"):
        return []
    out = ["## Exp 7 beside its simulation (MODELED)", ""]
    if doc.get("exp7_modeled_error"):
        return out + [f"Not simulated: {doc['exp7_modeled_error']}", ""]
    steps = ("steps priced by what this run's workers measured, each row by a fit on the others"
             if modeled["steps_in_place"] else
             "no step shapes recorded, so a step costs its prefill and decode terms added up, which a Dask "
             "worker's steps exceed (docs/simulation_log.md, 2026-12-03)")
    out += ["Each exp 7 row replayed by `daskflow_kv.sim` on this run's own fitted profile (docs/simulation.md): "
            f"{modeled['profile']}; {steps}. Error: (MODELED - measured) / measured.", "",
            "| system | stream | rep | " + " | ".join(f"{n} measured / MODELED (error)" for _, n, _ in METRICS) + " |",
            "|---|---|---|" + "---|" * len(METRICS)]
    for r in modeled["rows"]:
        out.append(f"| {r['system']} | {_stream(r)} | {r['rep']} | "
                   + " | ".join(_cell(r[m], fmt) for m, _, fmt in METRICS) + " |")
    return out + [""]


def _stream(r: dict) -> str:
    """A row's stream, and its workflow gate where it had one."""
    return r["stream"] + gate_label(r.get("workflow_gate"))


def _cell(x: dict, fmt: str, between: str = " / ", after: str = "") -> str:
    """``measured<between>MODELED<after> (error)`` of one metric of a fidelity row."""
    err = "n/a" if x["error"] is None else f"{100 * x['error']:+.0f} %"
    return f"{_f(x['measured'], fmt)}{between}{_f(x['simulated'], fmt)}{after} ({err})"


def _f(v, fmt: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)
