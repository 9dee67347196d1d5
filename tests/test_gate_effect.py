"""``bench.gate_effect`` on plain rows: gated over ungated, repetition by repetition, and
the daskflow-kv / local ratio per gate."""

from daskflow_kv.bench.gate_effect import effect, markdown, ratios


def _row(system, gate, rep, per_min, p95, tokens):
    return {"exp": "exp7", "stream": "zipf", "system": system, "workflow_gate": gate, "rep": rep,
            "completed_per_min": per_min, "latency_p95_s": p95, "tokens_prefilled": tokens}


ROWS = [_row("dkv", None, 0, 30, 20, 100), _row("dkv", 4, 0, 33, 15, 90),
        _row("dkv", None, 1, 20, 30, 100), _row("dkv", 4, 1, 30, 15, 100),
        _row("local", None, 0, 20, 30, 300), _row("local", 4, 0, 22, 20, 270)]


def test_each_gated_row_is_held_against_its_own_repetition():
    rows = {(r["system"], r["gate"]): r for r in effect(ROWS)}
    dkv = rows[("daskflow-kv", 4)]
    assert dkv["reps"] == 2
    assert dkv["completed_per_min"]["ratio"]["min"] == 1.1 and dkv["completed_per_min"]["ratio"]["max"] == 1.5
    assert dkv["latency_p95_s"]["ratio"]["median"] == (0.75 + 0.5) / 2
    assert rows[("local", 4)]["reps"] == 1  # rep 1 has no local rows: nothing to pair


def test_modeled_ratios_come_from_the_simulated_values_of_the_same_rows():
    sim = [{"system": "local", "stream": "zipf", "rep": 0, "workflow_gate": g,
            **{m: {"simulated": v} for m, v in zip(("completed_per_min", "latency_p95_s", "tokens_prefilled"), vals)}}
           for g, vals in ((None, (20, 40, 300)), (4, (25, 20, 300)))]
    local = next(r for r in effect(ROWS, sim) if r["system"] == "local")
    assert local["completed_per_min"]["modeled_ratio"]["median"] == 1.25
    assert local["latency_p95_s"]["modeled_ratio"]["median"] == 0.5


def test_the_ratio_per_gate_and_the_markdown():
    r = {x["gate"]: x["throughput_ratio"] for x in ratios(ROWS)}
    assert r[None]["median"] == 1.5 and r[4]["median"] == 1.5  # rep 0 only: local ran once
    md = markdown({"runs": ROWS})
    assert "| zipf | daskflow-kv | 4 |" in md and "| zipf | none | 1.50 [1.50-1.50] |" in md
