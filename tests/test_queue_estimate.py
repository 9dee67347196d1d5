"""``busy_s``, the queue placement reads: one rule for the plugin and the simulator.

Pure. The plugin's use of it on real task transitions is in
tests/plugins/test_plugin_placement.py; here the rule and the modeled worker's use of it.
"""

from __future__ import annotations

import random

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


def test_the_board_applies_the_rule_to_every_worker_with_the_same_floats():
    """``QueueBoard.busy`` (the simulator's ranking of hundreds of workers) is the scalar rule
    element for element, to the bit: a ranking must not flip on rounding."""
    import numpy as np

    from daskflow_kv.sim.worker import QueueBoard

    rng = random.Random(7)
    sent = [rng.choice([0.0, rng.uniform(0, 30)]) for _ in range(300)]
    first = [rng.choice([None, rng.uniform(0, 50)]) for _ in range(300)]
    planned = [rng.choice([0.0, rng.uniform(0, 5)]) for _ in range(300)]
    board = QueueBoard(300)
    board.sent[:] = sent
    board.first[:] = [np.nan if f is None else f for f in first]
    now = 41.3
    got = board.busy(now, np.array(planned))
    assert got.tolist() == [queued_seconds(s, f, now, p) for s, f, p in zip(sent, first, planned)]
    assert board.busy(now).tolist() == [queued_seconds(s, f, now) for s, f in zip(sent, first)]


def test_the_queue_board_ranks_as_a_sort_on_busy_then_load_then_index():
    """``QueueBoard.rank``: the modeled workers' queues, posted as requests come and go, ranked
    as ``heapq.nsmallest`` on (busy, load, index) would, over all workers or some, less some."""
    import heapq

    import numpy as np

    from daskflow_kv.sim.worker import QueueBoard

    loop = EventLoop()
    board = QueueBoard(4)
    ws = [ModeledWorker(i, PrefillProfile(0.5, 0.01, 0.0), loop, board=board) for i in range(4)]
    loop.at(1.0, ws[2].submit, Request(1, 100, 0, 0, 3.0, lambda r: None))
    loop.at(1.0, ws[3].submit, Request(2, 10, 0, 0, 3.0, lambda r: None))
    seen = []
    loop.at(1.2, lambda: seen.append((board.sent.tolist(), board.load.tolist(), np.isnan(board.first).tolist())))
    loop.run()
    assert seen == [([0.0, 0.0, 3.0, 3.0], [0, 0, 1, 1], [True, True, False, False])]
    assert board.load.tolist() == [0] * 4 and board.sent.tolist() == [0.0] * 4  # posted again as they finished

    rng = random.Random(3)
    board = QueueBoard(40)
    board.load[:] = [rng.randint(0, 2) for _ in range(40)]
    busy = np.array([rng.choice([0.0, 1.0, rng.uniform(0, 2)]) for _ in range(40)])
    key = lambda i: (busy[i], board.load[i], i)  # noqa: E731
    assert board.rank(busy, 5) == heapq.nsmallest(5, range(40), key=key)
    some = set(rng.sample(range(40), 15))
    assert board.rank(busy, 4, some) == heapq.nsmallest(4, some, key=key)
    assert board.rank(busy, 6, exclude={0, 1, 2}) == heapq.nsmallest(6, set(range(40)) - {0, 1, 2}, key=key)
