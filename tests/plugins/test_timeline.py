"""The live plots' series (``kv_timeline``), from histories built with explicit clocks."""

from __future__ import annotations

import json
import math

import pytest

from daskflow_kv.plugins.dashboard import plots
from daskflow_kv.plugins.kv_timeline import (KEEP_S, MAX_TTFTS, SAMPLE_S, WINDOW_S, KVTimeline, workflow_report)


def _take(tl: KVTimeline, at: float, steps=None, total=None, tokens=None, kv=None) -> None:
    tl.sample(at, kv or {"w0": 0}, steps or {}, total or {}, tokens or {})


def test_rates_and_percentiles_cover_the_trailing_window_only():
    tl = KVTimeline()
    reports = {105.0: [1.0, 9.0], 175.0: [2.0], 178.0: [4.0]}
    for i in range(16):  # a sample every 10 s, t = 100 .. 250
        t = 100.0 + 10 * i
        for at, ttfts in reports.items():
            if t - 10 < at <= t:
                tl.workflow_done(at, None, len(ttfts), ttfts)
        _take(tl, t)
    s = tl.series()
    at = {t: i for i, t in enumerate(s["t"])}
    assert s["workflows_per_min"][at[110.0]] == pytest.approx(6.0)  # a young history: over the 10 s it spans
    i = at[160.0]  # window (100, 160]: the first workflow alone
    assert s["workflows_per_min"][i] == pytest.approx(1.0)
    assert s["ttft_p50_s"][i] == pytest.approx(5.0) and s["ttft_p95_s"][i] == pytest.approx(8.6)
    i = at[180.0]  # window (120, 180]: the two later ones
    assert s["workflows_per_min"][i] == pytest.approx(2.0) and s["ttft_p50_s"][i] == pytest.approx(3.0)
    i = at[250.0]  # window (190, 250]: none
    assert s["workflows_per_min"][i] == 0 and s["ttft_p50_s"][i] is None and s["ttft_p95_s"][i] is None
    assert tl.received() == 3 and tl.held() == 0  # nothing left that a later window could read


def test_the_left_edge_stays_right_once_the_history_rolls_over():
    tl = KVTimeline()
    t = 0.0
    while t <= KEEP_S + 120:  # one workflow every sample: 30 per minute throughout
        tl.workflow_done(t, None, 1, [1.0])
        _take(tl, t)
        t += SAMPLE_S
    s = tl.series()
    assert s["t"][0] >= s["t"][-1] - KEEP_S
    assert all(r == pytest.approx(30.0) for r in s["workflows_per_min"])


def test_hit_rate_is_the_windows_reused_share_of_prompt_tokens_per_namespace():
    tl = KVTimeline()
    tokens = [{"a": (0, 0), "b": (0, 0)}, {"a": (30, 10), "b": (0, 100)}, {"a": (30, 10), "b": (0, 100)},
              {"a": (130, 10), "b": (0, 100)}]
    for t, tk in zip((0.0, 30.0, 70.0, 100.0), tokens):
        _take(tl, t, tokens=tk)
    a = tl.series("a", everyone=False)
    assert a["hit_rate"][0] is None  # no interval yet
    assert a["hit_rate"][1] == pytest.approx(30 / 40)
    # Counted from the last sample before the window: (10, 70] reads from t = 0, (40, 100] from t = 30.
    assert a["hit_rate"][2] == pytest.approx(30 / 40) and a["hit_rate"][3] == pytest.approx(1.0)
    b = tl.series("b", everyone=False)
    assert b["hit_rate"][1] == 0.0 and b["hit_rate"][3] is None  # no prompt token of b's after t = 30
    assert tl.series()["hit_rate"][1] == pytest.approx(30 / 140)


