"""The choice of W and the chunk spans of a parallel prefill, on plain numbers (no model, no cluster)."""

import math

import pytest

from daskflow_kv.policy.cost_model import LinkProfile, PrefillProfile
from daskflow_kv.policy.parallel_prefill import (
    HANDOFF_LATENCY,
    choose_parallelism,
    chunk_sizes,
    chunk_spans,
    predict_seconds,
)

# roughly SmolLM2-135M fp32 on one core: ~650 tok/s of MLP, quadratic attention on top
SMOL = PrefillProfile(0.05, 1.5e-3, 2.5e-7)
BPT = 46_080  # SmolLM2 KV bytes per token
LAYERS = 30
LOOPBACK = LinkProfile(3e9, 0.014)


def _costs(spans, profiles):
    return [p.seconds(e - s, s) for (s, e), p in zip(spans, profiles)]


@pytest.mark.parametrize("width", [2, 3, 4])
def test_chunks_cost_the_same_and_later_ones_are_shorter(width):
    spans = chunk_spans(0, 8192, [SMOL] * width, 64)
    assert len(spans) == width
    assert spans[0][0] == 0 and spans[-1][1] == 8192
    assert all(e == s2 for (_, e), (s2, _) in zip(spans, spans[1:]))  # contiguous
    assert all(s % 64 == 0 for s, _ in spans)  # block-aligned boundaries
    sizes = [e - s for s, e in spans]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    costs = _costs(spans, [SMOL] * width)
    assert max(costs) / min(costs) < 1.05  # balanced up to one block of rounding


def test_chunk_sizes_alike_workers():
    sizes = chunk_sizes(4096, 2, SMOL, block_size=64)
    assert sum(sizes) == 4096 and sizes[0] > sizes[1] and all(s % 64 == 0 for s in sizes)


def test_without_attention_cost_chunks_are_equal():
    assert chunk_sizes(4096, 4, PrefillProfile(0.0, 1e-3, 0.0), block_size=64) == [1024] * 4


def test_a_profile_blind_to_tokens_splits_by_count():
    """A noisy fit of tiny prefills (all fixed cost) must not put everything in chunk 0."""
    assert chunk_spans(0, 306, [PrefillProfile(0.008, 0.0, 0.0)] * 2, 16) == [(0, 160), (160, 306)]


def test_a_cached_prefix_starts_chunk_zero_mid_block_and_counts_as_attention():
    spans = chunk_spans(37, 4096, [SMOL] * 2, 64)
    assert spans[0][0] == 37 and spans[1][0] % 64 == 0 and spans[-1][1] == 4096
    costs = _costs(spans, [SMOL] * 2)
    assert max(costs) / min(costs) < 1.05


def test_too_few_blocks_give_fewer_chunks_each_at_least_one_block():
    assert chunk_spans(5, 40, [SMOL] * 3, 16) == [(5, 16), (16, 32), (32, 40)]
    assert chunk_spans(5, 20, [SMOL] * 3, 16) == [(5, 16), (16, 20)]
    assert chunk_spans(0, 16, [SMOL] * 3, 16) == [(0, 16)]
    assert chunk_spans(10, 10, [SMOL] * 2, 16) == []


def test_a_slower_worker_gets_a_smaller_chunk():
    slow = PrefillProfile(SMOL.a, SMOL.b * 2, SMOL.c * 2)
    fast_first = chunk_spans(0, 4096, [SMOL, slow], 64)
    slow_first = chunk_spans(0, 4096, [slow, SMOL], 64)
    assert fast_first[0][1] > slow_first[0][1]


def test_prediction_single_chunk_is_the_profile():
    assert predict_seconds([(0, 4096)], [SMOL], LOOPBACK, BPT, LAYERS) == pytest.approx(SMOL.seconds(4096))


def test_prediction_two_chunks_is_about_half_plus_a_layer():
    spans = chunk_spans(0, 4096, [SMOL] * 2, 64)
    t2 = predict_seconds(spans, [SMOL] * 2, LOOPBACK, BPT, LAYERS)
    per_chunk = max(_costs(spans, [SMOL] * 2))
    assert per_chunk < t2 < per_chunk + SMOL.seconds(4096) / LAYERS + 0.1
    assert t2 < 0.6 * SMOL.seconds(4096)


