"""The step loop: requests from different prefixes join and leave a running batch, exactly.

Every request must give what ``ModelRunner.run`` gives alone (the path text mode and a
single resume take): the same greedy tokens; fp32 logits and blocks within the batched
tolerance; below fp32 bit-identical (those requests run in their own rows).
"""

import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch
from conftest import CONTEXT, SUFFIXES, batched_logit_tolerance, make_engine

from daskflow_kv.model.step_engine import StepEngine, StepRequest

CONTEXTS = [
    CONTEXT,
    "A different document about caches, schedulers and the cost of moving bytes between machines. " * 2,
    "A short third context of a few more words than one block.",
    "Agents plan, then solve, then a judge reads every solution and picks the best of them. " * 3,
]
LIMITS = [12, 5, 16, 9]


def _prefix(engine, text):
    """A prefix's blocks as a materialized state holds them; below fp32 block-aligned."""
    ctx = engine.encode(text)
    if engine.runner.aligned_prefill:
        ctx = ctx[: len(ctx) - len(ctx) % engine.block_size]
        assert ctx
    root = engine.materialize(ctx)
    return ctx, [engine.store.get(b.key) for b in root.blocks]


def _requests(engine):
    out = []
    for i, (text, suf, lim) in enumerate(zip(CONTEXTS, SUFFIXES, LIMITS)):
        ctx, blocks = _prefix(engine, text)
        out.append(StepRequest(blocks, len(ctx), engine.encode(suf), lim, stream=i, return_logits=True))
    return out


def _alone(engine, r: StepRequest):
    return engine.runner.run(r.prefix_blocks, r.prefix_len, r.new_tokens, r.max_new_tokens, r.sampling, r.stream,
                             return_logits=True)


def _dtype(engine) -> str:
    return str(engine.runner.dtype).removeprefix("torch.")


def _assert_same(got, want, dtype):
    assert got.generated == want.generated
    assert got.fed_tokens == want.fed_tokens
    assert [(s, e) for s, e, _ in got.new_blocks] == [(s, e) for s, e, _ in want.new_blocks]
    if dtype != "float32":  # solo rows: bit-identical to a single run
        assert torch.equal(got.logits, want.logits)
        assert all(torch.equal(g, w) for (_, _, g), (_, _, w) in zip(got.new_blocks, want.new_blocks))
        return
    assert float((got.logits - want.logits).abs().max()) <= batched_logit_tolerance(want.logits, dtype)
    for (_, _, g), (_, _, w) in zip(got.new_blocks, want.new_blocks):
        assert float((g - w).abs().max()) <= 1e-4 * float(w.abs().max())


@pytest.mark.parametrize("step_tokens", [512, 7])  # whole prompts in a step; prompts in many chunks
def test_requests_over_different_prefixes_join_and_leave_exactly(engine, step_tokens):
    """Both archs x fp32/bf16: four prefixes, ragged prompts and limits, staggered arrivals
    (later requests join while earlier ones decode; short ones leave first)."""
    eng = StepEngine(engine.runner, step_tokens=step_tokens, max_running=8)
    reqs = _requests(engine)
    futures = eng.submit(reqs[:2])  # waiting together: they must share steps, however slow the machine
    for r in reqs[2:]:
        time.sleep(0.02)
        futures += eng.submit([r])
    for r, f in zip(reqs, futures):
        _assert_same(f.result(timeout=120), _alone(engine, r), _dtype(engine))
    assert eng.stats.completed == len(reqs)
    if eng.solo_reason is None:
        assert eng.stats.batch_total > eng.stats.steps  # requests really shared steps
    eng.stop()


def test_a_request_equals_text_mode_tokens(engine):
    """Through the loop, a resume and the whole prompt from nothing give text mode's tokens."""
    eng = StepEngine(engine.runner, step_tokens=16)
    ctx, blocks = _prefix(engine, CONTEXT)
    suf = engine.encode(SUFFIXES[1])
    text = engine.generate_text(ctx + suf, max_new_tokens=10)
    [resumed, whole] = [f.result(60) for f in eng.submit([StepRequest(blocks, len(ctx), suf, 10),
                                                          StepRequest([], 0, ctx + suf, 10)])]
    assert resumed.generated == text.tokens and whole.generated == text.tokens
    eng.stop()


