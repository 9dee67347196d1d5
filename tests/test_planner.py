"""The planner as a pure function: earliest-finish-time placement and per-destination decisions."""

import math
from dataclasses import FrozenInstanceError, replace

import pytest

from daskflow_kv.policy.cost_model import (
    DEFAULT_LATENCY,
    NeedsCalibration,
    PrefillProfile,
    crossover_bandwidth,
)
from daskflow_kv.policy.placement import (
    CachedBlock,
    ClusterView,
    PrefixMatch,
    WorkerLoad,
    batch_seconds,
    held_prefix,
    holder_of,
    materialize_policy,
    plan_placements,
    read_blocks,
)

A, B, C = "tcp://a:1", "tcp://b:1", "tcp://c:1"
BLOCK = 16 * 46_080  # bytes of one 16-token block of a SmolLM2-sized model
PROFILE = PrefillProfile(0.002, 0.002, 0.0)  # 2 ms per call + 2 ms per token


def _match(n_blocks=4, where=(A,), partial=0, cached=True):
    """``cached``: the blocks exist (who_has); else they are still being computed where ``where`` says."""
    who = tuple(where) if cached else ()
    blocks = [CachedBlock(f"kvblock-{i}", 16 * i, 16 * (i + 1), BLOCK, who, tuple(where)) for i in range(n_blocks)]
    if partial:
        s = 16 * n_blocks
        blocks.append(CachedBlock("kvblock-tail", s, s + partial, partial * 46_080, who, tuple(where)))
    return PrefixMatch(blocks[-1].end if blocks else 0, tuple(blocks))


def _held_on(m, workers, n=None):
    """``m`` with its first ``n`` blocks (all: None) cached on ``workers``."""
    n = len(m.blocks) if n is None else n
    blocks = [replace(b, where=tuple(workers), who_has=tuple(workers)) for b in m.blocks[:n]]
    return replace(m, blocks=tuple(blocks) + m.blocks[n:])


def _view(workers=(A, B), bandwidth=None, profile=PROFILE, busy=None, **kw):
    bw = {} if bandwidth is None else {(s, d): bandwidth for s in workers for d in workers if s != d}
    ws = {w: WorkerLoad(1, 0, 0, (busy or {}).get(w, 0.0)) for w in workers}
    return ClusterView(ws, bw, {w: profile for w in workers} if profile else {}, **kw)


def test_cheap_batching_keeps_every_branch_with_the_blocks():
    """Decode batched on the holder costs one call per step: moving the prefix buys nothing."""
    out = plan_placements(_view(bandwidth=1e9, profile=PrefillProfile(0.05, 1e-5, 0.0)), _match(), [64] * 4, 4,
                          new_tokens=[8] * 4, max_new_tokens=16)
    assert {p.worker for p in out} == {A} and {p.action for p in out} == {"reuse"}
    assert [p.first for p in out] == [True, False, False, False]


def test_costly_decode_spreads_branches_and_each_destination_decides_once():
    """Per-token work dominates: half the branches go to B, which fetches the blocks once."""
    out = plan_placements(_view(bandwidth=1e9, profile=PrefillProfile(0.0, 0.01, 0.0)), _match(), [64] * 4, 4,
                          new_tokens=[8] * 4, max_new_tokens=16)
    on_b = [p for p in out if p.worker == B]
    assert len(on_b) == 2 and {p.action for p in on_b} == {"transfer"}
    assert on_b[0].decision is on_b[1].decision and [p.first for p in on_b] == [True, False]
    assert on_b[0].decision.nbytes == 4 * BLOCK  # the blocks the destination needs, once
    assert all(p.finish_s > 0 and set(p.candidates) == {A, B} for p in out)


