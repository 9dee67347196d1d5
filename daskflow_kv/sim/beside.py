"""A bench run's exp 7 rows beside their simulation (MODELED): what ``daskflow-kv bench``
hands the bench to print and keep (``bench.exp7_modeled`` formats it)."""

from __future__ import annotations

import json
from pathlib import Path

SYSTEMS = ("daskflow-kv", "local")


def simulate(path: str | Path) -> dict:
    """``{"profile": where its prices come from, "steps_in_place": bool, "rows": fidelity rows}``
    for every exp 7 row of the bench JSON at ``path``."""
    from .profile import fitted_profile
    from .report import fidelity
    from .step_cost import bench_step_rows

    profile = fitted_profile(path)
    in_place = bool(bench_step_rows(json.loads(Path(path).read_text())))
    if in_place:
        profile = profile.with_step_costs(path)
    return {"profile": profile.source, "steps_in_place": in_place, "rows": fidelity(path, profile, SYSTEMS)}
