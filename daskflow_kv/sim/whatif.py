"""What-ifs over one grid point: a knob swept, each system at the setting that suits it best.

A ratio of two systems at one shared setting of a knob (the workflow gate) flatters whichever
system that setting suits: past its own best gate `local`'s caches thrash while the shared
tier still gains. The fair question is each system at its own best setting, on the same
draws of the stream. Plain functions on grid rows (``report.simulate_grid``'s), MODELED.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from .report import LABEL


def by_draw(rows: Sequence[dict], system: str) -> dict[int, float]:
    """Throughput of ``system`` per draw of the stream (``seed``) in one sweep point's rows."""
    return {r.get("seed", 0): r["completed_per_min"] for r in rows if r["system"] == system}


def best_setting(points: Mapping[object, Sequence[dict]], system: str) -> object:
    """The knob's setting under which ``system``'s median throughput over the draws is highest."""
    return max(points, key=lambda k: statistics.median(by_draw(points[k], system).values()))


def each_at_its_best(points: Mapping[object, Sequence[dict]], a: str = "daskflow-kv", b: str = "local") -> dict:
    """``a`` / ``b`` throughput with each system at its own best setting of the swept knob,
    draw by draw (both settings ran the same draws): the median ratio and its range."""
    best_a, best_b = best_setting(points, a), best_setting(points, b)
    ta, tb = by_draw(points[best_a], a), by_draw(points[best_b], b)
    draws = sorted(set(ta) & set(tb))
    if not draws:
        raise ValueError("the two settings share no draw of the stream")
    ratio = [ta[d] / tb[d] for d in draws]
    return {"label": LABEL, "best": {a: best_a, b: best_b},
            "throughput": {a: statistics.median(ta[d] for d in draws), b: statistics.median(tb[d] for d in draws)},
            "throughput_ratio": statistics.median(ratio), "throughput_ratios": ratio,
            "throughput_ratio_min": min(ratio), "throughput_ratio_max": max(ratio), "draws": len(draws)}
