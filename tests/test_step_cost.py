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
from daskflow_kv.sim.step_cost import TERMS, StepCost, fit_report, fit_step_cost

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
    with pytest.raises(ValueError, match="no 'alone'"):
        preset_profile("a100-ib200").with_step_costs(tmp_path / "bad.json")
