"""The benchmark harness end to end on a tiny model, its summary rules, and the cluster-scale planner.

The bench test runs the ``smoke`` profile at its smallest (one context, four agents on two
workers so co-located branches take the batched path, cold and warm, one exp 3 point) on a
real 2-worker LocalCluster: it must write every result file, every system must produce
text replay's tokens exactly, and every cold row must satisfy the TTFT invariant (no first
token before the shared context existed). The multi-round and load experiments run once at
toy sizes. The summary and router tests are pure.
"""

import importlib.util
import json
import math
import time

import pytest

from daskflow_kv.bench import plan, provenance
from daskflow_kv.bench.run import main as bench_main


def test_bench_smoke_writes_results_and_outputs_agree(tmp_path):
    site = tmp_path / "site"  # a README with the headline block, benchmarks/README.md with the full one
    (site / "benchmarks").mkdir(parents=True)
    (site / "README.md").write_text("<!-- bench:headline:start -->\n<!-- bench:headline:end -->\n")
    (site / "benchmarks" / "README.md").write_text("<!-- bench:results:start -->\n<!-- bench:results:end -->\n")
    rc = bench_main(["--profile", "smoke", "--out", str(tmp_path), "--tag", "t", "--no-progress", "--no-netem",
                     "--contexts", "128", "--ks", "1", "4", "--exp3-contexts", "128", "--experiments", "1,2,3",
                     "--readme", str(site / "README.md"), "--warm"])
    assert rc == 0
    headline, full = (site / "README.md").read_text(), (site / "benchmarks" / "README.md").read_text()
    assert "--readme" in headline and "(../bench_t.json)" in headline and "| mean TTFT, 4 agents, 128-token" in headline
    # a run of some experiments leaves the full block to the run of every experiment (readme_blocks_of)
    assert full == "<!-- bench:results:start -->\n<!-- bench:results:end -->\n"
    for name in ("bench_t.json", "bench_t_runs.csv", "bench_t_summary.csv", "bench_t_exp3.csv",
                 "bench_t_exp3_modeled.csv", "SUMMARY_t.md", "bench_t_readme.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "bench_t_exp2_wall.png").stat().st_size > 0
    doc = json.loads((tmp_path / "bench_t.json").read_text())
    assert doc["command"].endswith("--warm") and doc["machine"]["cores"]
    # its provenance: the host (the same id in machine and provenance), the commit, every row's origin
    assert doc["provenance"]["host"]["id"] == doc["machine"]["host_id"] and doc["provenance"]["command"] == doc["command"]
    assert doc["provenance"]["commit"] is None or f"Measured at commit `{doc['provenance']['commit'][:7]}`" in headline
    runs = doc["runs"]
    assert all(r["origin"].endswith("@" + doc["machine"]["host_id"]) for r in runs)
    assert not [r for r in runs if r.get("error")]
    assert {(r["system"], r["phase"]) for r in runs} == {(s, p) for s in ("text", "hf", "local", "dkv")
                                                         for p in ("cold", "warm")} - {("text", "warm")}
    assert {r["exp"] for r in runs} == {"exp1", "exp2"}
    assert all(r["agree"] is True for r in runs), [(r["exp"], r["system"]) for r in runs if not r["agree"]]
    assert all(r["wall_s"] > 0 and r["generated_tokens"] > 0 for r in runs)
    # a worker cannot compute for longer than the workflow ran (batched requests counted once)
    assert all(0 < r["busiest_compute_s"] <= 1.01 * r["wall_s"] for r in runs), \
        [(r["system"], r["busiest_compute_s"], r["wall_s"]) for r in runs if r["busiest_compute_s"] > r["wall_s"]]
    for r in runs:
        # one TTFT definition: from the workflow's start, shared prefill included
        if r["phase"] == "cold":
            assert r["shared_prefill_wall_s"] > 0 and r["ttft_invariant_ok"] is True, r
            assert r["ttft_mean_s"] >= r["shared_prefill_wall_s"], r
        elif r["system"] == "dkv":
            assert r["shared_prefill_wall_s"] == 0.0, r  # the context was cached before the start
        else:  # a per-worker cache's router may send a warm request to the other, idle worker, which
            # prefills the context again: never more than its cold run did (timings that small are noise)
            cold = next(c for c in runs if (c["exp"], c.get("k"), c["system"], c["phase"], c["rep"])
                        == (r["exp"], r.get("k"), r["system"], "cold", r["rep"]))
            assert r["tokens_prefilled"] <= cold["tokens_prefilled"], (r, cold)
    assert by_k(runs, 1, "dkv", "cold")["batched_branches"] == 1, by_k(runs, 1, "dkv", "cold")  # the unbatched path
    by = {(r["exp"], r["system"], r["phase"]): r for r in runs if r.get("k", 4) == 4}
    for system in ("local", "dkv"):  # 4 agents on 2 workers: some worker decodes >= 2 branches as one batch
        assert by[("exp2", system, "cold")]["batched_branches"] >= 2, by[("exp2", system, "cold")]
    for system in ("hf", "local", "dkv"):  # warm: the shared context is not prefilled again (unless a plan
        # rebuilds it on an idle worker because that finishes first)
        warm, cold = by[("exp2", system, "warm")], by[("exp2", system, "cold")]
        assert warm["tokens_prefilled"] <= cold["tokens_prefilled"], (warm, cold)
    assert by[("exp2", "hf", "warm")]["tokens_prefilled"] < by[("exp2", "hf", "cold")]["tokens_prefilled"]
    assert by[("exp2", "text", "cold")]["tokens_prefilled"] >= by[("exp2", "local", "cold")]["tokens_prefilled"]
    assert by[("exp2", "dkv", "warm")].get("engine_ttft_mean_s", 0) > 0, by[("exp2", "dkv", "warm")]
    summary = doc["summary"]
    assert all("shared_prefill_wall_s" in r and r["phase"] in ("cold", "warm") for r in summary)
    e3 = doc["exp3"][0]
    assert e3["kv_bytes"] <= e3["bytes_received"] <= e3["kv_bytes"] + 4096 and e3["recompute_s"] > 0, e3
    assert e3["model_action"] in ("transfer", "recompute") and e3["runtime_action"] in ("transfer", "recompute"), e3
    for col in ("recompute_s", "model_t_recompute_s", "transfer_s", "model_t_transfer_s", "model_correct",
                "runtime_correct", "err_transfer", "err_recompute"):
        assert col in e3, col
    md = (tmp_path / "SUMMARY_t.md").read_text()
    assert "matched text replay token for token" in md and "## Targets" in md
    assert f"Provenance: {provenance.describe(doc)}" in md and f"host `{doc['machine']['host_id']}`" in md


def by_k(runs, k, system, phase):
    return next(r for r in runs if r["exp"] == "exp2" and r["k"] == k and r["system"] == system and r["phase"] == phase)


def test_bench_multiround_and_load_agree_with_text(tmp_path):
    from daskflow_kv.sim.beside import simulate  # what ``daskflow-kv bench`` hands it

    rc = bench_main(["--profile", "smoke", "--out", str(tmp_path), "--tag", "m", "--no-progress", "--no-plots",
                     "--experiments", "6,7", "--exp7-gates", "none", "0.5"], simulate_exp7=simulate)
    assert rc == 0
    doc = json.loads((tmp_path / "bench_m.json").read_text())
    runs = doc["runs"]
    assert not [r for r in runs if r.get("error") or r.get("errors")]
    assert {(r["exp"], r["system"]) for r in runs} == ({("exp6", s) for s in ("text", "local", "dkv")}
                                                      | {("exp7", s) for s in ("local", "dkv")})  # text: exp7's reference
    assert all(r["agree"] is True for r in runs)
    for r in runs:
        if r["exp"] == "exp6":
            assert r["ttft_invariant_ok"] is True and len(r["round_ttft_s"]) == r["levels"] == 4
        else:
            assert r["completed"] == r["workflows"] and r["completed_per_min"] > 0 and r["latency_p95_s"] > 0
            # where the row's CPU went: the client and the workers spent some, the step loops ran
            # forwards (one worker may idle: a tiny model's plans keep every branch with its blocks,
            # and an idle worker's few ms of heartbeats round to 0.00 s on a fast host)
            assert len(r["cpu_s"]["workers"]) == len(r["step_busy_s"]) == 2
            assert r["cpu_s"]["client"] > 0 and r["cpu_s"]["scheduler"] is None  # LocalCluster: in-process
            assert all(c >= 0 for c in r["cpu_s"]["workers"].values()) and sum(r["cpu_s"]["workers"].values()) > 0
            assert sum(r["step_busy_s"].values()) > 0
            if r["system"] == "dkv":  # where its prompt work went: three counts that must agree
                led, ops = r["prefill_ledger"], r["prompt_by_op"].values()
                fed, dropped, told = (sum(n for w in ops for n in w.get(k, {}).values())
                                      for k in ("fed", "dropped", "reported"))
                assert led["complete"] and sum(led["by_op"].values()) == r["tokens_computed"] == told > 0
                # what the workers reported is what their step loops fed, less what left without
                # a result, plus what parallel chunks computed outside the loops
                assert told <= fed + led["chunk_tokens"] and (dropped or told == fed + led["chunk_tokens"])
                assert r["tokens_prefilled"] == r["tokens_computed"] + dropped and r["tokens_counted"] > 0
            if r["system"] == "local":  # what its router priced with, for a replay (sim.report.replays)
                assert set(r["router_profiles"]) == set(r["step_busy_s"])
                for p in r["router_profiles"].values():  # a fit: no negative term, not all zero
                    assert min(p.values()) >= 0 and sum(p.values()) > 0
    # every system once without a gate and once behind one place (half a run per worker, 2
    # workers): four workflows arriving within a second, so the later ones waited in line
    exp7 = [r for r in runs if r["exp"] == "exp7"]
    assert sorted({(r["system"], r["workflow_gate"]) for r in exp7}, key=str) == sorted(
        {(s, g) for s in ("local", "dkv") for g in (None, 0.5)}, key=str)
    for r in exp7:
        assert r["point"].endswith("gate 0.5") == (r["workflow_gate"] == 0.5)
        assert (r["gate_wait_mean_s"] > 0) if r["workflow_gate"] else (r["gate_wait_mean_s"] < 0.5)
    # each exp 7 row beside its simulation, on the run's own profile (sim.report.fidelity)
    modeled = doc["exp7_modeled"]["rows"]
    assert doc["exp7_modeled"]["profile"].startswith("calibration of bench_m.json")
    assert doc["exp7_modeled"]["steps_in_place"] is False  # no step shapes recorded
    assert sorted((m["system"], m["stream"], m["rep"], str(m["workflow_gate"])) for m in modeled) == sorted(
        ({"dkv": "daskflow-kv"}.get(r["system"], r["system"]), r["stream"], r["rep"], str(r["workflow_gate"]))
        for r in runs if r["exp"] == "exp7")
    for m in modeled:
        assert m["label"] == "MODELED" and m["completed_per_min"]["simulated"] > 0
        assert m["tokens_prefilled"]["simulated"] > 0 and m["tokens_prefilled"]["measured"] > 0
    assert "## Exp 7 beside its simulation (MODELED)" in (tmp_path / "SUMMARY_m.md").read_text()
    by = {(r["exp"], r["system"]): r for r in runs}
    for system in ("local", "dkv"):  # state crosses rounds: fewer tokens than text replay
        assert by[("exp6", system)]["tokens_prefilled"] < by[("exp6", "text")]["tokens_prefilled"]


def _row(system, phase, ttft, shared, wall=1.0, **kw):
    return {"exp": "exp1", "context": 512, "rep": 0, "system": system, "phase": phase, "agree": True, "agents": 4,
            "wall_s": wall, "ttft_mean_s": ttft, "shared_prefill_wall_s": shared,
            "ttft_invariant_ok": (ttft >= shared) if phase == "cold" else None, **kw}


def test_summary_refuses_a_ttft_before_the_shared_context_and_ratios_use_the_best_baseline():
    from daskflow_kv.bench.report_md import markdown
    from daskflow_kv.bench.summary import gain, summarize

    runs = [_row("text", "cold", 3.0, 1.0, wall=4.0), _row("hf", "cold", 2.0, 1.0, wall=3.0),
            _row("local", "cold", 1.5, 1.0, wall=2.0), _row("dkv", "cold", 0.3, 1.0, wall=1.0),
            _row("local", "warm", 0.5, 0.0, wall=0.8), _row("dkv", "warm", 0.4, 0.0, wall=0.5)]
    summary = summarize(runs)
    dkv_cold = next(r for r in summary if r["system"] == "dkv" and r["phase"] == "cold")
    assert dkv_cold["invalid"] == "INVALID" and dkv_cold["ttft_mean_s"] is None and dkv_cold["wall_s"] is None
    assert gain(summary, "exp1", 512, "cold", "ttft_mean_s") == (None, "local")  # refused: no ratio
    g, name = gain(summary, "exp1", 512, "warm", "wall_s")
    assert name == "local" and g == pytest.approx(0.8 / 0.5)  # the best baseline, not text or hf
    doc = {"machine": {"cpu": "x", "cores": 2, "torch": "t", "transformers": "t", "dask": "d", "distributed": "d"},
           "config": {"model": "m", "workers": 2, "reps": 1, "max_new_tokens": 4, "systems": ["text", "hf", "local",
                                                                                               "dkv"]},
           "tag": "t", "command": "c"}
    md = markdown(doc, summary)
    assert "INVALID" in md and "0.300" not in md


def test_busy_seconds_counts_overlapping_requests_once():
    from daskflow_kv.bench.common import busy_seconds

    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 1.0), (2.0, 3.0)]) == pytest.approx(2.0)  # apart: summed
    assert busy_seconds([(0.0, 2.0), (1.0, 3.0), (1.5, 1.8)]) == pytest.approx(3.0)  # batched: their union
    assert busy_seconds([(5.0, 6.0), (0.0, 1.0), (0.5, 5.5)]) == pytest.approx(6.0)  # any order


