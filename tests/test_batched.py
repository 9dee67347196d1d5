"""Batched resume of k forks over one shared prefix gives what k single resumes give."""

import pytest
from conftest import CONTEXT, SUFFIXES, assert_same_generation, batched_logit_tolerance, make_engine

from daskflow_kv.model.batched import batched_twin, resume_batch
from daskflow_kv.model.runner import ModelRunner
from daskflow_kv.model.sampling import SamplingParams

LIMITS = [16, 5, 12, 16]  # per-branch max tokens, ragged like the suffixes
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)


def _prefix(engine, text=CONTEXT):
    """A block-aligned context: below fp32 a single resume starts only on a block boundary."""
    ctx = engine.encode(text)
    ctx = ctx[: len(ctx) - len(ctx) % engine.block_size]
    root = engine.materialize(ctx)
    return ctx, root, [engine.store.get(b.key) for b in root.blocks]


def _dtype(engine) -> str:
    return str(engine.runner.dtype).removeprefix("torch.")


def _assert_same_run(got, want, dtype):
    """Same tokens, logits within the batched tolerance, same blocks (spans and values)."""
    assert got.generated == want.generated
    assert got.fed_tokens == want.fed_tokens
    if want.logits is not None:
        assert float((got.logits - want.logits).abs().max()) <= batched_logit_tolerance(want.logits, dtype)
    assert [(s, e) for s, e, _ in got.new_blocks] == [(s, e) for s, e, _ in want.new_blocks]
    for (_, _, g), (_, _, w) in zip(got.new_blocks, want.new_blocks):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert float((g.float() - w.float()).abs().max()) <= 1e-2 * float(w.float().abs().max())


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("prefill", ["batched", "per_branch"])
def test_batch_equals_single_resumes(engine, sampling, prefill):
    """Both archs x fp32/bf16, ragged suffixes and limits, greedy and seeded sampling."""
    ctx, _, blocks = _prefix(engine)
    sufs = [engine.encode(s) for s in SUFFIXES]
    assert len({len(s) for s in sufs}) == len(sufs)  # really ragged
    streams = [3, 0, 7, 1]
    out = resume_batch(
        engine.runner, blocks, len(ctx), sufs, LIMITS, sampling, streams, return_logits=True, prefill=prefill
    )
    for suf, lim, stream, got in zip(sufs, LIMITS, streams, out):
        want = engine.runner.run(blocks, len(ctx), suf, lim, sampling, stream=stream, return_logits=True)
        _assert_same_run(got, want, _dtype(engine))
        assert len(got.generated) == lim
    assert out.stats.forwards == (1 if prefill == "batched" else len(sufs)) + max(LIMITS) - 1
    again = resume_batch(engine.runner, blocks, len(ctx), sufs, LIMITS, sampling, streams, prefill=prefill)
    assert [o.generated for o in again] == [o.generated for o in out]  # reproducible under the seed


def test_early_eos_stops_only_its_branch(engine):
    ctx, _, blocks = _prefix(engine)
    sufs = [engine.encode(s) for s in SUFFIXES]
    base = engine.runner
    ref = [base.run(blocks, len(ctx), s, 16, stream=i) for i, s in enumerate(sufs)]
    # Declare as EOS a token branch 0 emits mid-way (and that branch 2 never emits before it ends).
    eos = next(t for t in ref[0].generated[2:12] if t not in ref[2].generated)
    runner = ModelRunner(base.model, base.tokenizer, base.fingerprint.model_id, base.block_size)
    runner.eos_ids = {eos}
    out = resume_batch(runner, blocks, len(ctx), sufs, 16, return_logits=True)
    lengths = []
    for i, (suf, got) in enumerate(zip(sufs, out)):
        want = runner.run(blocks, len(ctx), suf, 16, stream=i, return_logits=True)
        _assert_same_run(got, want, _dtype(engine))
        lengths.append(len(got.generated))
    assert out[0].generated[-1] == eos and lengths[0] < 16
    assert lengths[2] == 16
    assert out.stats.tail_tokens == [len(s) + n - 1 for s, n in zip(sufs, lengths)]