def test_idle_worker_rebuilds_a_prefix_still_being_made_instead_of_waiting_for_it():
    """The 0.86x case: A is prefilling the context; B, idle, prefills it too rather than wait + fetch."""
    prof = PrefillProfile(0.0, 0.01, 0.0)
    making = 64 * 0.01  # A's queue: the prefix's own prefill
    view = _view(bandwidth=1e8, profile=prof, busy={A: making})
    out = plan_placements(view, _match(cached=False), [64] * 4, 4, new_tokens=[8] * 4, max_new_tokens=16)
    on_b = [p for p in out if p.worker == B]
    assert on_b and on_b[0].action == "recompute" and on_b[0].recompute_tokens == 64
    d = on_b[0].decision
    assert d.src_ready == pytest.approx(making) and d.start_recompute < d.start_transfer


def test_busy_destination_takes_a_copy_instead_of_queueing_a_rebuild():
    """B has 5 s of work queued: fetching (beside that work) beats prefilling after it."""
    view = _view(bandwidth=1e8, profile=PrefillProfile(0.0, 0.01, 0.0), busy={B: 5.0})
    [p] = plan_placements(view, _match(), [64], 1, workers=[B])
    assert p.worker == B and p.action == "transfer"
    assert p.decision.start_transfer == pytest.approx(5.0)  # the fetch ran while B was busy


def test_partial_recompute_prefills_only_what_the_destination_lacks():
    m = _held_on(_match(), [A, B], 2)  # B already holds the first 32 tokens
    assert held_prefix(m, 64, B) == 32 and held_prefix(m, 64, A) == 64
    [p] = plan_placements(_view(bandwidth=1e3), m, [64], 1, workers=[B])  # a slow link: rebuild
    assert p.action == "recompute" and p.held_tokens == 32
    d = p.decision
    assert (d.missing_tokens, d.prefix_tokens, d.nbytes) == (32, 32, 2 * BLOCK)
    assert d.t_recompute == pytest.approx(PROFILE.seconds(32, 32))
    # what the rebuild prefills (and what a run reports as rebuilt): the 32 missing, not all 64
    assert p.recompute_tokens == 64 and p.rebuilt_tokens == 32


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


def test_fitted_latency_is_used_for_the_link():
    view = _view(bandwidth=1e9, latency={(A, B): 0.002})
    assert view.link(A, B).latency == 0.002 and view.link(B, A).latency == 0.002
    assert _view(bandwidth=1e9).link(A, B).latency == DEFAULT_LATENCY


def test_huge_state_against_cheap_prefill_recomputes():
    cheap = PrefillProfile.from_rate(1e7)
    p = plan_placements(_view(bandwidth=1e9, profile=cheap), _match(n_blocks=8), [128], 1, "auto", workers=[B])[0]
    assert p.action == "recompute" and p.decision.t_recompute < p.decision.t_transfer


def test_forced_policies_and_pin():
    m = _match()
    t = plan_placements(_view(), m, [64, 64], 2, "transfer", workers=[B])  # no measurements needed when forced
    assert {p.action for p in t} == {"transfer"}
    r = plan_placements(_view(), m, [64, 64], 2, "recompute", workers=[B])
    assert {p.action for p in r} == {"recompute"} and r[0].recompute_tokens == 64
    pin = plan_placements(_view(), m, [64] * 3, 3, "pin")
    assert {p.worker for p in pin} == {A} and {p.action for p in pin} == {"reuse"}


def test_auto_without_measurements_asks_for_calibration():
    with pytest.raises(NeedsCalibration):
        plan_placements(_view(bandwidth=None), _match(), [64], 1, "auto", workers=[B])
    with pytest.raises(NeedsCalibration):
        plan_placements(_view(bandwidth=1e9, profile=None), _match(), [64, 64], 2, "auto")
    # one branch, one worker, everything there: nothing to measure
    assert plan_placements(_view(workers=(A,), bandwidth=None), _match(), [64], 1, "auto")[0].action == "reuse"


