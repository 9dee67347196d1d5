"""The calibration-spread measurement: its fits and spread on plain data, and one real trial."""

import json

import pytest

from daskflow_kv.bench import calibration_spread as cs
from daskflow_kv.policy.cost_model import PrefillProfile, PrefillSample, calibration_lengths


def _samples(profile: PrefillProfile, lengths, slow: dict[int, float]) -> list[PrefillSample]:
    return [PrefillSample(n, 0, profile.seconds(n) * slow.get(i, 1.0)) for i, n in enumerate(lengths)]


def test_later_rounds_pull_a_slow_first_probe_back():
    true = PrefillProfile(0.05, 2e-3, 1.5e-6)
    lengths = calibration_lengths(1024)
    rounds = _samples(true, lengths, {0: 3.0}) + _samples(true, lengths, {}) + _samples(true, lengths, {})
    f = cs.fits(rounds, len(lengths))
    short = lambda p: p.seconds(32)  # noqa: E731
    # the first round alone takes the slow 64-token probe for the price of every short prefill
    assert short(f["first_round"]) > 1.5 * short(true)
    assert short(f["all_rounds"]) == pytest.approx(short(true), rel=0.25)


def test_spread_is_max_over_min_of_each_fit():
    rows = [{"first_round": [0.1, 1e-3, 0.0], "all_rounds": [0.05, 1e-3, 0.0]},
            {"first_round": [0.2, 1e-3, 0.0], "all_rounds": [0.05, 1e-3, 0.0]}]
    s = cs.spread(rows, shapes=((100, 0),))
    assert s["first_round 100+0"]["spread"] == pytest.approx(0.3 / 0.2)
    assert s["all_rounds 100+0"]["spread"] == pytest.approx(1.0)


def test_one_trial_on_a_real_cluster(tmp_path):
    out = tmp_path / "spread.json"
    assert cs.main(["--trials", "1", "--rounds", "2", "--model", "tiny-llama", "--probe-tokens", "128",
                    "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    per_round = len(calibration_lengths(128))
    assert len(doc["rows"]) == 2  # both workers
    assert all(len(r["seconds"]) == 2 * per_round and min(r["seconds"]) > 0 for r in doc["rows"])
    assert all(v["spread"] >= 1.0 for v in doc["spread"].values())


def test_bad_arguments_are_refused_before_any_cluster(capsys):
    with pytest.raises(SystemExit):
        cs.main(["--rounds", "1", "--out", "x.json"])
    assert "--rounds" in capsys.readouterr().err
