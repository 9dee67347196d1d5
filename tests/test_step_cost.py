"""Whole steps priced by what they mix: the fit, the modeled worker's shapes, the profile.

Pure: no model, no cluster. The recorded shapes themselves are checked against a real step
loop in tests/test_step_engine.py; the benchmark that records them in tests/test_bench_smoke.py.
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import decode_busy_of_two_workers

from daskflow_kv.policy.cost_model import PrefillProfile
from daskflow_kv.sim import worker
from daskflow_kv.sim.loop import EventLoop
from daskflow_kv.sim.profile import preset_profile
from daskflow_kv.sim.step_cost import (TERMS, StepCost, fit_in_workers, fit_report, fit_step_cost, peer_shares,
                                      row_speed)

TRUE = StepCost(0.04, 0.03, 0.004, 1.5e-6, 0.006, 5e-6, 0.002, 2e-6, 0.001, 3e-6)


def _shapes(n: int, seed: int = 0) -> list[dict]:
    """Steps as a busy loop mixes them: some prompt chunks, some decode rows, joins and exits."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.choice([0, 0, 32, 128, 512])
        pos = rng.choice([0, 512, 1024])
        rows = rng.randint(0 if prompt else 1, 16)
        joined = rng.randint(0, 2) if prompt else 0
        finished = rng.randint(0, rows)
        s = {"prompt_rows": 1 if prompt else 0, "prompt_tokens": prompt, "prompt_attn": prompt * (pos + prompt / 2),
             "decode_rows": rows, "decode_keys": rows * rng.randint(500, 1500), "joined": joined,
             "loaded_tokens": joined * pos, "finished": finished, "exported_tokens": finished * rng.randint(40, 200)}
        s["seconds"] = TRUE.seconds(s)
        out.append(s)
    return out


def test_the_fit_recovers_the_terms_the_steps_were_made_from():
    got = fit_step_cost(_shapes(300))
    for t in TERMS:
        assert getattr(got, t) == pytest.approx(getattr(TRUE, t), rel=1e-6, abs=1e-12)
    assert fit_report(got, _shapes(50, seed=1))["rms_rel_error"] < 1e-9


def test_a_term_no_step_exercises_stays_zero_and_a_fit_is_never_negative():
    shapes = [s | {"exported_tokens": 0, "finished": 0} for s in _shapes(100)]
    for s in shapes:
        s["seconds"] = TRUE.seconds(s) * random.Random(s["decode_keys"]).uniform(0.8, 1.2)  # noisy
    got = fit_step_cost(shapes)
    assert got.per_finish == 0 and got.per_exported == 0
    assert min(got.coefficients) >= 0
    with pytest.raises(ValueError, match="too few"):
        fit_step_cost(shapes[:3])


def test_the_report_splits_errors_by_kind_of_step():
    rep = fit_report(StepCost(fixed=0.05), [{"decode_rows": 2, "seconds": 0.1},
                                            {"prompt_tokens": 64, "seconds": 0.05},
                                            {"prompt_tokens": 64, "decode_rows": 3, "seconds": 0.025}])
    assert rep["by_kind"]["decode"]["mean_rel_error"] == pytest.approx(-0.5)
    assert rep["by_kind"]["prompt"]["mean_rel_error"] == pytest.approx(0.0)
    assert rep["by_kind"]["mixed"]["mean_rel_error"] == pytest.approx(1.0)


def test_a_modeled_worker_prices_the_shape_a_real_loop_would_record():
    """A request over a 512-token cached prefix joins while another decodes: its prefix is
    copied in as it joins, its prompt chunks run beside the other's decode rows, and each
    leaves with its new tokens cut into blocks (not its prefix again)."""
    loop, seen = EventLoop(), []
    cost = StepCost(fixed=0.01)

    class Recording(StepCost):  # records each priced shape; prices every step 10 ms
        def seconds(self, shape):
            seen.append(shape)
            return 0.01

    rec = Recording(fixed=0.01)
    w = worker.ModeledWorker(0, PrefillProfile(0.09, 0.003, 1.5e-6), loop, step_tokens=64, costs=(rec, cost))
    w.submit(worker.Request(1, 8, 0, 4, 0.0, lambda r: None))  # 8 prompt tokens, 4 new: 1 prompt + 3 decode steps
    loop.after(0.015, lambda: w.submit(worker.Request(2, 100, 512, 2, 0.0, lambda r: None)))
    loop.run()
    first = seen[0]
    assert (first["prompt_tokens"], first["joined"], first["loaded_tokens"]) == (8, 1, 0)
    joins = [s for s in seen if s["loaded_tokens"]]
    assert len(joins) == 1 and joins[0]["joined"] == 1 and joins[0]["loaded_tokens"] == 512
    assert joins[0]["decode_rows"] == 1  # the first request decodes beside its chunk: 63 prompt tokens fit
    assert joins[0]["prompt_tokens"] == 63 and joins[0]["prompt_attn"] == 63 * (512 + 63 / 2)
    assert sum(s["prompt_tokens"] for s in seen) == 108
    assert sum(s["decode_rows"] for s in seen) == 3 + 1
    assert sum(s["finished"] for s in seen) == 2
    assert sum(s["exported_tokens"] for s in seen) == (8 + 3) + (100 + 1)  # new tokens, not the prefix
    assert w.busy_time == pytest.approx(0.01 * len(seen))


