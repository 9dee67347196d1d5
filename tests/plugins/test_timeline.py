"""The live plots' series (``kv_timeline``), as plain functions of constructed histories."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from daskflow_kv.plugins.dashboard import plots
from daskflow_kv.plugins.kv_timeline import (KEEP_S, MAX_WORKFLOWS, SAMPLE_S, WINDOW_S, KVTimeline, Sample,
                                             WorkflowDone, percentile, series, workflow_report)


def _sample(at, steps=None, total=None, tokens=None, kv=None):
    return Sample(at, kv or {"w0": 0}, steps or {}, total or {}, tokens or {})


def test_rates_and_percentiles_cover_the_trailing_window_only():
    samples = [_sample(100.0 + 10 * i) for i in range(16)]  # t = 100 .. 250
    done = [WorkflowDone(105.0, None, 2, 3.0, (1.0, 9.0)),
            WorkflowDone(175.0, None, 1, 2.0, (2.0,)), WorkflowDone(178.0, None, 1, 2.0, (4.0,))]
    s = series(done, samples)
    at = {t: i for i, t in enumerate(s["t"])}
    i = at[110.0]  # a young history: the rate is over the 10 s it spans
    assert s["workflows_per_min"][i] == pytest.approx(6.0)
    i = at[160.0]  # window (100, 160]: the first workflow alone
    assert s["workflows_per_min"][i] == pytest.approx(1.0)
    assert s["ttft_p50_s"][i] == pytest.approx(5.0) and s["ttft_p95_s"][i] == pytest.approx(8.6)
    i = at[180.0]  # window (120, 180]: the two later ones
    assert s["workflows_per_min"][i] == pytest.approx(2.0)
    assert s["ttft_p50_s"][i] == pytest.approx(3.0)
    i = at[250.0]  # window (190, 250]: none
    assert s["workflows_per_min"][i] == 0 and s["ttft_p50_s"][i] is None and s["ttft_p95_s"][i] is None


def test_hit_rate_is_the_windows_reused_share_of_prompt_tokens_per_namespace():
    tokens = [{"a": (0, 0), "b": (0, 0)}, {"a": (30, 10), "b": (0, 100)}, {"a": (30, 10), "b": (0, 100)},
              {"a": (130, 10), "b": (0, 100)}]
    samples = [_sample(t, tokens=tk) for t, tk in zip((0.0, 30.0, 70.0, 100.0), tokens)]
    a = series([], samples, "a", everyone=False)
    assert a["hit_rate"][0] is None  # no interval yet
    assert a["hit_rate"][1] == pytest.approx(30 / 40)
    # Counted from the last sample before the window: (10, 70] reads from t = 0, (40, 100] from t = 30.
    assert a["hit_rate"][2] == pytest.approx(30 / 40)
    assert a["hit_rate"][3] == pytest.approx(100 / 100)
    b = series([], samples, "b", everyone=False)
    assert b["hit_rate"][1] == 0.0 and b["hit_rate"][3] is None  # no prompt token of b's after t = 30
    everyone = series([], samples)
    assert everyone["hit_rate"][1] == pytest.approx(30 / 140)


def test_a_tenant_counts_only_its_own_workflows():
    samples = [_sample(10.0), _sample(12.0)]
    done = [WorkflowDone(11.0, "a", 1, 1.0, (7.25,)), WorkflowDone(11.5, "b", 1, 1.0, (3.5,))]
    assert series(done, samples, "a", everyone=False)["ttft_p50_s"][1] == 7.25
    assert series(done, samples, "b", everyone=False)["ttft_p50_s"][1] == 3.5
    assert series(done, samples)["ttft_p50_s"][1] == pytest.approx(5.375)


def test_batch_is_each_workers_mean_batch_per_step_between_samples():
    steps = [{"w0": 10, "w1": 0}, {"w0": 20, "w1": 0}, {"w0": 20, "w1": 4}, {"w0": 3, "w1": 8}]
    total = [{"w0": 10, "w1": 0}, {"w0": 50, "w1": 0}, {"w0": 50, "w1": 4}, {"w0": 9, "w1": 40}]
    samples = [_sample(2.0 * i, steps=s, total=t, kv={"w0": 100 * i, "w1": 7}) for i, (s, t) in
               enumerate(zip(steps, total))]
    w = series([], samples)["workers"]
    assert w["w0"]["batch"] == [None, 4.0, 0.0, 0.0]  # idle interval: 0; a restarted loop: not a batch
    assert w["w1"]["batch"] == [None, 0.0, 1.0, 9.0]
    assert w["w0"]["kv_bytes"] == [0, 100, 200, 300] and w["w1"]["kv_bytes"] == [7, 7, 7, 7]


@pytest.mark.parametrize("args", [(0, 1.0, []), (True, 1.0, []), (2, -1.0, []), (2, math.nan, []),
                                  (2, 1.0, [1.0, 2.0, 3.0]), (2, 1.0, [math.inf]), (2, 1.0, "12"),
                                  (2, "1", [1.0])])
def test_a_bad_workflow_report_is_refused(args):
    with pytest.raises(ValueError):
        workflow_report(*args)


def test_one_tenant_cannot_push_out_anothers_workflows_and_old_ones_go():
    tl = KVTimeline()
    tl.workflow_done(0.0, "quiet", 1, 1.0, [0.5])
    for i in range(MAX_WORKFLOWS + 10):
        tl.workflow_done(1.0, "noisy", 1, 1.0, [0.1])
    assert tl.recorded() == MAX_WORKFLOWS + 1
    assert tl.due(0.0)
    tl.sample(_sample(5.0))
    assert not tl.due(5.0 + SAMPLE_S / 2) and tl.due(5.0 + SAMPLE_S)
    assert tl.series("quiet", everyone=False)["ttft_p50_s"] == [0.5]
    tl.sample(_sample(KEEP_S + WINDOW_S + 2.0))  # everything reported before the kept history ends
    assert tl.recorded() == 0


def test_percentile_agrees_with_numpy():
    rng = random.Random(7)
    for n in (1, 2, 5, 40):
        xs = [rng.uniform(0, 10) for _ in range(n)]
        for q in (50, 95):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_the_plots_columns_and_layout_carry_the_series():
    samples = [_sample(1000.0 + 2 * i, steps={"a": i}, total={"a": 3 * i}, kv={"a": i, "b": 2}) for i in range(3)]
    s = series([WorkflowDone(1001.0, None, 1, 1.0, (0.25,))], samples)
    cols = plots.columns(s, {"a": "w0", "b": "w1"})
    assert cols[plots.SERIES]["t"] == [1000000.0, 1002000.0, 1004000.0]
    assert math.isnan(cols[plots.SERIES]["ttft_p50_s"][0]) and cols[plots.SERIES]["ttft_p50_s"][1] == 0.25
    batch = cols["kv-batch"]
    assert batch["worker"] == ["w0", "w1"] and len(batch["xs"]) == 2 and math.isnan(batch["ys"][0][0])
    assert batch["ys"][0][1:] == [3.0, 3.0] and cols["kv-bytes"]["ys"][1] == [2, 2, 2]
    if not plots.available():
        pytest.skip("bokeh is not installed")
    item = json.dumps(plots.layout_item(s, {"a": "w0", "b": "w1"}), allow_nan=False)  # NaN encoded Bokeh's way
    for name in (plots.SERIES, *plots.WORKERS):
        assert f'"name":"{name}"' in item.replace(" ", "")