def test_a_tenant_counts_only_its_own_workflows_and_timings_can_be_left_out():
    tl = KVTimeline()
    _take(tl, 10.0)
    tl.workflow_done(11.0, "a", 1, [7.25])
    tl.workflow_done(11.5, "b", 1, [3.5])
    _take(tl, 12.0)
    assert tl.series("a", everyone=False)["ttft_p50_s"][1] == 7.25
    assert tl.series("b", everyone=False)["ttft_p50_s"][1] == 3.5
    assert tl.series("c", everyone=False)["workflows_per_min"][1] == 0
    assert tl.series()["ttft_p50_s"][1] == pytest.approx(5.375)
    totals = tl.series(timings=False)
    assert totals["ttft_p50_s"] == [None, None] and totals["workflows_per_min"][1] > 0


def test_batch_is_each_workers_mean_batch_per_step_between_samples():
    tl = KVTimeline()
    steps = [{"w0": 10, "w1": 0}, {"w0": 20, "w1": 0}, {"w0": 20, "w1": 4}, {"w0": 3, "w1": 8}]
    total = [{"w0": 10, "w1": 0}, {"w0": 50, "w1": 0}, {"w0": 50, "w1": 4}, {"w0": 9, "w1": 40}]
    for i, (st, tt) in enumerate(zip(steps, total)):
        _take(tl, 2.0 * i, steps=st, total=tt, kv={"w0": 100 * i, "w1": 7})
    w = tl.series()["workers"]
    assert w["w0"]["batch"] == [None, 4.0, 0.0, 0.0]  # idle interval: 0; a restarted loop: not a batch
    assert w["w1"]["batch"] == [None, 0.0, 1.0, 9.0]
    assert w["w0"]["kv_bytes"] == [0, 100, 200, 300] and w["w1"]["kv_bytes"] == [7, 7, 7, 7]


@pytest.mark.parametrize("args", [(0, []), (True, []), (2, [1.0, 2.0, 3.0]), (2, [math.inf]), (2, [-1.0]),
                                  (2, "12"), ("2", [1.0]), (2, [True])])
def test_a_bad_workflow_report_is_refused(args):
    with pytest.raises(ValueError):
        workflow_report(*args)


def test_one_tenant_cannot_push_out_anothers_workflows():
    tl = KVTimeline()
    tl.workflow_done(0.0, "quiet", 1, [0.5])
    for _ in range(MAX_TTFTS // 8 + 10):
        tl.workflow_done(1.0, "noisy", 8, [0.1] * 8)
    assert tl.held() == MAX_TTFTS // 8 + 1  # the noisy ring bounded by its TTFTs, the quiet one kept
    assert tl.due(0.0)
    _take(tl, 5.0)
    assert not tl.due(5.0 + SAMPLE_S / 2) and tl.due(5.0 + SAMPLE_S)
    assert tl.series("quiet", everyone=False)["ttft_p50_s"] == [0.5]
    _take(tl, WINDOW_S + 2.0)  # both rings out of every window to come: dropped
    assert tl.held() == 0


def test_the_plots_columns_are_json_and_the_layout_carries_the_series():
    tl = KVTimeline()
    for i in range(3):
        if i == 1:
            tl.workflow_done(1001.0, None, 1, [0.25])
        _take(tl, 1000.0 + 2 * i, steps={"a": i}, total={"a": 3 * i}, kv={"a": i, "b": 2})
    s = tl.series()
    cols = plots.columns(s, {"a": "w0", "b": "w1"})
    text = json.dumps(cols, allow_nan=False)  # what /kv/api.json?html=1 sends: no NaN a browser refuses
    assert json.loads(text)[plots.SERIES]["ttft_p50_s"] == [None, 0.25, 0.25]
    assert cols[plots.SERIES]["t"] == [1000000.0, 1002000.0, 1004000.0]
    batch = cols["kv-batch"]
    assert batch["worker"] == ["w0", "w1"] and batch["ys"][0] == [None, 3.0, 3.0] and cols["kv-bytes"]["ys"][1] == [2, 2, 2]
    if not plots.available():
        pytest.skip("bokeh is not installed")
    item = json.dumps(plots.layout_item(s, {"a": "w0", "b": "w1"}), allow_nan=False)  # NaN encoded Bokeh's way
    for name in (plots.SERIES, *plots.WORKERS):
        assert f'"name":"{name}"' in item.replace(" ", "")