def test_summary_refuses_an_omega_whose_compute_exceeds_the_wall():
    from daskflow_kv.bench.report_md import markdown
    from daskflow_kv.bench.summary import gain, summarize

    runs = [{**_row(s, "cold", 3.0, 1.0, wall=4.0), "exp": "exp2", "k": 4, "busiest_compute_s": c,
             "omega_s": 4.0 - c} for s, c in (("text", 13.0), ("local", 3.0), ("dkv", 3.5))]
    summary = summarize(runs)
    text = next(r for r in summary if r["system"] == "text")
    assert text["overhead_invalid"] and text["omega_s"] is None and text["wall_s"] == 4.0  # only the overhead
    assert gain(summary, "exp2", 4, "cold", "omega_s") == (pytest.approx(1.0 / 0.5), "local")  # not text's -9
    doc = {"machine": {"cpu": "x", "cores": 2, "torch": "t", "transformers": "t", "dask": "d", "distributed": "d"},
           "config": {"model": "m", "workers": 2, "reps": 1, "max_new_tokens": 4,
                      "systems": ["text", "local", "dkv"]}, "tag": "t", "command": "c"}
    md = markdown(doc, summary)
    assert "**INVALID Omega**" in md and "-9.000" not in md


def test_router_prefills_in_parallel_when_idle_and_follows_the_cache():
    from daskflow_kv.bench.router import CacheAwareRouter
    from daskflow_kv.policy.cost_model import PrefillProfile

    prof = PrefillProfile(0.01, 0.002, 0.0)  # 2 ms a token: a 1,000-token prefix costs 2 s
    r = CacheAwareRouter(["a", "b"], {"a": prof, "b": prof})
    prefix = list(range(1000))
    routes = r.route(prefix, [[1], [2], [3], [4]], 4)
    assert sorted(len(i) for i, _ in routes.values()) == [2, 2]  # idle and cold: both prefill, in parallel
    r.forget()
    r.done("a", 0.0, [prefix])  # a already caches the prefix
    routes = r.route(prefix, [[1], [2]], 4)
    assert list(routes) == ["a"]  # waiting for nothing beats a 2 s prefill on b


