"""Transfer vs recompute on plain numbers: fitting, decisions, crossovers, explanations."""

import math
import random
import subprocess
import sys

import pytest

from daskflow_kv.policy.cost_model import (
    DEFAULT_LATENCY,
    LinkProfile,
    NeedsCalibration,
    PrefillProfile,
    PrefillSample,
    crossover_bandwidth,
    crossover_tokens,
    decide,
    explain,
    fit_prefill_profile,
    kv_bytes_per_token,
    needs_calibration,
)

GRID = [(n, p) for n in (16, 64, 256, 1024) for p in (0, 128, 2048)]


def synth(a, b, c, noise=0.0, seed=0):
    rng = random.Random(seed)
    out = []
    for n, p in GRID:
        t = a + b * n + c * n * (p + n / 2)
        out.append(PrefillSample(n, p, t * (1 + rng.uniform(-noise, noise))))
    return out


# -- fitting ---------------------------------------------------------------------------------


def test_fit_recovers_known_coefficients():
    prof = fit_prefill_profile(synth(0.003, 2.2e-3, 4e-8))
    assert prof.a == pytest.approx(0.003, rel=1e-6)
    assert prof.b == pytest.approx(2.2e-3, rel=1e-6)
    assert prof.c == pytest.approx(4e-8, rel=1e-6)
    assert prof.seconds(300, 700) == pytest.approx(0.003 + 2.2e-3 * 300 + 4e-8 * 300 * 850, rel=1e-6)


def test_fit_with_noise_predicts_within_noise():
    prof = fit_prefill_profile(synth(0.01, 1e-3, 2e-8, noise=0.02, seed=3))
    for n, p in [(100, 0), (500, 1000), (2000, 4000)]:
        truth = 0.01 + 1e-3 * n + 2e-8 * n * (p + n / 2)
        assert prof.seconds(n, p) == pytest.approx(truth, rel=0.05)


def test_fit_zero_term_stays_zero_and_coefficients_never_negative():
    prof = fit_prefill_profile(synth(0.0, 1e-3, 1e-8))
    assert prof.a == pytest.approx(0.0, abs=1e-12)
    assert prof.b == pytest.approx(1e-3, rel=1e-6)
    # Data that an unconstrained fit would explain with a negative fixed cost.
    prof = fit_prefill_profile(synth(-0.005, 1e-3, 1e-8))
    assert min(prof.a, prof.b, prof.c) >= 0.0
    assert prof.a == 0.0
    assert prof.b > 0


def test_fit_with_one_or_two_samples_is_a_rate():
    one = fit_prefill_profile([PrefillSample(100, 0, 0.25)])
    assert (one.a, one.c) == (0.0, 0.0)
    assert one.b == pytest.approx(0.0025)
    assert one.tokens_per_second == pytest.approx(400.0)
    two = fit_prefill_profile([PrefillSample(100, 0, 0.2), PrefillSample(300, 50, 0.6)])
    assert two.b == pytest.approx(0.8 / 400)
    assert two.c == 0.0


def test_fit_degenerate_samples_give_a_rate_and_no_samples_raise():
    prof = fit_prefill_profile([PrefillSample(64, 0, 0.128)] * 5)
    assert (prof.a, prof.c) == (0.0, 0.0)
    assert prof.b == pytest.approx(0.002)
    with pytest.raises(ValueError):
        fit_prefill_profile([])
    with pytest.raises(ValueError):
        fit_prefill_profile([PrefillSample(0, 10, 0.1)])


def test_updated_refits_on_a_bounded_window():
    old = fit_prefill_profile(synth(0.0, 1e-3, 0.0))
    slow = [PrefillSample(n, p, 3e-3 * n) for n, p in GRID[:6]]
    new = old.updated(slow, max_samples=6)
    assert len(new.samples) == 6
    assert new.samples == tuple(slow)
    assert new.b == pytest.approx(3e-3, rel=1e-6)
    assert old.b == pytest.approx(1e-3, rel=1e-6)  # frozen: the old profile is unchanged
    mixed = old.updated(slow, max_samples=64)
    assert len(mixed.samples) == len(GRID) + 6
    assert 1e-3 < mixed.seconds(256) / 256 < 3e-3