def test_forks_submitted_together_hold_the_prefix_once(engine_factory):
    engine = engine_factory("tiny-llama", "float32")
    eng = StepEngine(engine.runner)
    ctx, blocks = _prefix(engine, CONTEXT)
    reqs = [StepRequest(blocks, len(ctx), engine.encode(s), lim, stream=i, return_logits=True)
            for i, (s, lim) in enumerate(zip(SUFFIXES, LIMITS))]
    futures = eng.submit(reqs, shared_prefix=True)
    for r, f in zip(reqs, futures):
        _assert_same(f.result(60), _alone(engine, r), "float32")
    eng.stop()


@pytest.mark.parametrize("model", ["tiny-mistral", "tiny-gemma3", "tiny-llama4"])
def test_attention_patterns(model):
    """Sliding windows are packed; chunked attention runs in its own rows: both exact."""
    engine = make_engine(model, "float32")
    eng = StepEngine(engine.runner, step_tokens=24)
    assert (eng.solo_reason is not None) == (model == "tiny-llama4")
    reqs = _requests(engine)
    for r, f in zip(reqs, eng.submit(reqs)):
        _assert_same(f.result(120), _alone(engine, r), "float32")
    eng.stop()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-mistral"])  # full attention; a sliding window
def test_decode_rows_of_many_solo_requests_attend_together_exactly(engine_factory, model, monkeypatch):
    """Ten requests, ragged prompts and limits, arriving in waves: the lane pool grows in slots
    and in length while lanes decode, frees slots and reuses them; every decode row that
    shares a step attends in one call (``_PoolRows``), and each request is still exact."""
    from daskflow_kv.model import step_cache

    calls = []
    real = step_cache._PoolRows.attend
    monkeypatch.setattr(step_cache._PoolRows, "attend", lambda self, *a: (calls.append(len(self.lanes)), real(self, *a)))
    engine = engine_factory(model, "float32")
    eng = StepEngine(engine.runner, step_tokens=64)
    texts = [CONTEXTS[i % 4] * (1 + i // 4) for i in range(10)]  # later waves are longer: the slots lengthen
    reqs = []
    for i, text in enumerate(texts):
        ctx, blocks = _prefix(engine, text)
        reqs.append(StepRequest(blocks, len(ctx), engine.encode(SUFFIXES[i % 4]), 3 + 2 * i, stream=i,
                                return_logits=True))
    futures = eng.submit(reqs[:5])
    while eng.stats.completed < 1:
        time.sleep(0.002)
    futures += eng.submit(reqs[5:])
    for r, f in zip(reqs, futures):
        _assert_same(f.result(120), _alone(engine, r), "float32")
    assert calls and max(calls) >= 3
    # each step records what its pooled attention computed: rows, the slot span, padded keys
    pooled = [s for s in eng.recent if s.pool_rows]
    layers = engine.runner.num_layers  # attend runs once per layer of a pooled step
    assert sorted(r for s in pooled for r in [s.pool_rows] * layers) == sorted(calls)
    assert all(s.pool_rows <= s.pool_slots for s in pooled)
    assert all(s.pool_rows * s.pool_width > s.decode_keys for s in pooled if s.decode_rows == s.pool_rows)
    pool = eng.forward.cache.pool
    assert pool.k == [] and not any(pool.owners)  # every lane left: the pool gave its memory back
    eng.stop()


def test_a_cancelled_request_leaves_at_the_next_step(engine_factory):
    engine = engine_factory("tiny-llama", "float32")
    eng = StepEngine(engine.runner, step_tokens=64)
    ctx, blocks = _prefix(engine, CONTEXT)
    long = StepRequest(blocks, len(ctx), engine.encode(SUFFIXES[0]), 400, op="resume")
    short = StepRequest(blocks, len(ctx), engine.encode(SUFFIXES[1]), 6, return_logits=True, op="resume")
    [f_long, f_short] = eng.submit([long, short])
    while eng.stats.steps < 3:
        time.sleep(0.005)
    eng.cancel(f_long)
    with pytest.raises(CancelledError):
        f_long.result(30)
    _assert_same(f_short.result(30), _alone(engine, short), "float32")
    deadline = time.time() + 10
    while eng.stats.running and time.time() < deadline:
        time.sleep(0.01)
    assert eng.stats.running == 0
    # both prompts were fed; the cancelled one's are the work no caller got
    assert eng.prompt_fed == {"resume": len(long.new_tokens) + len(short.new_tokens)}
    assert eng.prompt_dropped == {"resume": len(long.new_tokens)}
    eng.stop()


def test_bad_requests_fail_alone_and_the_loop_goes_on(engine_factory):
    engine = engine_factory("tiny-llama", "float32")
    eng = StepEngine(engine.runner)
    with pytest.raises(ValueError, match="at least one new token"):
        eng.submit([StepRequest([], 0, [], 4)])
    ctx, blocks = _prefix(engine, CONTEXT)
    [bad] = eng.submit([StepRequest(blocks[:1], len(ctx) + 500, [5, 6], 3)])  # blocks hold fewer tokens
    with pytest.raises(ValueError, match="fewer than"):
        bad.result(30)
    good = StepRequest(blocks, len(ctx), engine.encode(SUFFIXES[2]), 5, return_logits=True)
    _assert_same(eng.submit([good])[0].result(30), _alone(engine, good), "float32")
    eng.stop()


def test_submit_from_many_threads(engine_factory):
    engine = engine_factory("tiny-qwen2", "float32")
    eng = StepEngine(engine.runner, step_tokens=32)
    reqs = _requests(engine) * 2
    out = [None] * len(reqs)

    def one(i):
        out[i] = eng.submit([reqs[i]])[0].result(120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, got in zip(reqs, out):
        _assert_same(got, _alone(engine, r), "float32")
    eng.stop()


def test_an_engine_can_run_its_forwards_in_the_step_loop(engine):
    """``Engine(steps=...)`` (what the per-worker baseline uses): the same states and tokens."""
    from daskflow_kv.engine import Engine
    from daskflow_kv.runtime import step_worker

    looped = Engine(runner=engine.runner, steps=lambda reqs, shared: step_worker.run(engine.runner, reqs, shared))
    ctx = engine.encode(CONTEXT)
    sufs = [engine.encode(s) for s in SUFFIXES]
    for eng in (engine, looped):
        root = eng.materialize(ctx)
        one = eng.resume(root, sufs[0], max_new_tokens=8)
        many = eng.resume_forks(root, sufs, max_new_tokens=[8, 3, 6, 8], streams=[0, 1, 2, 3])
        eng.release(root)
        if eng is engine:
            want = (one.tokens, [g.tokens for g in many], root.block_keys)
    assert (one.tokens, [g.tokens for g in many], root.block_keys) == want
    assert step_worker.engine_for(engine.runner).stats.completed >= 1 + 1 + 4


def test_the_loop_records_what_each_step_fed_joined_and_cut(engine_factory):
    """``StepEngine.recent``: the shapes ``benchmarks/step_cost.py`` fits a step's cost on."""
    from daskflow_kv.state.blocks import aligned_floor

    engine = engine_factory("tiny-llama", "float32")
    eng = StepEngine(engine.runner, step_tokens=16)
    ctx, blocks = _prefix(engine, CONTEXT)
    suf, whole = engine.encode(SUFFIXES[0]), engine.encode(CONTEXTS[1])
    outs = [f.result(60) for f in eng.submit([StepRequest(blocks, len(ctx), suf, 5, op="resume"),
                                              StepRequest([], 0, whole, 3, op="materialize")])]
    eng.stop()
    shapes = list(eng.recent)
    assert len(shapes) == eng.stats.steps
    assert sum(s.seconds for s in shapes) == pytest.approx(eng.stats.busy_s)
    assert sum(s.prompt_tokens for s in shapes) == len(suf) + len(whole)
    assert (eng.prompt_fed, eng.prompt_dropped) == ({"resume": len(suf), "materialize": len(whole)}, {})
    assert max(s.prompt_tokens + s.decode_rows for s in shapes) <= 16 + 16 // 8  # a last chunk's slack
    assert sum(s.decode_rows for s in shapes) == (5 - 1) + (3 - 1)
    assert (sum(s.joined for s in shapes), sum(s.loaded_tokens for s in shapes)) == (2, len(ctx))
    assert sum(s.finished for s in shapes) == 2
    cut = outs[0].fed_tokens - aligned_floor(len(ctx), engine.block_size) + outs[1].fed_tokens
    assert sum(s.exported_tokens for s in shapes) == cut == sum(e - s for o in outs for s, e, _ in o.new_blocks)
    first = shapes[0]  # the resume's first chunk attends to its whole prefix
    assert first.prompt_attn >= first.prompt_tokens * len(ctx)
    starts = [s.started for s in shapes]  # wall-clock starts, in order, no two steps overlapping
    assert all(b >= a + s.seconds - 1e-3 for a, b, s in zip(starts, starts[1:], shapes))
    # the loop thread's own CPU in each step: some, and never more than the step's wall time
    assert all(0 < s.cpu <= s.seconds + 1e-3 for s in shapes)


def test_requests_past_the_pools_bound_attend_alone_and_stay_exact(engine_factory, monkeypatch):
    """``batching.pool-bytes``: with room for a few slots, the other solo requests get
    workspaces of their own while those share the pool; every request is still exact."""
    from daskflow_kv.model import lane_pool
    from daskflow_kv.model.lane_pool import ROUND

    sizes = []
    grow = lane_pool.LanePool._grow
    monkeypatch.setattr(lane_pool.LanePool, "_grow", lambda self, *a: (grow(self, *a), sizes.append(self.nbytes)))
    engine = engine_factory("tiny-llama", "float32")
    rn = engine.runner
    two_slots = 2 * (2 * rn.num_layers * rn.kv_heads * 2 * ROUND * rn.head_dim * 4)
    eng = StepEngine(rn, step_tokens=64, pool_bytes=two_slots)
    reqs = []
    for i in range(6):
        ctx, blocks = _prefix(engine, CONTEXTS[i % 4])
        reqs.append(StepRequest(blocks, len(ctx), engine.encode(SUFFIXES[i % 4]), 6, stream=i, return_logits=True))
    futures = eng.submit(reqs)
    for r, f in zip(reqs, futures):
        _assert_same(f.result(120), _alone(engine, r), "float32")
    shapes = list(eng.recent)
    assert sizes and max(sizes) <= two_slots  # the pool never passed its bound
    assert 1 < max(s.pool_rows for s in shapes) < len(reqs)  # some attended in the pool at once...
    assert any(s.decode_rows > s.pool_rows for s in shapes if s.pool_rows)  # ...beside rows attending alone
    eng.stop()


def test_busy_seconds_count_the_running_step_as_far_as_it_got(engine):
    """A sampler reading the loop's busy seconds between two steps must see the step now
    running, not its whole length at its end (it would look idle until then)."""
    eng = StepEngine(engine.runner, step_tokens=16)
    try:
        ctx, blocks = _prefix(engine, CONTEXT)
        eng.submit([StepRequest(blocks, len(ctx), engine.encode(SUFFIXES[0]), 4)])[0].result(timeout=60)
        deadline = time.monotonic() + 10
        while eng._step_t0 is not None and time.monotonic() < deadline:  # the result comes within its last step
            time.sleep(0.01)
        assert eng.stats.busy_s > 0 and eng.busy_now() == eng.stats.busy_s  # between steps: the steps' sum
        eng._step_t0 = time.perf_counter() - 0.5  # as if a step began half a second ago
        assert eng.busy_now() >= eng.stats.busy_s + 0.5
    finally:
        eng._step_t0 = None
        eng.stop()