def test_near_tie_rates_bracket_each_contexts_tie():
    from daskflow_kv.bench.experiments import near_tie_rates

    rows = [{"context": 512, "kv_bytes": 22_500_000, "recompute_s": 2.0},
            {"context": 2048, "kv_bytes": 90_000_000, "recompute_s": 9.0}]
    jobs = near_tie_rates(rows, [512, 2048], (0.85, 1.2))
    assert jobs == [(76.5, [512]), (108.0, [512]), (68.0, [2048]), (96.0, [2048])]


@pytest.mark.parametrize("model,hardware,bandwidth", [("llama-3.1-8b", "ethernet-10g", None),
                                                      ("mistral-7b", "ethernet-10g", None),
                                                      ("qwen2-7b", "ethernet-10g", 0.5e9)])
def test_plan_decisions_flip_at_the_crossover(model, hardware, bandwidth):
    m, hw = plan.MODELS[model], plan.HARDWARE[hardware]
    if bandwidth:  # fewer KV heads: a slower link puts its crossover inside 1k..128k
        hw = plan.Hardware(**{**hw.__dict__, "bandwidth": bandwidth})
    info = plan.summary(m, hw)
    cross = info["transfer_wins_from_tokens"]
    assert cross is not None and 1 < cross < 1 << 20
    contexts = sorted({max(1, cross // 4), cross - 1, cross, cross + 1, cross * 4})
    rows = plan.plan_rows(m, hw, contexts)
    for r in rows:
        assert r["label"] == "MODELED"
        assert r["action"] == ("transfer" if r["context"] >= cross else "recompute"), r
        faster = "transfer" if r["t_transfer_s"] < r["t_recompute_s"] else "recompute"
        assert r["action"] == faster


def test_plan_flips_with_bandwidth_at_the_crossover_bandwidth():
    m = plan.MODELS["llama-3-8b"]
    base = plan.HARDWARE["a100-ib200"]
    [row] = plan.plan_rows(m, base, [4096])
    bw = row["crossover_bandwidth_gbps"] * 1e9
    assert math.isfinite(bw) and bw > 0
    for factor, action in ((1.05, "transfer"), (0.95, "recompute")):
        hw = plan.Hardware(**{**base.__dict__, "bandwidth": bw * factor})
        assert plan.plan_rows(m, hw, [4096])[0]["action"] == action


def test_plan_reads_a_config_json_and_prints_modeled(tmp_path, capsys):
    cfg = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = plan.load_config(path)
    assert m.kv_bytes_per_token(4) == 46080  # SmolLM2-135M in fp32, as measured by the runtime
    assert plan.main(["--model", str(path), "--hardware", "h100-nvlink", "--json", str(tmp_path / "p.json"),
                      "--contexts", "1024", "131072"]) == 0
    out = capsys.readouterr().out
    assert "MODELED" in out and "(> model's max positions)" in out
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["label"] == "MODELED" and [r["context"] for r in doc["rows"]] == [1024, 131072]


def _benchmark(name: str):
    """A script of benchmarks/ imported as a module (registered, so what it pickles resolves)."""
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_store_ttft_harness_quick(tmp_path):
    """benchmarks/store_ttft.py --quick: cold on one cluster, warm from the store on a new one;
    its guards (context prefilled once, read back whole, tokens equal) must hold."""
    mod = _benchmark("store_ttft")
    out = tmp_path / "store_ttft.json"
    assert mod.main(["--quick", "--lengths", "128", "--store-root", str(tmp_path), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    [row] = doc["rows"]
    assert doc["summary"]["all_guards_ok"] and doc["stored"]["blocks"] == 2  # 128 tokens, 64 per block
    assert row["warm_store"]["context_from_store"] == 128 and row["warm_store"]["store_bytes"] > 0
    assert row["cold"]["ttft_s"] > 0 and row["warm_memory"]["ttft_s"] > 0
    assert list(tmp_path.glob("daskflow-kv-store-bench-*")) == []  # the store is removed afterwards


def test_step_cost_harness_quick(tmp_path):
    """benchmarks/step_cost.py --quick --no-pair: a real step loop's recorded steps, fitted."""
    from daskflow_kv.sim.profile import preset_profile

    mod = _benchmark("step_cost")
    out = tmp_path / "step_cost.json"
    assert mod.main(["--model", "tiny-llama", "--quick", "--no-pair", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    steps = doc["steps"]["alone"]
    assert len(steps) >= 10 and all(s["seconds"] > 0 for s in steps)
    assert any(s["prompt_tokens"] and s["decode_rows"] for s in steps)  # a newcomer's chunk beside decode rows
    assert any(s["loaded_tokens"] for s in steps) and any(s["exported_tokens"] for s in steps)
    fit = doc["fits"]["alone"]
    assert fit["cost"]["samples"] == len(steps) and fit["rms_rel_error"] >= 0 and "paired" not in doc["fits"]
    assert preset_profile("a100-ib200").with_step_costs(out).step_costs[0].samples == len(steps)
    assert not (tmp_path / ".step_cost_tmp").exists()



def test_sim_whatif_sweeps_the_gate_and_the_workload_shape_quick(tmp_path):
    """benchmarks/sim_whatif.py on 2 workers, one draw: every point simulated, each system's best gate named."""
    mod = _benchmark("sim_whatif")
    out = tmp_path / "whatif"
    assert mod.main(["--workers", "2", "--seeds", "1", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["label"] == "MODELED" and len(doc["gate_sweep"]) == len(mod.GATES) * len(mod.RATES)
    assert {b["best"]["local"] for b in doc["best_gates"]} <= set(mod.GATES)
    assert [(p["context"], p["max_new"]) for p in doc["shape_sweep"]][:len(mod.CONTEXTS)] == [(c, 16) for c in mod.CONTEXTS]
    assert all(p["ratio"]["throughput_ratio"] > 0 for p in doc["gate_sweep"] + doc["shape_sweep"])
    assert "MODELED" in out.with_suffix(".md").read_text()


def test_control_plane_holds_the_grids_rates_against_one_scheduler(tmp_path):
    """benchmarks/control_plane.py's check: a modeled rate times the measured scheduler CPU a
    workflow costs is the scheduler cores that rate takes; above one core, one scheduler cannot."""
    mod = _benchmark("control_plane")
    grid = tmp_path / "simulation.json"
    grid.write_text(json.dumps({"grid": [
        {"system": "daskflow-kv", "workers": 8, "stream": "zipf", "completed_per_min": 120.0, "seed": 0},
        {"system": "daskflow-kv", "workers": 512, "stream": "zipf", "completed_per_min": 6000.0, "seed": 0},
        {"system": "daskflow-kv", "workers": 512, "stream": "zipf", "completed_per_min": 9000.0, "seed": 1},
        {"system": "local", "workers": 512, "stream": "zipf", "completed_per_min": 1e6, "seed": 0}]}))
    rows = [{"mode": "state", "completed": 10, "scheduler_cpu_s_per_workflow": 0.03},
            {"mode": "state", "completed": 10, "scheduler_cpu_s_per_workflow": 0.04},
            {"mode": "text", "completed": 10, "scheduler_cpu_s_per_workflow": 0.5}]  # not daskflow-kv's cost
    small, big = mod.scheduler_check(rows, grid)
    assert (small["workers"], big["workers"]) == (8, 512) and big["workflows_per_s"] == 125.0  # the draws' median
    assert small["scheduler_cores"] == pytest.approx([0.06, 0.08]) and small["one_scheduler_keeps_up"]
    assert big["scheduler_cores"] == pytest.approx([3.75, 5.0]) and not big["one_scheduler_keeps_up"]
    assert mod.scheduler_check(rows, tmp_path / "missing.json") == []


def _exp7_run(system, by_op, by_worker, transfers=None, repeat=0):
    return {"exp": "exp7", "point": "zipf-budget 60/min", "system": system, "prefill_by_op": by_op,
            "prefill_by_worker": by_worker, "tokens_prefilled": sum(by_op.values()), "transfers": transfers,
            "repeat_prefill_tokens": repeat}


def test_exp7_why_names_rebuilt_copies_when_they_dominate_and_imbalance_otherwise():
    from daskflow_kv.bench.exp7_why import cost_terms, why

    local = [_exp7_run("local", {"materialize": 9000, "resume": 600}, {"a": 5000, "b": 4600}, repeat=4000)]
    rebuilt = [_exp7_run("dkv", {"materialize": 5000, "recompute": 4000, "resume": 600}, {"a": 5200, "b": 4400}, 9)]
    assert cost_terms(rebuilt)["by_op"]["recompute"] == 4000 and cost_terms(local)["busiest"] == 5000
    assert "rebuilt prefixes on a second worker (4000 tokens, 42%" in why(rebuilt, local)
    skewed = [_exp7_run("dkv", {"materialize": 5000, "resume": 600}, {"a": 4800, "b": 800}, 9)]
    assert "imbalance" in why(skewed, local)
    even = [_exp7_run("dkv", {"materialize": 5000, "resume": 600}, {"a": 2900, "b": 2700}, 9)]
    assert "not prefill" in why(even, local) and why([], local) == ""


def test_rebuild_reasons_counts_each_rule_that_rebuilt():
    from daskflow_kv.bench.exp7_why import rebuild_reasons
    from daskflow_kv.policy.cost_model import Decision

    def d(action, reason, loaded, tokens, ready):
        return Decision(action, 0.01, 1.0, 0.0, 0.01, 1.0, 1, tokens, 0, "a", "b", 1e9, reason, ready, 0.5, loaded)

    out = rebuild_reasons([d("recompute", "late", True, 512, 9.0), d("recompute", "late", True, 256, 3.0),
                           d("recompute", "sooner", False, 100, 2.0), d("transfer", "cheap", True, 512, 0.0)])
    assert out == {"late (loaded)": {"n": 2, "tokens": 768, "src_ready_s": 6.0, "dst_wait_s": 0.5},
                   "sooner": {"n": 1, "tokens": 100, "src_ready_s": 2.0, "dst_wait_s": 0.5}}


def test_the_prefill_ledger_sorts_reported_work_into_reruns_and_lone_chunks():
    from daskflow_kv.bench.prefill_ledger import ledger

    events = [{"op": "materialize", "state_id": "m1", "new_tokens": 300, "prefix_tokens": 0},
              {"op": "resume", "state_id": "b1", "new_tokens": 40, "prefix_tokens": 300},
              # a split materialize: chunk 0 relayed, chunk 1 alone from the cached prefix (64)
              {"op": "materialize", "state_id": "m2", "chunk": 0, "chunks": 2, "relayed": True, "span": [64, 512],
               "new_tokens": 448, "prefix_tokens": 64},
              {"op": "materialize", "state_id": "m2", "chunk": 1, "chunks": 2, "relayed": False, "span": [512, 960],
               "new_tokens": 896, "prefix_tokens": 64},
              {"op": "materialize", "state_id": "m1", "new_tokens": 300, "prefix_tokens": 0}]  # m1 ran again
    out = ledger(events)
    assert out["by_op"] == {"materialize": 300 + 448 + 896 + 300, "resume": 40}
    assert (out["again"], out["again_tasks"]) == ({"materialize": 300}, 1)
    assert (out["alone_chunks"], out["alone_excess"]) == (1, 512 - 64)  # chunk 0's tokens, computed twice
    assert out["chunk_tokens"] == 448 + 896  # outside the step loop
    assert out["states"] == 3
    assert ledger([]) == {"by_op": {}, "again": {}, "again_tasks": 0, "alone_excess": 0, "alone_chunks": 0,
                          "chunk_tokens": 0, "states": 0}


def test_process_load_delta_counts_a_restarted_worker_from_its_new_start():
    from daskflow_kv.bench.process_load import delta

    before = {"client": 1.0, "scheduler": 2.0, "scheduler_transitions": 100,
              "workers": {"a": {"cpu_s": 5.0, "busy_s": 3.0, "transitions": 40,
                                "prompt": {"fed": {"resume": 10}, "dropped": {}, "reported": {"resume": 10}}},
                          "b": {"cpu_s": 9.0, "busy_s": 8.0, "transitions": 70,
                                "prompt": {"fed": {"resume": 90}, "dropped": {}, "reported": {"resume": 90}}}}}
    after = {"client": 4.5, "scheduler": 2.5, "scheduler_transitions": 160,
             "workers": {"a": {"cpu_s": 7.0, "busy_s": 4.0, "transitions": 65,
                               "prompt": {"fed": {"resume": 30, "recompute": 7}, "dropped": {"resume": 5},
                                          "reported": {"resume": 25, "recompute": 7}}},
                         "b": {"cpu_s": 1.5, "busy_s": 0.5, "transitions": 12,  # b restarted
                               "prompt": {"fed": {"resume": 4}, "dropped": {}, "reported": {"resume": 4}}}}}
    d = delta(before, after)
    assert d["cpu_s"] == {"client": 3.5, "scheduler": 0.5, "workers": {"a": 2.0, "b": 1.5}}
    assert d["step_busy_s"] == {"a": 1.0, "b": 0.5}
    assert d["transitions"] == {"scheduler": 60, "workers": {"a": 25, "b": 12}}
    assert d["prompt_by_op"] == {"a": {"fed": {"resume": 20, "recompute": 7}, "dropped": {"resume": 5},
                                       "reported": {"resume": 15, "recompute": 7}},
                                 "b": {"fed": {"resume": 4}, "dropped": {}, "reported": {"resume": 4}}}
    same = delta(before | {"scheduler": None}, after | {"scheduler": None})  # scheduler in the client's process
    assert same["cpu_s"]["scheduler"] is None and same["cpu_s"]["client"] == 3.5


@pytest.mark.parametrize("experiments,longest", [("7", 1024), ("6", 2048), ("3", 4096), ("1,7", 4096)])
def test_the_calibration_covers_every_experiments_context(experiments, longest):
    """An exp 7 run calibrated up to 256 tokens for its 1,024-token documents: its router's
    prices were extrapolated (docs/simulation.md). Each experiment's context is probed now."""
    from daskflow_kv.bench.run import _parser, calibration_tokens, resolve

    cfg = resolve(_parser().parse_args(["--profile", "full", "--experiments", experiments]))
    assert calibration_tokens(cfg, cfg["contexts"]) == longest


def test_a_run_the_model_cannot_replay_says_so_and_keeps_its_files(tmp_path):
    """Each exp 7 row beside its simulation is a diagnostic: a run it cannot be fitted on (no
    calibration here) gets one line in its JSON and SUMMARY, and every file is still written."""
    from daskflow_kv.bench.exp7_modeled import lines
    from daskflow_kv.bench.report import _simulate_exp7
    from daskflow_kv.sim.beside import simulate

    path = tmp_path / "bench_x.json"
    doc = {"config": {"experiments": [7]}, "runs": [{"exp": "exp7", "system": "local", "rate": 60.0}]}
    path.write_text(json.dumps(doc))
    _simulate_exp7(doc, path, simulate)
    kept = json.loads(path.read_text())
    assert "exp7_modeled" not in kept and "no calibration.prefill_profiles" in kept["exp7_modeled_error"]
    assert lines(kept)[2].startswith("Not simulated: ValueError: ")


def test_a_routed_group_whose_worker_is_gone_runs_on_a_live_one(monkeypatch):
    """The local baseline pins each routed group to its worker (strict: no work stealing). A
    worker Dask's nanny restarted comes back under a new address, and a group pinned to the
    old one waited forever: the stream hung (2026-12-06). It runs again on a live worker."""
    import operator
    from types import SimpleNamespace

    from distributed import Client, LocalCluster

    from daskflow_kv.bench import systems

    monkeypatch.setattr(systems, "LOST_WORKER_POLL_S", 0.2)
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        gone = "tcp://127.0.0.1:9"  # no worker there: as an address whose worker restarted
        fut = client.submit(operator.add, 1, 2, workers=[gone], allow_other_workers=False, pure=False)
        t0 = time.time()
        assert systems._result(SimpleNamespace(client=client), gone, fut, (operator.add, 1, 2)) == 3
        assert time.time() - t0 < 10
        live = next(iter(client.scheduler_info()["workers"]))
        fut = client.submit(operator.mul, 2, 3, workers=[live], allow_other_workers=False, pure=False)
        assert systems._result(SimpleNamespace(client=client), live, fut, (operator.mul, 2, 3)) == 6