def test_profile_basics():
    prof = PrefillProfile.from_rate(450.0)
    assert prof.tokens_per_second == pytest.approx(450.0)
    assert prof.seconds(0, 1000) == 0.0
    assert PrefillProfile(0.5, 0.0, 0.0).seconds(1) == 0.5
    with pytest.raises(ValueError):
        PrefillProfile.from_rate(0)
    assert LinkProfile(1e9).seconds(5e8) == pytest.approx(DEFAULT_LATENCY + 0.5)


def test_kv_bytes_per_token_smollm2():
    assert kv_bytes_per_token(30, 3, 64, 4) == 46_080
    assert kv_bytes_per_token(30, 3, 64, 2) == 23_040


# -- decisions -------------------------------------------------------------------------------

# Exact in binary floating point: recompute 512 tokens = 0.5 s, latency 0.25 s, 1 MiB.
PREFILL = PrefillProfile(0.0, 1 / 1024, 0.0)
NBYTES, TOKENS, LAT = 1 << 20, 512, 0.25
CROSS = float(1 << 22)  # 2**20 B / 2**22 B/s = 0.25 s, + 0.25 s latency = 0.5 s


def run(bandwidth, **kw):
    args = {"nbytes": NBYTES, "missing_tokens": TOKENS, "prefix_tokens": 0, "src": "w1",
            "dst": "w2", "link": LinkProfile(bandwidth, LAT), "prefill": PREFILL}
    args.update(kw)
    return decide(**args)


def test_low_bandwidth_recomputes_high_bandwidth_transfers():
    low = run(1e5)
    assert low.action == "recompute"
    assert low.t_transfer == pytest.approx(LAT + NBYTES / 1e5)
    assert low.t_recompute == pytest.approx(0.5)
    high = run(1e10)
    assert high.action == "transfer"
    assert high.t_transfer == pytest.approx(LAT + NBYTES / 1e10)
    assert high.cost == high.score_transfer


def test_exact_crossover_goes_to_recompute():
    assert crossover_bandwidth(NBYTES, TOKENS, PREFILL, LAT) == CROSS
    at = run(CROSS)
    assert at.t_transfer == at.t_recompute == 0.5
    assert at.action == "recompute"
    assert run(CROSS * (1 + 1e-9)).action == "transfer"
    assert run(CROSS * (1 - 1e-9)).action == "recompute"


def test_crossover_bandwidth_is_inf_when_latency_alone_loses():
    assert crossover_bandwidth(NBYTES, 10, PREFILL, LAT) == math.inf  # 10 tokens: 9.8 ms < 250 ms
    assert run(1e15, missing_tokens=10).action == "recompute"


def test_prefix_depth_makes_recompute_dearer():
    prof = PrefillProfile(0.0, 1e-3, 1e-6)
    # transfer ~1.0 s; recompute 0.64 s at the start, 2.8 s after 4000 cached tokens
    shallow = run(1.4e6, prefill=prof, prefix_tokens=0)
    deep = run(1.4e6, prefill=prof, prefix_tokens=4000)
    assert deep.t_recompute == pytest.approx(1e-3 * 512 + 1e-6 * 512 * (4000 + 256))
    assert deep.t_recompute > shallow.t_recompute
    assert (shallow.action, deep.action) == ("recompute", "transfer")