def test_workers_limit_the_pool():
    p = plan_placements(_view(bandwidth=1e9), _match(), [64], 1, "transfer", workers=[B])[0]
    assert p.worker == B and p.action == "transfer"
    q = plan_placements(_view(workers=(A, B, C), bandwidth=1e9), _match(), [64] * 3, 3, "transfer", workers=[B, C])
    assert {p.worker for p in q} <= {B, C}


def test_only_blocks_missing_on_the_destination_count():
    m = _held_on(_match(), [A, B], 2)  # replicas of the first two blocks are already on B
    p = plan_placements(_view(bandwidth=1e9), m, [64], 1, "transfer", workers=[B])[0]
    assert p.decision.nbytes == 2 * BLOCK
    m = _held_on(m, [A, B])
    q = plan_placements(_view(bandwidth=None), m, [64], 1, "auto", workers=[B])[0]
    assert q.action == "reuse"


def test_partial_prefix_reads_fewer_blocks():
    m = _match(n_blocks=4, partial=5)
    assert [b.key for b in read_blocks(m, 20)] == ["kvblock-0", "kvblock-1"]
    assert len(read_blocks(m, 64)) == 4 and len(read_blocks(m, 65)) == 5
    p = plan_placements(_view(bandwidth=1e9), m, [20], 1, "transfer", workers=[B])[0]
    assert p.decision.nbytes == 2 * BLOCK and p.decision.missing_tokens == 20


def test_destination_decision_covers_its_longest_branch():
    out = plan_placements(_view(bandwidth=1e9), _match(), [63, 64, 63, 64], 4, "recompute", workers=[B])
    assert {p.worker for p in out} == {B}
    assert out[0].recompute_tokens == 64 and all(p.recompute_tokens == 0 for p in out[1:])
    assert len({id(p.decision) for p in out}) == 1


def test_pending_blocks_count_where_they_are_planned_and_unknown_location_defers_to_dask():
    m = _match(where=(B,), cached=False)  # "where" of a block still being computed: its planned worker
    assert holder_of(m.blocks) == B
    assert plan_placements(_view(bandwidth=1e9), m, [64], 1, "auto")[0].worker == B
    nowhere = _match(where=())
    p = plan_placements(_view(), nowhere, [64, 64], 2, "auto")
    assert [q.decision for q in p] == [None, None] and [q.reused for q in p] == [64, 64]


def test_nothing_cached_places_on_the_least_busy():
    p = plan_placements(_view(busy={A: 3.0}), PrefixMatch(0), [0], 1, "pin")[0]
    assert p.worker == B and p.decision is None and p.reused == 0


def test_batch_cost_grows_with_branches_and_decode_steps():
    one = batch_seconds(PROFILE, 64, [8], 16)
    assert batch_seconds(PROFILE, 64, [8, 8], 16) > one > batch_seconds(PROFILE, 64, [8], 1)
    assert batch_seconds(PROFILE, 64, [], 16) == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        plan_placements(_view(), _match(), [64], 1, "teleport")
    with pytest.raises(ValueError, match="reuse counts"):
        plan_placements(_view(), _match(), [64], 2, "auto")


def test_near_equal_finish_keeps_the_branch_where_the_prefix_is_being_made():
    """B's profile is 5% faster (noise): rebuilding there would not really finish sooner, and
    it would waste the prefill running on A. Within the tie margin the holder wins."""
    a_prof, b_prof = PrefillProfile(0.0, 0.0100, 0.0), PrefillProfile(0.0, 0.0095, 0.0)
    view = replace(_view(bandwidth=1e8, busy={A: 64 * 0.01}), prefill={A: a_prof, B: b_prof})
    [p] = plan_placements(view, _match(cached=False), [64], 1, new_tokens=[8], max_new_tokens=4)
    assert p.worker == A and p.action == "reuse"
    assert p.candidates[B] < p.candidates[A]  # B was predicted (slightly) sooner


