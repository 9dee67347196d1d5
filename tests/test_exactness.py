"""State mode (materialize, fork, resume, extend, prefix reuse) gives text mode's tokens."""

from conftest import CONTEXT, SUFFIXES, assert_same_generation


def test_fork_resume_matches_text_mode(engine):
    ctx = engine.encode(CONTEXT)
    root = engine.materialize(ctx)
    branches = engine.fork(root, 4)
    for i, (branch, suffix) in enumerate(zip(branches, SUFFIXES)):
        suf = engine.encode(suffix)
        got = engine.resume(branch, suf, max_new_tokens=16, return_logits=True)
        want = engine.generate_text(ctx + suf, max_new_tokens=16, return_logits=True)
        assert_same_generation(got, want)
        # Only the suffix was prefilled: the context came from the shared blocks (below fp32,
        # its whole blocks: a partial last block is fed again, as text mode feeds it).
        assert got.metrics.tokens_reused >= engine.runner.reusable(len(ctx))
        assert got.metrics.tokens_computed == len(ctx) + len(suf) - got.metrics.tokens_reused


def test_extend_then_resume_matches_text_mode(engine):
    ctx = engine.encode(CONTEXT)
    root = engine.materialize(ctx)
    more = engine.encode(" A second document arrives and extends the shared context.")
    extended = engine.extend(root, more)
    assert extended.tokens == tuple(ctx + more)
    # only the new tokens (below fp32 also the context's partial last block, fed again)
    assert extended.lineage[-1].as_dict()["tokens_computed"] == len(ctx) + len(more) - engine.runner.reusable(len(ctx))
    suf = engine.encode(SUFFIXES[1])
    got = engine.resume(extended, suf, max_new_tokens=12, return_logits=True)
    want = engine.generate_text(ctx + more + suf, max_new_tokens=12, return_logits=True)
    assert_same_generation(got, want)


def test_continuation_state_resumes_exactly(engine):
    """The state a resume returns is itself resumable (a debate's next round)."""
    ctx = engine.encode(CONTEXT)
    first = engine.resume(engine.materialize(ctx), engine.encode(SUFFIXES[0]), max_new_tokens=8)
    follow = engine.encode(" Reply:")
    got = engine.resume(first.state, follow, max_new_tokens=8, return_logits=True)
    want = engine.generate_text(list(first.state.tokens) + follow, max_new_tokens=8, return_logits=True)
    assert_same_generation(got, want)
    assert first.state.tokens[: len(ctx)] == tuple(ctx)


def test_longest_common_prefix_reuse(engine):
    ctx = engine.encode(CONTEXT)
    engine.materialize(ctx)
    shared = len(ctx) * 2 // 3
    request = ctx[:shared] + engine.encode(" but this request diverges and asks something else.")
    state = engine.materialize(request)
    event = state.lineage[-1].as_dict()
    # to the token, not only to the block (below fp32: to the block, so chunks match text mode's)
    assert event["tokens_reused"] == engine.runner.reusable(shared)
    assert event["tokens_computed"] == len(request) - engine.runner.reusable(shared)
    got = engine.resume(state, engine.encode(" Answer:"), max_new_tokens=12, return_logits=True)
    want = engine.generate_text(request + engine.encode(" Answer:"), max_new_tokens=12, return_logits=True)
    assert_same_generation(got, want)


def test_resume_with_empty_suffix(engine):
    ctx = engine.encode(CONTEXT)
    got = engine.resume(engine.materialize(ctx), [], max_new_tokens=10, return_logits=True)
    assert_same_generation(got, engine.generate_text(ctx, max_new_tokens=10, return_logits=True))


def test_fully_cached_request_prefills_nothing(engine):
    ctx = engine.encode(CONTEXT)
    engine.materialize(ctx)
    again = engine.materialize(ctx)
    assert again.lineage[-1].as_dict()["tokens_computed"] == 0
    shorter = engine.materialize(ctx[:-3])  # ends inside a cached block: cut, not recomputed
    assert shorter.lineage[-1].as_dict()["tokens_computed"] == 0
    assert shorter.tokens == tuple(ctx[:-3])
    got = engine.resume(shorter, engine.encode(" Go"), max_new_tokens=8)
    assert got.tokens == engine.generate_text(ctx[:-3] + engine.encode(" Go"), max_new_tokens=8).tokens