def test_crossover_tokens_matches_decide():
    bpt = 46_080
    link = LinkProfile(3e9, DEFAULT_LATENCY)
    prof = PrefillProfile.from_rate(450.0)
    n = crossover_tokens(bpt, link, prof)
    assert n is not None and n > 1
    at = decide(n * bpt, n, 0, "a", "b", link, prof)
    below = decide((n - 1) * bpt, n - 1, 0, "a", "b", link, prof)
    assert (below.action, at.action) == ("recompute", "transfer")
    # A link slower than prefill per token never wins.
    assert crossover_tokens(bpt, LinkProfile(1e3), prof) is None


def test_reuse_when_blocks_are_on_dst_or_nothing_missing():
    same = run(1e5, src="w2", memory_weight=1.0)
    assert same.action == "reuse"
    assert (same.t_transfer, same.t_recompute, same.memory_cost, same.cost) == (0, 0, 0, 0)
    # Reuse needs no measurement at all.
    assert run(1e5, src="w2", link=None, prefill=None).action == "reuse"
    assert run(1e5, missing_tokens=0, nbytes=0).action == "reuse"


def test_no_cached_copy_recomputes():
    d = run(1e10, src=None)
    assert d.action == "recompute"
    assert d.t_transfer == math.inf
    assert d.t_recompute == pytest.approx(0.5)
    with pytest.raises(ValueError):
        run(1e10, src=None, forced="transfer")


def test_forced_overrides_the_comparison():
    d = run(1e5, forced="transfer")
    assert d.action == "transfer" and d.reason == "forced by policy"
    assert d.t_transfer > d.t_recompute
    d = run(1e10, forced="recompute")
    assert d.action == "recompute" and d.reason == "forced by policy"
    assert d.t_transfer < d.t_recompute
    assert run(1e10, forced="recompute", link=None).action == "recompute"
    with pytest.raises(ValueError):
        run(1e10, forced="teleport")


def test_memory_weight_is_charged_to_both_and_does_not_flip():
    lam = 1e-7  # s per byte
    d = run(1e10, memory_weight=lam)
    assert d.memory_cost == pytest.approx(lam * NBYTES)
    assert d.score_transfer == pytest.approx(d.t_transfer + lam * NBYTES)
    assert d.score_recompute == pytest.approx(d.t_recompute + lam * NBYTES)
    assert d.action == run(1e10).action == "transfer"
    assert d.cost > run(1e10).cost


def test_missing_measurements_raise_and_are_listed():
    assert needs_calibration(None, None) == ["link bandwidth src->dst", "prefill profile on dst"]
    assert needs_calibration(LinkProfile(1e9), None) == ["prefill profile on dst"]
    assert needs_calibration(LinkProfile(1e9), PREFILL) == []
    with pytest.raises(NeedsCalibration, match="link bandwidth"):
        run(1e9, link=None)
    with pytest.raises(NeedsCalibration, match="prefill profile"):
        run(1e9, prefill=None)


def test_explain_has_the_numbers():
    d = decide(2_949_120, 64, 128, "w1", "w2", LinkProfile(3e9, 0.014), PrefillProfile.from_rate(450.0))
    line = explain(d)
    assert d.action == "transfer"
    assert line.startswith("transfer w1->w2")
    assert "2.95 MB" in line and "3.00 GB/s" in line
    assert "15.0 ms" in line  # 14 ms latency + 0.98 ms on the wire
    assert f"{64 / 450 * 1e3:.1f} ms" in line  # 142.2 ms
    assert "64 tok after 128" in line
    assert d.reason in line
    assert "inf" in explain(run(1e9, src=None))


def test_policy_modules_import_without_heavy_dependencies():
    """Policy loads without torch, numpy, distributed or transformers. ``dask`` itself is there:
    ``import daskflow_kv`` registers its settings in dask.config, as distributed does; the
    policy modules never import it (tests/test_layout.py reads their imports)."""
    code = ("import sys, daskflow_kv.policy.cost_model, daskflow_kv.policy.eviction, daskflow_kv.policy.placement; "
            "heavy = {'torch', 'numpy', 'distributed', 'transformers'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