# -- the typed inputs: the plugin's answers, converted once ------------------------------------------
SNAPSHOT = {
    "workers": {A: {"nthreads": 2, "processing": 1, "kv_bytes": 10, "busy_s": 0.5}, B: {"nthreads": 1}},
    "prefill_profiles": {A: {"a": 0.0, "b": 0.01, "c": 0.0}},
    "memory_weight": None,
}


def test_snapshot_links_are_keyed_by_worker_pairs():
    view = ClusterView.from_snapshot({**SNAPSHOT, "links": [[A, B, 1e9, 0.002], [B, A, 2e9, None]]}, None, PROFILE)
    assert view.bandwidth == {(A, B): 1e9, (B, A): 2e9} and view.latency == {(A, B): 0.002}
    assert view.workers[A] == WorkerLoad(2, 1, 10, 0.5) and view.workers[B] == WorkerLoad(1, 0, 0, 0.0)
    assert view.profile(B) == PROFILE and view.memory_weight == 0.0
    assert view.link(B, A).bandwidth == 2e9 and view.link(B, A).latency == 0.002  # either direction's latency


def test_snapshot_without_links_reads_the_old_string_pairs():
    old = {**SNAPSHOT, "bandwidth": {f"{A}->{B}": 1e9}, "latency": {f"{A}->{B}": 0.002}}
    new = {**SNAPSHOT, "links": [[A, B, 1e9, 0.002]]}
    assert ClusterView.from_snapshot(old) == ClusterView.from_snapshot(new)
    assert ClusterView.from_snapshot({**SNAPSHOT, "bandwidth": {}}).link(A, B) is None


def test_queueing_work_gives_a_new_view():
    view = _view(busy={A: 1.0})
    later = view.with_queue(A, 3.0).with_queue(B, 2.0).with_queue(C, 9.0)  # C is not a worker: ignored
    assert (later.busy(A), later.busy(B), later.busy(C)) == (3.0, 2.0, 0.0)
    assert view.with_queue(A, 0.5).busy(A) == 1.0  # a queue only grows
    assert (view.busy(A), view.busy(B)) == (1.0, 0.0)  # the old view is unchanged
    with pytest.raises(FrozenInstanceError):
        view.workers[A].busy_s = 5.0


def test_lookup_answer_rows_become_cached_blocks():
    ans = {"tokens": 20, "blocks": [
        {"key": "k0", "start": 0, "end": 16, "nbytes": 8, "who_has": [A], "where": [A, B], "state": "memory"},
        {"key": "k1", "start": 16, "end": 20, "nbytes": 2, "who_has": [B]},  # no "where": its holders
    ]}
    m = PrefixMatch.from_answer(ans)
    assert m == PrefixMatch(20, (CachedBlock("k0", 0, 16, 8, (A,), (A, B)), CachedBlock("k1", 16, 20, 2, (B,), (B,))))
    assert holder_of(m.blocks) == B and held_prefix(m, 20, B) == 20 and held_prefix(m, 20, A) == 16


# -- under load: compute is priced, not only time (Preble's E2, with a move) ------------------------
def _making_view(busy_b: float, busy_a: float = 1.0):
    """A is still prefilling the context (``busy_a`` s of queue); B has ``busy_b`` s queued."""
    return _view(bandwidth=1e8, profile=PrefillProfile(0.0, 0.01, 0.0), busy={A: busy_a, B: busy_b})


def test_saturated_cluster_moves_the_prefix_instead_of_rebuilding_it():
    """Both workers have work queued: B would start sooner by rebuilding (0.74 s against the
    1.04 s the blocks need to reach it), but that rebuild takes 0.64 s of compute from the
    requests queued there; the blocks are fetched once A has them."""
    out = plan_placements(_making_view(0.1), _match(cached=False), [64] * 4, 4, new_tokens=[8] * 4, max_new_tokens=16)
    assert "recompute" not in {p.action for p in out}
    for p in out:
        if p.worker == B:
            assert p.decision.loaded and "queued work" in p.decision.reason


