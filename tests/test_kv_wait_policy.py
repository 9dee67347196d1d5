"""The KV-during-a-tool-call policy (``policy.kv_wait``) on plain numbers: no cluster, no model."""

import math

import pytest

from daskflow_kv.policy.cost_model import PrefillProfile
from daskflow_kv.policy.kv_wait import (WaitFacts, decide_wait, expected_wait, explain_wait, pressure,
                                        spill_timing)
from daskflow_kv.policy.store_read import StoreProfile

MB = 1 << 20
PREFILL = PrefillProfile(0.01, 1 / 450, 0.0)  # SmolLM2 on this host's 2 cores: ~450 tok/s
STORE = StoreProfile(bandwidth=1e9, latency=0.03)
BUDGET = 512 * MB


def facts(nbytes=46 * MB, tokens=1000, durations=(2.0, 3.0, 4.0), kv=0.95 * BUDGET, budget=BUDGET,
          prefill=PREFILL, store=STORE):
    return WaitFacts(int(nbytes), tokens, tuple(durations), int(kv), budget, prefill, store)


def test_pressure_rises_between_the_watermarks():
    assert pressure(100, None) == 0.0
    assert pressure(int(0.4 * BUDGET), BUDGET) == 0.0
    assert pressure(int(0.7 * BUDGET), BUDGET) == pytest.approx(0.5)
    assert pressure(2 * BUDGET, BUDGET) == 1.0


def test_without_pressure_holding_costs_no_one_so_it_keeps():
    d = decide_wait(facts(kv=0, budget=None))
    assert d.action == "keep" and d.t_keep == 0.0 and d.pressure == 0.0
    assert d.t_spill == pytest.approx(STORE.latency)  # the write still costs its task
    assert "no memory pressure" in d.reason


def test_under_pressure_a_long_wait_spills_a_large_state():
    d = decide_wait(facts())  # 1,000 tokens: prefill 2.2 s, read back 0.08 s, wait 3 s
    assert d.action == "spill"
    assert d.t_spill < d.t_keep and d.t_spill < d.t_drop
    # a fast store: read back at the longest measured wait (holding it earlier costs more)
    assert d.prefetch_after == pytest.approx(4.0 - STORE.seconds(46 * MB))


def test_under_pressure_without_a_store_a_cheap_prefill_drops():
    d = decide_wait(facts(nbytes=46 * 1024 * 20, tokens=20, store=None))
    assert d.action == "drop" and math.isnan(d.t_spill) and d.prefetch_after is None
    assert "no store" in d.reason


def test_under_pressure_a_short_wait_keeps():
    d = decide_wait(facts(durations=(0.01, 0.02)))
    assert d.action == "keep" and d.t_keep < min(d.t_spill, d.t_drop)


def test_a_long_wait_with_an_expensive_prefill_and_no_store_keeps_over_dropping():
    d = decide_wait(facts(tokens=10_000, store=None, durations=(1.0,)))  # 22 s of prefill vs 1 s held
    assert d.action == "keep"


def test_unmeasured_tool_uses_the_default_wait_and_forced_wins():
    assert expected_wait(()) == 1.0
    assert decide_wait(facts(durations=())).expected_wait == 1.0
    d = decide_wait(facts(kv=0, budget=None), forced="drop")
    assert d.action == "drop" and d.reason == "forced"


def test_spill_timing_weighs_the_reload_left_visible_against_holding_it_early():
    # a fast store: reading back on return costs L at most; reading early costs holding: read late
    p, cost = spill_timing([1.0, 2.0, 9.0], reload_s=0.05)
    assert p == pytest.approx(9.0 - 0.05) and cost == pytest.approx(0.1 / 3)
    # a slow store and a tool that returns on time: start the read so it ends as the call does
    p, cost = spill_timing([2.0, 2.1, 2.2, 2.3], reload_s=1.5)
    assert p == pytest.approx(2.1 - 1.5) and cost == pytest.approx(0.1)  # ends between the waits, the earliest of a tie
    assert cost < 1.5  # reading on return would show the whole read
    assert spill_timing([0.1], reload_s=0.5)[0] == 0.0  # never before the call starts


def test_bad_facts_are_refused():
    with pytest.raises(ValueError):
        decide_wait(facts(durations=(-1.0,)))
    with pytest.raises(ValueError):
        decide_wait(facts(nbytes=-1))
    with pytest.raises(ValueError):
        decide_wait(facts(), forced="pin")


def test_explain_says_which_and_why():
    line = explain_wait(decide_wait(facts()))
    assert line.startswith("spill:") and "read back" in line and "pressure 1.00" in line
    assert "spill n/a" in explain_wait(decide_wait(facts(store=None)))