def test_resume_forks_matches_engine_resume(engine):
    """Engine-level: generations, published continuation states, and their resumability."""
    ctx, root, _ = _prefix(engine)
    forks = engine.fork(root, 4)
    sufs = [engine.encode(s) for s in SUFFIXES]
    gens = engine.resume_forks(root, sufs, max_new_tokens=LIMITS, return_logits=True)
    for i, (branch, suf, lim, got) in enumerate(zip(forks, sufs, LIMITS, gens)):
        want = engine.resume(branch, suf, max_new_tokens=lim, stream=i, return_logits=True)
        assert got.tokens == want.tokens
        assert float((got.logits - want.logits).abs().max()) <= batched_logit_tolerance(want.logits, _dtype(engine))
        assert got.text == want.text
        assert got.state.tokens == want.state.tokens
        assert got.state.tokens[: len(ctx)] == tuple(ctx)
        assert got.metrics.tokens_reused == len(ctx)
        assert got.state.lineage[-1].as_dict()["batched"] == 4
    # A batched continuation is itself a valid state: resume it and compare with text mode.
    follow = engine.encode(" Reply:")
    nxt = engine.resume(gens[3].state, follow, max_new_tokens=8, return_logits=True)
    assert_same_generation(nxt, engine.generate_text(list(gens[3].state.tokens) + follow, 8, return_logits=True))


def test_resume_forks_with_an_empty_suffix():
    engine = make_engine("tiny-qwen2", "bfloat16")
    _, root, _ = _prefix(engine)
    sufs = [[], engine.encode(SUFFIXES[2]), engine.encode(SUFFIXES[0])]
    gens = engine.resume_forks(root, sufs, max_new_tokens=10, sampling=SAMPLED, streams=[4, 5, 6])
    for suf, stream, got in zip(sufs, [4, 5, 6], gens):
        want = engine.resume(root, suf, max_new_tokens=10, sampling=SAMPLED, stream=stream)
        assert got.tokens == want.tokens and got.state.tokens == want.state.tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_kv_bytes_k16(dtype):
    """k=16 ragged branches over a ~400-token prefix: prefix held once, tails packed."""
    engine = make_engine("tiny-llama", dtype)
    ctx, _, blocks = _prefix(engine, " ".join([CONTEXT] * 6))
    ctx = ctx[:400]  # resume after the first 400 tokens: the last block is reused in part
    words = engine.encode(SUFFIXES[3])
    sufs = [words[: 3 + i] for i in range(16)]
    out = resume_batch(engine.runner, blocks, len(ctx), sufs, 8, return_logits=True)
    st = out.stats
    bpt = engine.runner.bytes_per_token
    tails = [len(s) + 8 - 1 for s in sufs]
    assert st.tail_tokens == tails  # no EOS here: every branch fed its whole reservation
    assert st.ideal_kv_bytes == bpt * (len(ctx) + sum(tails))
    print(
        f"\n{dtype}: kv {st.kv_bytes} B = {st.kv_ratio:.3f} x (prefix + sum tails); "
        f"unshared {st.unshared_kv_bytes} B; scratch {st.scratch_bytes} B"
    )
    assert st.kv_bytes <= 1.1 * st.ideal_kv_bytes
    assert st.kv_bytes < st.unshared_kv_bytes / 8  # vs 16 private prefix copies
    for i, (suf, got) in enumerate(zip(sufs, out)):
        want = engine.runner.run(blocks, len(ctx), suf, 8, stream=i, return_logits=True)
        _assert_same_run(got, want, _dtype(engine))


def test_kv_accounting_matches_allocated_storage():
    engine = make_engine("tiny-llama", "bfloat16")
    ctx, _, blocks = _prefix(engine)
    from daskflow_kv.model.batched_cache import SharedPrefixCache

    seen = {}
    orig = SharedPrefixCache.load_prefix

    def spy(self, b):
        seen["cache"] = self
        return orig(self, b)

    SharedPrefixCache.load_prefix = spy
    try:
        resume_batch(engine.runner, blocks, len(ctx), [engine.encode(s) for s in SUFFIXES], 4)
    finally:
        SharedPrefixCache.load_prefix = orig
    cache = seen["cache"]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for p in cache.prefix + cache.pool for t in p
    }
    assert sum(storages.values()) == cache.kv_bytes
    assert len(cache.prefix) == engine.runner.num_layers  # one prefix per layer, not per branch


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
def test_shared_attention_mode_fp32(arch):
    """The log-sum-exp mode (prefix read once per step) gives the same tokens in fp32."""
    engine = make_engine(arch, "float32")
    ctx, _, blocks = _prefix(engine)
    sufs = [engine.encode(s) for s in SUFFIXES]
    out = resume_batch(engine.runner, blocks, len(ctx), sufs, LIMITS, SAMPLED, return_logits=True, attention="shared")
    for i, (suf, lim, got) in enumerate(zip(sufs, LIMITS, out)):
        want = engine.runner.run(blocks, len(ctx), suf, lim, SAMPLED, stream=i, return_logits=True)
        _assert_same_run(got, want, _dtype(engine))