def test_a_profile_with_step_costs_uses_them_alone_and_paired_and_slows_them(tmp_path):
    alone, paired = StepCost(fixed=0.05, per_row=0.005), StepCost(fixed=0.07, per_row=0.006)
    path = tmp_path / "step_cost.json"
    path.write_text(json.dumps({"fits": {"alone": {"cost": alone.as_dict()}, "paired": {"cost": paired.as_dict()}}}))
    prof = preset_profile("a100-ib200").with_step_costs(path)
    assert prof.step_costs == (alone, paired) and "step_cost.json" in prof.source
    slow = prof.slowed(2.0)
    assert slow.step_costs[1].fixed == pytest.approx(0.14) and slow.step_costs[0].per_row == pytest.approx(0.01)

    def busy(host_mates: bool) -> float:
        return decode_busy_of_two_workers(
            lambda i, loop: worker.ModeledWorker(i, prof.worker_prefill(i), loop, costs=prof.step_costs), host_mates)

    assert busy(False) == pytest.approx(16 * 0.055)
    assert busy(True) == pytest.approx(16 * 0.076)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="neither a step-cost fit"):
        preset_profile("a100-ib200").with_step_costs(tmp_path / "bad.json")


def test_peer_shares_say_how_much_of_each_step_a_peer_was_stepping():
    a = [{"started": 10.0, "seconds": 1.0}, {"started": 11.0, "seconds": 2.0}, {"started": 20.0, "seconds": 1.0},
         {"seconds": 1.0}]  # the last: recorded before steps carried their start
    b = [{"started": 9.0, "seconds": 1.5}, {"started": 12.0, "seconds": 0.5}, {"started": 12.5, "seconds": 0.25}]
    got = peer_shares({"a": a, "b": b})
    assert got["a"] == [pytest.approx(0.5), pytest.approx(0.375), 0.0, None]
    assert got["b"] == [pytest.approx(1 / 3), 1.0, 1.0]


FIELDS = ["prompt_rows", "prompt_tokens", "prompt_attn", "decode_rows", "decode_keys", "joined", "loaded_tokens",
          "finished", "exported_tokens", "seconds", "started"]  # a bench row's step_shape_fields


def _bench(*rows: dict[str, list[dict]], fields=FIELDS) -> dict:
    """A bench results JSON whose exp 7 rows recorded these steps, by worker."""
    return {"runs": [{"exp": "exp1"}] + [
        {"exp": "exp7", "step_shape_fields": fields,
         "step_shapes": {w: [[s.get(f, 0) for f in fields] for s in steps] for w, steps in row.items()}}
        for row in rows]}


def test_steps_recorded_in_workers_fit_alone_and_beside_a_peer_apart(tmp_path):
    """A bench run's in-worker steps: those a peer overlapped fit the paired cost, the others
    the lone one; a profile priced by them is not slowed again for the host's load."""
    slow = TRUE.scaled(1.5)
    a, t = _shapes(120, seed=1), 100.0
    for s in a:  # worker a steps alone first
        s["started"], t = t, t + s["seconds"] + 0.01
    a_side = _shapes(120, seed=3)
    for x in a_side:  # then both step the same shapes side by side, each 1.5x slower
        x["seconds"], x["started"] = slow.seconds(x), t
        t += x["seconds"] + 0.001
    b_side = [dict(x) for x in a_side]
    data = _bench({"tcp://a": a}, {"tcp://a": a_side, "tcp://b": b_side})
    fit = fit_in_workers(data)
    assert fit["steps"] == {"alone": 120, "paired": 240, "every": 360}
    for term in ("fixed", "per_prompt_token", "per_row"):
        assert getattr(fit["alone"], term) == pytest.approx(getattr(TRUE, term), rel=1e-3)
        assert getattr(fit["paired"], term) == pytest.approx(getattr(slow, term), rel=1e-3)
    path = tmp_path / "bench_exp7_steps.json"
    path.write_text(json.dumps(data))
    prof = preset_profile("a100-ib200").with_step_costs(path)
    assert prof.step_costs_from == str(path) and "360 steps" in prof.source
    assert "240 steps" in prof.with_step_costs(path, skip=1).source  # the lone row left out (fidelity's hold-out)
    assert prof.slowed(2.0).step_costs == prof.step_costs  # the host's load is already in them
    assert prof.slowed(2.0).prefill[0].a == pytest.approx(2 * prof.prefill[0].a)
    # how slow the host ran during a row, whatever its work: 1 on the fit's own steps
    assert row_speed({"tcp://a": a}, TRUE, slow) == pytest.approx(1.0)
    assert row_speed({"tcp://a": a_side, "tcp://b": b_side}, TRUE, TRUE) == pytest.approx(1.5)
    assert row_speed({"tcp://a": []}, TRUE, TRUE) is None
    undated = _bench({"tcp://a": a}, fields=FIELDS[:-1])
    fit = fit_in_workers(undated)  # no start times: one fit on every step serves both
    assert fit["steps"] == {"alone": 0, "paired": 0, "every": 120} and fit["alone"] == fit["paired"]
    with pytest.raises(ValueError, match="DASKFLOW_KV_BENCH_STEP_SHAPES"):
        fit_in_workers({"runs": [{"exp": "exp7"}]})
