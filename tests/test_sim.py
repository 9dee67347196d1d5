"""The simulator (``daskflow_kv.sim``): small MODELED runs, pure Python, no cluster, no model."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from daskflow_kv import policy
from daskflow_kv.policy import admission, placement, step_schedule
from daskflow_kv.sim import blocks, report, systems, worker
from daskflow_kv.sim.profile import PRESETS, fitted_profile, preset_profile
from daskflow_kv.sim.report import exp7_budget, fidelity, run_system
from daskflow_kv.sim.workload import exp7_stream, read_trace, write_trace

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "bench_full.json"


@pytest.fixture(scope="module")
def prof():
    return preset_profile("a100-ib200")


@pytest.fixture(scope="module")
def stream():
    return exp7_stream(48, 4 * 18.0 * 20, 8, "zipf")  # 48 workflows, 8 documents, an overloaded cluster


def test_the_policies_are_imported_not_copied():
    assert systems.plan_placements is placement.plan_placements
    assert systems.admit is admission.admit
    assert systems.batch_seconds is placement.batch_seconds
    assert worker.plan_step is step_schedule.plan_step
    assert blocks.BlockUsage.__module__ == "daskflow_kv.policy.eviction"
    assert policy  # the package the runtime imports them from


def test_text_replay_prefills_every_prompt_token(prof, stream):
    row = run_system("text", prof, stream, 4)
    assert row["completed"] == len(stream)
    assert row["tokens_prefilled"] == sum(w.prompt_tokens for w in stream)
    assert row["label"] == "MODELED"


def test_daskflow_kv_stays_within_the_budget(prof, stream):
    budget = exp7_budget(2, 1024, prof.bytes_per_token, stream)  # about one document per worker
    row = run_system("daskflow-kv", prof, stream, 4, budget)
    assert row["completed"] == len(stream) and row["failed"] == 0
    assert 0 < row["peak_kv_bytes_max"] <= budget
    assert row["evictions"] > 0  # the budget bound: 8 documents do not fit in 4 x 1
    free = run_system("daskflow-kv", prof, stream, 4, None)
    assert free["peak_kv_bytes_max"] > budget  # without a budget it holds more
    assert row["tokens_prefilled"] < sum(w.prompt_tokens for w in stream)  # still reuses


def test_the_same_seed_gives_the_same_result(prof):
    a = run_system("daskflow-kv", prof, exp7_stream(24, 200.0, 4, "zipf"), 3)
    b = run_system("daskflow-kv", prof, exp7_stream(24, 200.0, 4, "zipf"), 3)
    strip = lambda r: {k: v for k, v in r.items() if k != "sim_wall_s"}  # noqa: E731
    assert strip(a) == strip(b)
    c = run_system("daskflow-kv", prof, exp7_stream(24, 200.0, 4, "zipf", arrival_seed=99), 3)
    assert strip(c) != strip(a)


def test_local_without_routing_affinity_prefills_more(prof, stream):
    aware = run_system("local", prof, stream, 4)
    blind = run_system("local-no-affinity", prof, stream, 4)
    assert blind["tokens_prefilled"] > aware["tokens_prefilled"]
    assert aware["tokens_prefilled"] < sum(w.prompt_tokens for w in stream)


def test_a_trace_replays_as_the_stream_it_was_written_from(prof, tmp_path):
    wfs = exp7_stream(12, 120.0, 3, "uniform")
    path = tmp_path / "trace.jsonl"
    write_trace(wfs, path)
    back = read_trace(path)
    assert [w.prompt_tokens for w in back] == [w.prompt_tokens for w in wfs]
    for system in ("text", "local", "daskflow-kv"):
        a, b = run_system(system, prof, wfs, 2), run_system(system, prof, back, 2)
        assert (a["tokens_prefilled"], a["completed_per_min"]) == (b["tokens_prefilled"], b["completed_per_min"])


def test_every_preset_is_modeled_and_fits():
    for name in PRESETS:
        p = preset_profile(name)
        assert p.source.startswith("MODELED") and p.bytes_per_token == 131072
    with pytest.raises(ValueError, match="unknown hardware preset"):
        preset_profile("tpu")


@pytest.mark.skipif(not BENCH.exists(), reason="no measured bench results (benchmarks/results/bench_full.json)")
def test_fidelity_replays_the_measured_exp7_rows():
    """Reports, does not force: the errors are printed by ``daskflow-kv simulate``; here the
    replay must run and the workload's shape (text replay's tokens) must match within 10 %."""
    p = fitted_profile(BENCH)
    rows = fidelity(BENCH, p)
    if not rows:
        pytest.skip("bench_full.json has no exp7 rows")
    for r in rows:
        assert r["label"] == "MODELED"
        for m in ("completed_per_min", "latency_p95_s", "tokens_prefilled"):
            assert math.isfinite(r[m]["simulated"])
        assert abs(r["offered_sim"] - r["offered_measured"]) < 1e-6  # the same arrivals as measured
    text = [r for r in rows if r["system"] == "text"]
    for r in text:
        assert abs(r["tokens_prefilled"]["error"]) < 0.10


def test_speed_on_a_smaller_cluster(prof):
    wfs = exp7_stream(320, 18.0 * 32, 64, "zipf")
    t0 = time.perf_counter()
    row = run_system("daskflow-kv", prof, wfs, 32, exp7_budget(4, 1024, prof.bytes_per_token, wfs))
    assert row["completed"] == 320
    assert time.perf_counter() - t0 < 15  # ~2 s on an idle core


def test_the_report_labels_every_figure(prof):
    rows = report.simulate_grid(prof, workers=(2,), streams=("zipf",), per_worker=8, min_workflows=8)
    md = report.markdown({"command": "test", "date": "today", "profile": {"source": prof.source}, "grid": rows,
                          "ratios": report.ratios(rows)})
    assert all(r["label"] == "MODELED" for r in rows)
    table = [line for line in md.splitlines() if line.startswith("| 2 |")]
    assert table and all("MODELED" in line for line in table)


def test_a_fitted_profile_prefers_the_profiles_a_run_ended_on(tmp_path):
    """A bench JSON's calibration may be one probe's rate; the profiles refitted from the
    run's own prefills (``prefill_profiles_end``) are what the simulation should model."""
    w = ["tcp://a:1", "tcp://b:1"]
    doc = {"calibration": {"prefill_profiles": {x: {"a": 0.0, "b": 0.008, "c": 0.0} for x in w},
                           "bandwidth": {f"{w[0]}->{w[1]}": 1e9}},
           "prefill_profiles_end": {x: {"a": 0.01, "b": 0.003, "c": 1e-7} for x in w},
           "model": {"bytes_per_token": 46080}}
    path = tmp_path / "bench_x.json"
    path.write_text(json.dumps(doc))
    p = fitted_profile(path)
    assert {(q.a, q.b, q.c) for q in p.prefill} == {(0.01, 0.003, 1e-7)}
    del doc["prefill_profiles_end"]
    path.write_text(json.dumps(doc))
    assert {q.b for q in fitted_profile(path).prefill} == {0.008}  # older JSONs: the calibration


def test_a_document_still_being_prefilled_is_waited_for_not_prefilled_again():
    """Two workflows over one document arriving a second apart: the second finds the first's
    blocks in flight (as the plugin's lookup lists them, ``where`` without a holder) and
    reuses or fetches them; the document is prefilled once. Before, the simulation saw only
    finished blocks and prefilled it twice (its tokens +49-125 % over the measured exp 7)."""
    from daskflow_kv.policy.cost_model import LinkProfile, PrefillProfile
    from daskflow_kv.sim.profile import SimProfile

    cpu = SimProfile("cpu-like", (PrefillProfile(0.0, 0.005, 0.0),), LinkProfile(1e9), 46080)  # 5 ms a token
    wfs = [w for w in exp7_stream(2, 60.0, 1, "uniform")]
    wfs = [type(w)(w.index, 0.5 * w.index, w.client, w.doc, w.calls) for w in wfs]  # 0.5 s apart
    doc = wfs[0].calls[0].segments[0][1]
    sim = systems.DaskflowSystem(cpu, 2)
    sim.run(wfs)
    assert all(not math.isnan(f.done_at) for f in sim.flows)
    assert sim.prefilled < 2 * doc  # the document once, plus what each workflow adds
    assert not sim.pending  # every block in flight was made
