"""Experiment 8 of the bench (parallel materialize) at its smallest: files written, tokens checked."""

import json

from daskflow_kv.bench.run import main as bench_main


def test_bench_parallel_materialize_smoke(tmp_path):
    rc = bench_main(["--profile", "smoke", "--experiments", "8", "--out", str(tmp_path), "--tag", "p",
                     "--no-progress", "--no-plots", "--parallel-contexts", "128", "--parallel-exp1-contexts", "128"])
    assert rc == 0
    for name in ("bench_p.json", "bench_p_parallel.csv", "bench_p_parallel_summary.csv", "SUMMARY_p.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    part = json.loads((tmp_path / "bench_p.json").read_text())["parallel"]
    mat = [r for r in part["rows"] if r["exp"] == "parallel"]
    assert {(r["system"], r["width"]) for r in mat} == {("dkv-w1", 1), ("dkv-w2", 2)}
    assert all(r["agree"] is True for r in part["rows"]), [r for r in part["rows"] if r["agree"] is not True]
    two = next(r for r in mat if r["width"] == 2)
    assert two["relayed"] and two["handoff_bytes"] > 0 and len(two["workers"]) == 2
    assert {r["system"] for r in part["rows"] if r["exp"] == "exp1p"} == {"text", "hf", "local", "dkv-w1",
                                                                          "dkv-par"}
    # the context of a parallel materialize is ready when its last chunk is: every cold row says when
    cold = [r for r in part["rows"] if r["exp"] == "exp1p"]
    assert all(r["ttft_invariant_ok"] is True and r["shared_prefill_wall_s"] > 0 for r in cold), cold
    par = next(r for r in cold if r["system"] == "dkv-par")
    assert par["shared_prefill_s"] > 0 and par["ttft_min_s"] >= par["shared_prefill_wall_s"]
    assert "Experiment 8: parallel materialize" in (tmp_path / "SUMMARY_p.md").read_text()
