"""The planner as a pure function: placements and transfer-vs-recompute decisions on plain data."""

import math

import pytest

from daskflow_kv.policy.cost_model import (
    DEFAULT_LATENCY,
    NeedsCalibration,
    PrefillProfile,
    crossover_bandwidth,
)
from daskflow_kv.policy.placement import (
    ClusterView,
    holder_of,
    plan_placements,
    read_blocks,
)

A, B, C = "tcp://a:1", "tcp://b:1", "tcp://c:1"
BLOCK = 16 * 46_080  # bytes of one 16-token block of a SmolLM2-sized model
PROFILE = PrefillProfile(0.002, 0.002, 0.0)  # 2 ms + 2 ms/token


def _match(n_blocks=4, where=(A,), partial=0):
    blocks = [{"key": f"kvblock-{i}", "start": 16 * i, "end": 16 * (i + 1), "nbytes": BLOCK, "where": list(where)}
              for i in range(n_blocks)]
    if partial:
        s = 16 * n_blocks
        blocks.append({"key": "kvblock-tail", "start": s, "end": s + partial, "nbytes": partial * 46_080,
                       "where": list(where)})
    return {"tokens": blocks[-1]["end"] if blocks else 0, "blocks": blocks}


def _view(workers=(A, B), bandwidth=None, profile=PROFILE, **kw):
    bw = {} if bandwidth is None else {(s, d): bandwidth for s in workers for d in workers if s != d}
    ws = {w: {"nthreads": 1, "processing": 0, "kv_bytes": 0} for w in workers}
    return ClusterView(ws, bw, {w: profile for w in workers} if profile else {}, **kw)


def test_branches_spread_holder_first_and_each_destination_decides_once():
    m = _match()
    out = plan_placements(_view(bandwidth=1e9), m, [64] * 4, 4, "auto")
    assert [p.worker for p in out] == [A, B, A, B]
    assert [p.action for p in out] == ["reuse", "transfer", "reuse", "transfer"]
    assert out[1].decision is out[3].decision  # one decision per destination, shared
    assert [p.first for p in out] == [True, True, False, False]
    assert out[1].decision.nbytes == 4 * BLOCK  # the needed blocks, not per branch


def test_forced_bandwidth_flips_the_decision_at_the_crossover():
    m = _match()
    nbytes, tokens = 4 * BLOCK, 64
    x = crossover_bandwidth(nbytes, tokens, PROFILE, DEFAULT_LATENCY)
    assert 0 < x < math.inf
    low = plan_placements(_view(bandwidth_override=x * 0.9), m, [tokens], 1, "auto", workers=[B])[0]
    high = plan_placements(_view(bandwidth_override=x * 1.1), m, [tokens], 1, "auto", workers=[B])[0]
    at = plan_placements(_view(bandwidth_override=x), m, [tokens], 1, "auto", workers=[B])[0]
    assert (low.worker, low.action) == (B, "recompute")
    assert (high.worker, high.action) == (B, "transfer")
    assert at.action == "recompute"  # ties go to recompute
    assert low.recompute_tokens == tokens and high.recompute_tokens == 0
    assert high.decision.t_transfer == pytest.approx(DEFAULT_LATENCY + nbytes / (x * 1.1))
    assert low.decision.t_recompute == pytest.approx(PROFILE.seconds(tokens))


def test_huge_state_against_cheap_prefill_recomputes():
    m = _match(n_blocks=8)
    cheap = PrefillProfile.from_rate(1e7)
    p = plan_placements(_view(bandwidth=1e9, profile=cheap), m, [128], 1, "auto", workers=[B])[0]
    assert p.action == "recompute" and p.decision.t_recompute < p.decision.t_transfer


def test_forced_policies_and_pin():
    m = _match()
    t = plan_placements(_view(), m, [64, 64], 2, "transfer")  # no measurements needed when forced
    assert [p.action for p in t] == ["reuse", "transfer"]
    r = plan_placements(_view(), m, [64, 64], 2, "recompute")
    assert [p.action for p in r] == ["reuse", "recompute"] and r[1].recompute_tokens == 64
    pin = plan_placements(_view(), m, [64] * 3, 3, "pin")
    assert {p.worker for p in pin} == {A} and {p.action for p in pin} == {"reuse"}


def test_auto_without_measurements_asks_for_calibration():
    with pytest.raises(NeedsCalibration):
        plan_placements(_view(bandwidth=None), _match(), [64, 64], 2, "auto")
    with pytest.raises(NeedsCalibration):
        plan_placements(_view(bandwidth=1e9, profile=None), _match(), [64, 64], 2, "auto")
    # nothing to move: no measurement needed
    assert plan_placements(_view(bandwidth=None), _match(), [64], 1, "auto")[0].action == "reuse"


def test_workers_limit_the_pool_even_for_one_branch():
    p = plan_placements(_view(bandwidth=1e9), _match(), [64], 1, "transfer", workers=[B])[0]
    assert p.worker == B and p.action == "transfer"
    q = plan_placements(_view(workers=(A, B, C), bandwidth=1e9), _match(), [64] * 3, 3, "transfer", workers=[B, C])
    assert [p.worker for p in q] == [B, C, B]


def test_only_blocks_missing_on_the_destination_count():
    m = _match()
    m["blocks"][0]["where"] = [A, B]  # a replica of the first block is already on B
    m["blocks"][1]["where"] = [A, B]
    p = plan_placements(_view(bandwidth=1e9), m, [64], 1, "transfer", workers=[B])[0]
    assert p.decision.nbytes == 2 * BLOCK
    for b in m["blocks"]:
        b["where"] = [A, B]
    q = plan_placements(_view(bandwidth=None), m, [64], 1, "auto", workers=[B])[0]
    assert q.action == "reuse"


def test_partial_prefix_reads_fewer_blocks():
    m = _match(n_blocks=4, partial=5)
    assert [b["key"] for b in read_blocks(m, 20)] == ["kvblock-0", "kvblock-1"]
    assert len(read_blocks(m, 64)) == 4 and len(read_blocks(m, 65)) == 5
    p = plan_placements(_view(bandwidth=1e9), m, [20], 1, "transfer", workers=[B])[0]
    assert p.decision.nbytes == 2 * BLOCK and p.decision.missing_tokens == 20


def test_destination_decision_covers_its_longest_branch():
    m = _match()
    out = plan_placements(_view(bandwidth=1e9), m, [63, 64, 63, 64], 4, "recompute", workers=[B])
    assert {p.worker for p in out} == {B}
    assert out[0].recompute_tokens == 64 and all(p.recompute_tokens == 0 for p in out[1:])
    assert len({id(p.decision) for p in out}) == 1


def test_pending_blocks_count_where_they_are_planned_and_unknown_location_defers_to_dask():
    m = _match(where=(B,))  # "where" of a block still being computed: its planned worker
    assert holder_of(m["blocks"]) == B
    assert plan_placements(_view(), m, [64], 1, "auto")[0].worker == B
    nowhere = _match(where=())
    p = plan_placements(_view(), nowhere, [64, 64], 2, "auto")
    assert [q.decision for q in p] == [None, None] and [q.reused for q in p] == [64, 64]


def test_nothing_cached_places_on_least_loaded():
    view = _view()
    view.workers[A]["processing"] = 3
    p = plan_placements(view, {"tokens": 0, "blocks": []}, [0], 1, "pin")[0]
    assert p.worker == B and p.decision is None and p.reused == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        plan_placements(_view(), _match(), [64], 1, "teleport")
    with pytest.raises(ValueError, match="reuse counts"):
        plan_placements(_view(), _match(), [64], 2, "auto")