def test_prediction_pays_for_a_slow_link_and_latency():
    spans = chunk_spans(0, 4096, [SMOL] * 2, 64)
    fast = predict_seconds(spans, [SMOL] * 2, LOOPBACK, BPT, LAYERS)
    slow = predict_seconds(spans, [SMOL] * 2, LinkProfile(1e7, 0.014), BPT, LAYERS)  # 10 MB/s
    laggy = predict_seconds(spans, [SMOL] * 2, LOOPBACK, BPT, LAYERS, handoff_latency=0.5)
    assert slow > fast + 1.0 and laggy > fast + 0.4


def test_auto_picks_two_workers_for_a_long_cold_prefill():
    plan = choose_parallelism(0, 4096, "w1", ["w0"], {"w0": SMOL, "w1": SMOL}, LOOPBACK, BPT, LAYERS, 64)
    assert plan.width == 2 and plan.workers == ("w0", "w1")  # address order, target or not
    assert plan.seconds <= 0.9 * plan.single_seconds
    assert plan.spans[0] == (0, plan.spans[1][0]) and plan.spans[-1][1] == 4096


def test_auto_never_picks_a_slower_split():
    tiny = PrefillProfile(0.003, 2e-5, 1e-9)  # a millisecond prefill: hand-offs cost more than they save
    plan = choose_parallelism(0, 256, "w0", ["w1"], {"w0": tiny, "w1": tiny}, LOOPBACK, 4096, 2, 16)
    assert plan.width == 1 and plan.seconds == plan.single_seconds
    slow_link = choose_parallelism(0, 4096, "w0", ["w1"], {"w0": SMOL, "w1": SMOL}, LinkProfile(1e6), BPT,
                                   LAYERS, 64)
    assert slow_link.width == 1  # 190 MB at 1 MB/s: never worth it


def test_auto_takes_the_best_width_and_needs_the_min_gain():
    profiles = {w: SMOL for w in ("a", "b", "c", "d")}
    plan = choose_parallelism(0, 8192, "a", ["b", "c", "d"], profiles, LOOPBACK, BPT, LAYERS, 64)
    assert plan.width == 4
    # a gain below min_gain keeps one worker
    marginal = choose_parallelism(0, 4096, "a", ["b"], profiles, LOOPBACK, BPT, LAYERS, 64, min_gain=0.6)
    assert marginal.width == 1 and "not 60%" in marginal.reason


def test_forced_width_is_kept_even_when_slower_and_clamped_to_workers_and_blocks():
    tiny = PrefillProfile(0.003, 2e-5, 1e-9)
    plan = choose_parallelism(0, 256, "w0", ["w1"], {"w0": tiny, "w1": tiny}, LOOPBACK, 4096, 2, 16, width=2)
    assert plan.width == 2 and plan.seconds > plan.single_seconds
    assert choose_parallelism(0, 4096, "w0", ["w1"], {"w0": SMOL, "w1": SMOL}, LOOPBACK, BPT, LAYERS, 64,
                              width=5).width == 2
    assert choose_parallelism(0, 10, "w0", ["w1"], {"w0": SMOL, "w1": SMOL}, LOOPBACK, BPT, LAYERS, 64,
                              width=2).width == 1
    assert choose_parallelism(0, 4096, "w0", [], {"w0": SMOL}, LOOPBACK, BPT, LAYERS, 64).width == 1


def test_helpers_fetching_a_cached_prefix_pay_for_it():
    profiles = {"w0": SMOL, "w1": SMOL}
    cold = choose_parallelism(0, 4096, "w0", ["w1"], profiles, LOOPBACK, BPT, LAYERS, 64)
    warm = choose_parallelism(0, 4096, "w0", ["w1"], profiles, LinkProfile(1e8, 0.014), BPT, LAYERS, 64,
                              prefix_bytes=2048 * BPT)
    assert warm.seconds > cold.seconds
    assert math.isfinite(warm.seconds) and HANDOFF_LATENCY > 0