def test_zero_tokens_and_single_branch():
    engine = make_engine("tiny-llama", "bfloat16")
    ctx, _, blocks = _prefix(engine)
    sufs = [engine.encode(SUFFIXES[0]), engine.encode(SUFFIXES[1])]
    out = resume_batch(engine.runner, blocks, len(ctx), sufs, [0, 6])
    assert out[0].generated == [] and out[0].fed_tokens == len(ctx) + len(sufs[0])
    _assert_same_run(out[0], engine.runner.run(blocks, len(ctx), sufs[0], 0), _dtype(engine))
    _assert_same_run(out[1], engine.runner.run(blocks, len(ctx), sufs[1], 6, stream=1), _dtype(engine))
    one = resume_batch(engine.runner, blocks, len(ctx), sufs[1:], 6, streams=[1])
    assert one[0].generated == out[1].generated


@pytest.mark.parametrize("attention", ["replay", "shared"])
def test_empty_prefix_is_text_mode(attention):
    """prefix_len 0: every branch is a plain text-mode generation of its own prompt."""
    engine = make_engine("tiny-qwen2", "float32")
    prompts = [engine.encode(CONTEXT + s) for s in SUFFIXES]
    out = resume_batch(engine.runner, [], 0, prompts, 8, return_logits=True, attention=attention)
    for prompt, got in zip(prompts, out):
        assert_same_generation(engine_generation(engine, got), engine.generate_text(prompt, 8, return_logits=True))


def engine_generation(engine, run):
    from daskflow_kv.engine import Generation

    return Generation(run.generated, engine.decode(run.generated), run.logits, run.metrics)


def test_misuse_is_refused_and_model_untouched():
    engine = make_engine("tiny-llama", "float32")
    ctx, _, blocks = _prefix(engine)
    suf = engine.encode(SUFFIXES[0])
    with pytest.raises(ValueError, match="at least one new token"):
        resume_batch(engine.runner, blocks, len(ctx), [suf, []], 4)
    with pytest.raises(ValueError, match="token limits"):
        resume_batch(engine.runner, blocks, len(ctx), [suf, suf], [4])
    with pytest.raises(ValueError, match="fewer than"):
        resume_batch(engine.runner, blocks[:1], len(ctx), [suf], 4)
    with pytest.raises(ValueError, match="attention mode"):
        resume_batch(engine.runner, blocks, len(ctx), [suf], 4, attention="nope")
    model = engine.runner.model
    twin = batched_twin(model)
    assert model.config._attn_implementation == "sdpa"  # the shared model is never reconfigured
    assert twin.config._attn_implementation == "daskflow_batched"
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(model.parameters(), twin.parameters()))
    assert batched_twin(model) is twin


def test_eager_attention_model():
    """A model on transformers' eager kernel (looked up from its own module) also batches exactly."""
    from transformers import AutoModelForCausalLM

    from daskflow_kv.model.zoo.loader import load_model
    from daskflow_kv.model.zoo.tiny import build_tiny

    lm = load_model("tiny-qwen2")
    model = AutoModelForCausalLM.from_pretrained(build_tiny("tiny-qwen2"), attn_implementation="eager").eval()
    runner = ModelRunner(model, lm.tokenizer, "tiny-qwen2-eager", block_size=16)
    ctx = lm.tokenizer(CONTEXT, add_special_tokens=False)["input_ids"]
    pre = runner.run([], 0, ctx, 0)
    blocks = [b for _, _, b in pre.new_blocks]
    sufs = [lm.tokenizer(s, add_special_tokens=False)["input_ids"] for s in SUFFIXES]
    out = resume_batch(runner, blocks, len(ctx), sufs, LIMITS, SAMPLED, return_logits=True)
    for i, (suf, lim, got) in enumerate(zip(sufs, LIMITS, out)):
        _assert_same_run(got, runner.run(blocks, len(ctx), suf, lim, SAMPLED, stream=i, return_logits=True), "float32")
