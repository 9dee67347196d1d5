"""The planner with its measurements: cluster views, calibration when a measurement is missing.

``policy.placement`` is pure; this part feeds it. A view is the plugin's snapshot (worker
loads, links, fitted prefill profiles) with the what-if overrides a caller set; when the
cost model raises ``NeedsCalibration`` on a cluster never calibrated, it is calibrated once
(one thread at a time) and the plan is made again on a fresh view. A worker that joined
later (a nanny's restart, a new job) is planned on estimates instead (``ClusterView.
with_fallbacks``): stopping every plan to probe a churning cluster is how a stream waits on
a worker that is gone again; its own prefills fit its profile as it works. Every
destination's decision is kept for ``explain``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..policy.cluster_view import ClusterView, median_profile
from ..policy.cost_model import Decision, NeedsCalibration, PrefillProfile
from ..policy.placement import Placement, batch_seconds, plan_placements
from .calibration import Calibrator
from .plugin_client import PluginClient
from .prefix_cache import HeldPrefix


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """Branches to place over one cached prefix (``plan_placements``' arguments)."""

    reused: Sequence[int]  # per branch: prefix tokens it can take from blocks
    new_tokens: Sequence[int]  # per branch: tokens it prefills itself
    max_new_tokens: int = 1  # each branch's decode
    policy: str = "auto"  # auto | transfer | recompute | pin
    worker: str | None = None  # every branch on this worker
    workers: Sequence[str] | None = None  # the pool branches spread over (None: every worker)


def predict_seconds(view: ClusterView, worker: str | None, reused: int, new_tokens: list[int],
                    max_new_tokens: int) -> float | None:
    """Seconds a compute task's plan expects it to run (the plugin tells later plans how long
    ``worker`` stays busy); None without a profile."""
    prof = view.profile(worker) if worker else None
    return None if prof is None else batch_seconds(prof, reused, new_tokens, max_new_tokens)


@dataclass(slots=True, eq=False)
class Planner:
    plugin: PluginClient  # answers snapshots
    calibrator: Calibrator  # measures what the cost model lacks
    bandwidth_override: float | None = None  # bytes/s for every pair (what-if, tests)
    prefill_override: PrefillProfile | None = None  # one profile for every worker (what-if, tests)
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=1024))  # one per destination, oldest first
    calibrating: threading.Lock = field(default_factory=threading.Lock)  # held while a thread calibrates
    remembered: PrefillProfile | None = None  # the last measured median: outlives the workers it came from

    def view(self, snapshot: Mapping | None = None) -> ClusterView:
        """What the planner sees now: ``snapshot`` (one that came with a lookup, ``HeldPrefix.
        snapshot``: no second round trip), else a fresh one from the plugin."""
        view = self.plugin.snapshot(self.bandwidth_override, self.prefill_override, snapshot)
        self.remembered = median_profile(view.prefill.values()) or self.remembered
        return view

    def calibrated_view(self) -> ClusterView:
        """Calibrate the cluster (links, prefill, store), then a fresh view."""
        self.calibrator.calibrate()
        return self.view()

    def place(self, view: ClusterView, held: HeldPrefix, req: PlanRequest) -> tuple[list[Placement], ClusterView]:
        """``plan_placements`` over ``held``, calibrating first if the cost model lacks a
        measurement; -> (placements, the view they were made on)."""
        args = (held.match, list(req.reused), len(req.reused), req.policy, req.worker, req.workers,
                list(req.new_tokens), req.max_new_tokens)
        try:
            return plan_placements(view, *args), view
        except NeedsCalibration:
            if not view.prefill:  # never calibrated: measure it, one thread at a time per runtime
                with self.calibrating:
                    view = self.view()  # another thread may have calibrated meanwhile
                    if not view.prefill:
                        view = self.calibrated_view()
            # Gaps left: a worker that joined since (a nanny restarted one) or died while probed.
            # Estimate them (from what was measured before, when every measured worker is gone:
            # a cluster whose workers all restart must not stop planning); its own prefills fit
            # its profile as it works.
            view = view.with_fallbacks(self.remembered)
            return plan_placements(view, *args), view

    def record(self, p: Placement) -> None:
        """Keep ``p``'s decision for ``explain``: one per destination, not per branch."""
        if p.first and p.decision is not None:
            self.decisions.append(p.decision)
