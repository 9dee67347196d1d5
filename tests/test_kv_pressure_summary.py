"""The memory-pressure bench's summary: pairs daskflow-kv with ``local`` rep by rep (plain rows)."""

from daskflow_kv.bench import kv_pressure as KP


def _row(system, rep, per_min, tokens, p95, idle, over, failed=0, agree=True):
    return {"stream_kind": "zipf", "budget_fraction": 0.25, "rep": rep, "system": system,
            "kv_budget_bytes": 45 << 20, "completed_per_min": per_min, "tokens_prefilled": tokens,
            "latency_p95_s": p95, "failed": failed, "agree": agree,
            "pressure": {"idle_waiting_share": idle,
                         "per_worker": {"w1": {"peak_over_budget_blocks": over}, "w2": {"peak_over_budget_blocks": 0.0}}}}


def test_ratios_are_paired_rep_by_rep_and_each_target_is_judged_on_its_median():
    rows = [_row("local", 0, 10.0, 3000, 100.0, 0.06, 0.0), _row("dkv", 0, 20.0, 900, 50.0, 0.04, 0.5),
            _row("dkv", 1, 12.0, 1200, 90.0, 0.08, 8.4), _row("local", 1, 12.0, 2400, 60.0, 0.05, 0.0)]
    (point,) = KP.summarize(rows)
    assert point["reps"] == 2
    assert point["throughput_ratio"] == {"median": 1.5, "min": 1.0, "max": 2.0, "n": 2}
    assert point["tokens_ratio"]["max"] == 0.5 and point["p95_ratio"]["max"] == 1.5
    assert point["peak_over_budget_blocks"]["dkv"]["max"] == 8.4
    t = point["targets"]
    assert t["throughput"] and t["tokens"] and t["p95"] and t["exact"] and t["failed"]
    assert not t["idle"]  # median 6 % of worker time idle while work waited
    assert not t["budget_held"]  # one rep went 8.4 blocks past the budget somewhere
    table = KP.report([point])
    assert "| zipf | 0.25 (45 MiB) |" in table and "1.50 [1.00-2.00]" in table and "8.4" in table


def test_a_failed_or_inexact_rep_fails_the_point():
    rows = [_row("local", 0, 10.0, 3000, 100.0, 0.0, 0.0), _row("dkv", 0, 20.0, 900, 50.0, 0.0, 0.0, failed=1),
            _row("local", 1, 10.0, 3000, 100.0, 0.0, 0.0, agree=False), _row("dkv", 1, 20.0, 900, 50.0, 0.0, 0.0)]
    (point,) = KP.summarize(rows)
    assert point["failed"] == 1 and not point["targets"]["failed"] and not point["targets"]["exact"]
