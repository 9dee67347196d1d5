"""The benchmark harness end to end on a tiny model, and the cluster-scale planner.

The bench test runs the ``smoke`` profile at its smallest (one context, two agents, one
exp 3 point) on a real 2-worker LocalCluster: it must write every result file and every
system must produce text replay's tokens exactly. The planner tests are pure arithmetic.
"""

import importlib.util
import json
import math

import pytest

from daskflow_kv.bench import plan
from daskflow_kv.bench.run import main as bench_main


def test_bench_smoke_writes_results_and_outputs_agree(tmp_path):
    rc = bench_main(["--profile", "smoke", "--out", str(tmp_path), "--tag", "t", "--no-progress", "--no-netem",
                     "--contexts", "128", "--ks", "2", "--exp3-contexts", "128"])
    assert rc == 0
    for name in ("bench_t.json", "bench_t_runs.csv", "bench_t_summary.csv", "bench_t_exp3.csv",
                 "bench_t_exp3_modeled.csv", "SUMMARY_t.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "bench_t_exp2_wall.png").stat().st_size > 0
    doc = json.loads((tmp_path / "bench_t.json").read_text())
    assert doc["command"].endswith("--exp3-contexts 128") and doc["machine"]["cores"]
    runs = doc["runs"]
    assert {r["system"] for r in runs} == {"text", "hf", "local", "dkv"}
    assert {r["exp"] for r in runs} == {"exp1", "exp2"}
    assert all(r["agree"] is True for r in runs), [(r["exp"], r["system"]) for r in runs if not r["agree"]]
    assert all(r["wall_s"] > 0 and r["generated_tokens"] > 0 for r in runs)
    # the reuse systems prefill the shared prefix once per worker at most, text replay per agent
    by = {(r["exp"], r["system"]): r for r in runs}
    assert by[("exp2", "text")]["tokens_prefilled"] >= by[("exp2", "local")]["tokens_prefilled"]
    e3 = doc["exp3"][0]
    assert e3["kv_bytes"] <= e3["bytes_received"] <= e3["kv_bytes"] + 4096 and e3["recompute_s"] > 0
    assert e3["model_action"] in ("transfer", "recompute") and e3["runtime_action"] in ("transfer", "recompute")
    assert "matched text replay token for token" in (tmp_path / "SUMMARY_t.md").read_text()


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


def test_store_ttft_harness_quick(tmp_path):
    """benchmarks/store_ttft.py --quick: cold on one cluster, warm from the store on a new one;
    its guards (context prefilled once, read back whole, tokens equal) must hold."""
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "store_ttft", Path(__file__).resolve().parents[1] / "benchmarks" / "store_ttft.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["store_ttft"] = mod  # worker processes unpickle nothing from it, but be tidy
    spec.loader.exec_module(mod)
    out = tmp_path / "store_ttft.json"
    assert mod.main(["--quick", "--lengths", "128", "--store-root", str(tmp_path), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    [row] = doc["rows"]
    assert doc["summary"]["all_guards_ok"] and doc["stored"]["blocks"] == 2  # 128 tokens, 64 per block
    assert row["warm_store"]["context_from_store"] == 128 and row["warm_store"]["store_bytes"] > 0
    assert row["cold"]["ttft_s"] > 0 and row["warm_memory"]["ttft_s"] > 0
    assert list(tmp_path.glob("daskflow-kv-store-bench-*")) == []  # the store is removed afterwards
