"""``busy_s``, the queue placement reads: one rule for the plugin and the simulator.

Pure. The plugin's use of it on real task transitions is in
tests/plugins/test_plugin_placement.py; here the rule and the modeled worker's use of it.
"""

from __future__ import annotations

import pytest

from daskflow_kv.policy.cost_model import PrefillProfile
from daskflow_kv.policy.queue_estimate import queued_seconds
from daskflow_kv.sim.loop import EventLoop
from daskflow_kv.sim.worker import ModeledWorker, Request


def test_sent_work_comes_off_as_time_passes_and_planned_work_counts_whole():
    assert queued_seconds(0.0, None, 100.0) == 0.0
    assert queued_seconds(0.0, None, 100.0, planned_s=4.0) == 4.0  # nothing sent: what waits for inputs
    assert queued_seconds(8.0, 100.0, 103.0) == pytest.approx(5.0)
    assert queued_seconds(8.0, 100.0, 103.0, planned_s=2.0) == pytest.approx(7.0)
    assert queued_seconds(8.0, 100.0, 120.0, planned_s=2.0) == 2.0  # late work never goes negative


def test_a_modeled_worker_reports_the_busy_seconds_the_plugin_would():
    """Two requests predicted at 3 s each: 6 s queued as they arrive, less the time since the
    first arrived while they run, 0 once both are done (the prediction need not be right)."""
    loop = EventLoop()
    w = ModeledWorker(0, PrefillProfile(0.5, 0.01, 0.0), loop)
    seen = []
    for rid in (1, 2):
        loop.at(1.0, w.submit, Request(rid, 100, 0, 0, 3.0, lambda r: None))
    for t in (1.0, 1.5):
        loop.at(t, lambda: seen.append((loop.now, w.busy_s(), w.queued_s)))
    loop.run()
    assert seen[0] == (1.0, pytest.approx(6.0), pytest.approx(6.0))
    assert seen[1][1] == pytest.approx(5.5) and seen[1][2] == pytest.approx(6.0)  # the router's view keeps it whole
    assert w.busy_s() == 0.0 and w.queued_s == 0.0 and w.first_sent is None