def test_under_load_a_prefix_queued_far_behind_on_its_source_is_rebuilt_not_waited_for():
    """A's queue holds 20 s before the blocks exist: waiting for them would cost B's request
    far more than the 0.64 s of compute a rebuild takes (exp 7: a 37-token system line still
    queued on the other worker pulled every new document's prefill there)."""
    [p] = plan_placements(_making_view(0.1, busy_a=20.0), _match(cached=False), [64], 1, workers=[B])
    assert p.action == "recompute" and p.decision.loaded and "late" in p.decision.reason
    assert p.decision.start_transfer > p.decision.start_recompute + (p.decision.t_recompute - p.decision.t_transfer)


def test_a_spare_worker_still_rebuilds_in_parallel():
    """The same prefix, B idle: its compute is free, rebuilding there ends sooner."""
    out = plan_placements(_making_view(0.0), _match(cached=False), [64] * 4, 4, new_tokens=[8] * 4, max_new_tokens=16)
    on_b = [p for p in out if p.worker == B]
    assert on_b and on_b[0].action == "recompute" and not on_b[0].decision.loaded


def test_skewed_load_explores_the_less_loaded_worker_and_moves_the_prefix():
    """The holder has 10 s queued, B 0.5 s: the branches go to B and fetch the cached prefix."""
    view = _view(bandwidth=1e8, profile=PrefillProfile(0.0, 0.01, 0.0), busy={A: 10.0, B: 0.5})
    out = plan_placements(view, _match(), [64] * 4, 4, new_tokens=[8] * 4, max_new_tokens=16)
    assert {p.worker for p in out} == {B} and {p.action for p in out} == {"transfer"}
    assert out[0].decision.loaded


def test_a_worker_with_a_task_running_is_not_idle_whatever_its_predicted_queue():
    """Predictions run short under load: a worker still stepping through its batch can show
    no predicted seconds left. A rebuild there is not free compute: the prefix is fetched."""
    ws = {A: WorkerLoad(1, 1, 0, 1.0), B: WorkerLoad(1, 2, 0, 0.0)}  # B: two tasks running, 0 s predicted
    view = ClusterView(ws, {(A, B): 1e8, (B, A): 1e8}, {w: PrefillProfile(0.0, 0.01, 0.0) for w in ws})
    assert view.loaded([A, B])
    [p] = plan_placements(view, _match(cached=False), [64], 1, workers=[B])
    assert p.action == "transfer" and p.decision.loaded
    idle = ClusterView({**ws, B: WorkerLoad(1, 0, 0, 0.0)}, view.bandwidth, view.prefill)
    assert not idle.loaded([A, B])
    [p] = plan_placements(idle, _match(cached=False), [64], 1, workers=[B])
    assert p.action == "recompute" and not p.decision.loaded  # truly idle: its compute is free


def test_explain_names_the_load_term():
    from daskflow_kv.policy.cost_model import explain

    view = _view(bandwidth=1e8, profile=PrefillProfile(0.0, 0.01, 0.0), busy={A: 10.0, B: 0.5})
    [p] = plan_placements(view, _match(), [64], 1, workers=[B])
    assert "cluster loaded: compute priced" in explain(p.decision)
    assert not _view(busy={A: 1.0}).loaded([A, B]) and _view(busy={A: 1.0, B: 1.0}).loaded([A, B])


def test_a_worker_not_calibrated_yet_is_estimated_from_the_measured_ones():
    c = "tcp://c:3"  # a worker a nanny restarted: no profile, no measured link
    v = replace(_view(bandwidth=1e9), workers={**_view().workers, c: WorkerLoad(1, 0, 0, 0.0)},
                default_bandwidth=1e8)
    assert v.profile(c) is None and v.link(A, c) is None
    est = v.with_fallbacks()
    assert est.profile(c) == PROFILE and est.link(A, c).bandwidth == 1e8 and est.link(A, B).bandwidth == 1e9
    assert replace(v, default_bandwidth=None).with_fallbacks().link(A, c) is None  # nothing to guess from


