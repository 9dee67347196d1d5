"""How far two measurements of the same exp 7 rows lie apart: the noise floor of a per-row
fidelity check. Pure: bench JSONs in, plain rows out.

A row is the same row in both runs when system, stream, rate and repetition match: the
arrival seed is ``int(rate * 1000) + rep`` and the documents are fixed, so both runs offered
the same workflows at the same times. What differs is the host and the timing: under
saturation the ``local`` router's choice between a busy worker holding a document and an
idle one without it flips on tenths of a second, and each flip prefills a whole document
more or less. When two runs of one row differ by more than a tolerance, no model that
returns one number per row can be within that tolerance of both.
"""

from __future__ import annotations

import json
from pathlib import Path

from .report import BENCH_NAMES, METRICS, measured_totals, spread

CONFIG = ("model", "workers", "max_new_tokens", "exp7_workflows", "exp7_docs", "exp7_context", "exp7_budget_fraction")


def row_key(r: dict) -> tuple:
    """(system, stream, rate, repetition) of a measured exp 7 row: the same workflows in any run."""
    return BENCH_NAMES.get(r["system"], r["system"]), r.get("stream", "uniform"), float(r["rate"]), int(r.get("rep", 0))


def rows(data: dict) -> dict[tuple, dict]:
    """A bench JSON's exp 7 rows that ran, by ``row_key``."""
    return {row_key(r): measured_totals(r) for r in data.get("runs", []) if r.get("exp") == "exp7" and "error" not in r}


def matching(first: str | Path, second: str | Path) -> tuple[dict, dict]:
    """Both runs' exp 7 rows (``rows``), refused in one line unless they measured the same
    streams and have a row in common."""
    da, db = (json.loads(Path(p).read_text()) for p in (first, second))
    differ = [k for k in CONFIG if (da.get("config") or {}).get(k) != (db.get("config") or {}).get(k)]
    if differ:
        raise ValueError(f"{first} and {second} measured different exp 7 streams ({', '.join(differ)} differ)")
    a, b = rows(da), rows(db)
    if not a.keys() & b.keys():
        raise ValueError(f"{first} and {second} have no exp 7 row in common (system, stream, rate and repetition)")
    return a, b


def compare(first: str | Path, second: str | Path) -> list[dict]:
    """Every exp 7 row both runs measured: each metric's value in both and the relative
    difference ``(second - first) / first``."""
    a, b = matching(first, second)
    out = []
    for key in sorted(a.keys() & b.keys()):
        system, stream, rate, rep = key
        row = {"system": system, "stream": stream, "rate": rate, "rep": rep}
        for m in METRICS:
            x, y = a[key].get(m), b[key].get(m)
            row[m] = {"first": x, "second": y, "difference": (y - x) / x if x and y is not None else None}
        out.append(row)
    return out


def summary(rows: list[dict], tolerance: float = 0.10) -> list[dict]:
    """Per system and metric: the ``spread`` of the differences over the rows."""
    out = []
    for system in sorted({r["system"] for r in rows}):
        for m in METRICS:
            d = [r[m]["difference"] for r in rows if r["system"] == system and r[m]["difference"] is not None]
            if d:
                out.append({"system": system, "metric": m} | spread(d, tolerance))
    return out