def test_a_cluster_whose_measured_workers_all_left_is_estimated_from_a_remembered_profile():
    """Every worker restarted (memory pressure, chaos): no live profile, so the median seen
    before stands in; with none remembered either there is nothing to estimate from."""
    c, d = "tcp://c:3", "tcp://d:4"
    v = replace(_view(bandwidth=1e9), workers={c: WorkerLoad(), d: WorkerLoad()}, prefill={}, default_bandwidth=1e8)
    assert v.with_fallbacks().profile(c) is None
    est = v.with_fallbacks(PROFILE)
    assert est.profile(c) == est.profile(d) == PROFILE
    out = plan_placements(est, _match(cached=False), [0], 1, new_tokens=[64], max_new_tokens=4)
    assert out[0].worker in (c, d)


def test_the_planner_remembers_the_last_measured_median():
    from types import SimpleNamespace

    from daskflow_kv.policy.cluster_view import median_profile
    from daskflow_kv.runtime.planner import Planner

    slow, mid, fast = PrefillProfile(0, 0.03, 0), PrefillProfile(0, 0.02, 0), PrefillProfile(0, 0.01, 0)
    assert median_profile([slow, fast, mid]) == mid and median_profile([]) is None
    views = [replace(_view(), prefill={A: slow, B: mid, C: fast}), replace(_view(), prefill={})]
    planner = Planner(SimpleNamespace(snapshot=lambda *_: views.pop(0)), calibrator=None)
    planner.view()
    assert planner.view().prefill == {} and planner.remembered == mid  # kept after every worker left


def test_replicas_tie_on_bytes_and_the_least_busy_holder_takes_the_work():
    """Every holder of a replicated prefix holds the same bytes: the pinned materialize and a
    transfer's source go to the least busy of them, not to the first name (which sent 65 % of
    a 2-worker stream's prefill to one worker)."""
    m = _match(where=(A, B))
    assert holder_of(m.blocks) == A  # no load known: the name decides
    busy = {A: 5.0, B: 0.5}
    assert holder_of(m.blocks, busy.get) == B
    [p] = plan_placements(_view(workers=(A, B, C), bandwidth=1e9, busy=busy), m, [64], 1, "pin", new_tokens=[8])
    assert p.worker == B and p.action == "reuse"
    [q] = plan_placements(_view(workers=(A, B, C), bandwidth=1e9, busy=busy), m, [64], 1, "transfer", workers=[C])
    assert q.worker == C and q.decision.src == B
    more = _held_on(_match(n_blocks=4, where=(B,)), (A,), n=4)  # A holds all 4 blocks...
    more = replace(more, blocks=tuple(replace(b, where=(A, B) if i < 2 else (A,)) for i, b in enumerate(more.blocks)))
    assert holder_of(more.blocks, busy.get) == A  # ...B only 2: bytes come before load


def test_a_short_cached_prefix_does_not_pin_a_long_prefill_to_its_holder():
    """Preble's E2 for a materialize: a 16-token system line cached on a busy worker does not
    pull a new document's 1,000-token prefill there (exp 7 queued every new document on the
    worker holding the shared system line); a prefix that is most of the prompt does."""
    view = _view(bandwidth=1e9, busy={A: 20.0, B: 0.0})
    line = _match(n_blocks=1, where=(A,))  # the shared 16-token system line, on A only
    assert materialize_policy(view, 16, 1000) == "auto"
    [p] = plan_placements(view, line, [16], 1, materialize_policy(view, 16, 1000), new_tokens=[1000],
                          max_new_tokens=0)
    assert p.worker == B and p.action in ("transfer", "recompute")  # the line goes along with the work
    doc = _match(n_blocks=4, where=(A,))  # 64 cached tokens, 8 to prefill: exploit the holder
    assert materialize_policy(view, 64, 8) == "pin"
    [q] = plan_placements(view, doc, [64], 1, materialize_policy(view, 64, 8), new_tokens=[8], max_new_tokens=0)
    assert q.worker == A and q.action == "reuse"
    # nothing measured yet (no profile to price a move with) or a single worker: pin, as before
    assert materialize_policy(_view(profile=None), 16, 1000) == "pin"
    assert materialize_policy(_view(workers=(A,)), 16, 1000) == "pin"


def test_a_plans_memo_of_sources_gives_the_decisions_asked_one_by_one():
    """``prefix_decision(sources=...)``: workers lacking the same blocks share one answer to
    where they come from; each decision is what it is without the memo."""
    from daskflow_kv.policy.placement import prefix_decision

    D, E = "tcp://d:1", "tcp://e:1"
    m = _held_on(_match(n_blocks=4, where=(A, B)), [A, B, C], 2)  # C holds the first two blocks, A and B all
    view = _view(workers=(A, B, C, D, E), bandwidth=1e9, busy={A: 2.0, B: 0.5})
    sources: dict = {}
    for r in (32, 64):
        for dst in (A, B, C, D, E):
            assert prefix_decision(view, m, r, dst, sources=sources) == prefix_decision(view, m, r, dst)
    assert prefix_decision(view, m, 64, D, sources=sources).src == B  # ties on bytes: the less busy holder
    # asked about: D's blocks 0-1 (r=32), C's 2-3 and D's 0-3 (r=64); E lacks what D lacks (answered
    # from the memo), A and B lack nothing
    assert sorted(len(k) for k in sources) == [2, 2, 4]


def test_plans_with_the_sources_memo_equal_plans_without_it(monkeypatch):
    """Random clusters, prefixes (cached, partly replicated, still being made) and branch
    sets: ``plan_placements`` gives the same placements and decisions with the plan's memo
    of sources as when every worker's question is answered afresh."""
    import random

    from daskflow_kv.policy import placement

    rng = random.Random(11)
    names = [f"tcp://w{i}:1" for i in range(5)]
    cases = []
    for _ in range(150):
        ws = names[: rng.randint(2, 5)]
        blocks, start = [], 0
        for i in range(rng.randint(1, 6)):
            where = tuple(sorted(rng.sample(ws, rng.randint(0, len(ws)))))
            who = where if rng.random() < 0.8 else ()
            blocks.append(CachedBlock(f"kvblock-{i}", start, start + 16, BLOCK, who, where))
            start += 16
        view = _view(workers=ws, bandwidth=rng.choice([1e7, 1e8, 1e9]),
                     busy={w: rng.choice([0.0, 0.3, 2.0, rng.uniform(0, 5)]) for w in ws})
        n = rng.randint(1, 6)
        reused = [rng.choice([16 * k for k in range(1, len(blocks) + 1)]) for _ in range(n)]
        cases.append((view, PrefixMatch(start, tuple(blocks)), reused, n, [rng.randint(1, 64) for _ in range(n)],
                      rng.choice([1, 16]), rng.choice(["auto", "auto", "transfer", "recompute"])))

    def plans():
        return [plan_placements(v, m, r, n, policy=p, new_tokens=t, max_new_tokens=k) for v, m, r, n, t, k, p in cases]

    with_memo = plans()
    fresh, asked = placement.prefix_decision, []

    def no_memo(view, match, reused, dst, forced=None, loaded=False, sources=None):
        asked.append(sources)
        return fresh(view, match, reused, dst, forced, loaded)

    monkeypatch.setattr(placement, "prefix_decision", no_memo)
    assert plans() == with_memo
    assert any(s is not None for s in asked)  # the planner did offer its memo, and went without it
    assert any(p.action == "transfer" for ps in with_memo for p in ps)  # the cases exercise the choices
    assert any(p.action == "recompute" for ps in with_memo for p in ps)
