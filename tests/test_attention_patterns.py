"""Models whose layers attend differently: sliding windows (Mistral), sliding and full layers
alternating (Gemma 3), chunked attention (Llama 4).

Every reuse path must equal text mode. Batched resume reproduces full and sliding-window
layers; chunked attention it does not, and then the runtime resumes branch by branch,
decided before anything is submitted, so a workflow on such a model never fails.
"""

import time

import pytest
from conftest import CONTEXT, SUFFIXES, assert_same_generation, batched_logit_tolerance, make_engine

from daskflow_kv.flow.executor import Comparison, run_state_mode, run_text_mode
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.workflows import WORKFLOWS

WINDOWED = ["tiny-mistral", "tiny-gemma3"]
DTYPES = ["float32", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", [*WINDOWED, "tiny-llama4"])
def test_resume_and_extend_equal_text_mode(model, dtype):
    engine = make_engine(model, dtype)
    ctx = engine.encode(CONTEXT)
    window = getattr(engine.runner.model.config, "sliding_window", None) or 16
    assert len(ctx) > 2 * window  # the cache really holds keys the window must hide
    root = engine.materialize(ctx)
    for branch, s in zip(engine.fork(root, 2), SUFFIXES):
        suf = engine.encode(s)
        got = engine.resume(branch, suf, max_new_tokens=12, return_logits=True)
        assert_same_generation(got, engine.generate_text(ctx + suf, max_new_tokens=12, return_logits=True))
    more = engine.encode(" More notes follow here.")
    ext = engine.extend(root, more)
    got = engine.resume(ext, engine.encode(" Go."), max_new_tokens=8, return_logits=True)
    assert_same_generation(got, engine.generate_text(ctx + more + engine.encode(" Go."), 8, return_logits=True))


@pytest.mark.parametrize("attention", ["replay", "shared"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", WINDOWED)
def test_batched_resume_equals_text_mode(model, dtype, attention):
    engine = make_engine(model, dtype)
    ctx = engine.encode(CONTEXT)
    root = engine.materialize(ctx)
    sufs = [engine.encode(s) for s in SUFFIXES]
    gens = engine.resume_forks(root, sufs, max_new_tokens=10, return_logits=True, attention=attention)
    for i, (suf, got) in enumerate(zip(sufs, gens)):
        want = engine.generate_text(ctx + suf, max_new_tokens=10, stream=i, return_logits=True)
        assert got.tokens == want.tokens
        if attention == "replay" or dtype == "float32":  # shared mode rounds bf16 differently by design
            assert float((got.logits - want.logits).abs().max()) <= batched_logit_tolerance(want.logits, dtype)


def test_chunked_attention_is_refused_by_batched_resume_before_any_work():
    engine = make_engine("tiny-llama4", "float32")
    root = engine.materialize(engine.encode(CONTEXT))
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        engine.resume_forks(root, [engine.encode(s) for s in SUFFIXES[:2]], max_new_tokens=4)
    assert list(engine._states) == [root.state_id]  # nothing was published


def _batch_tasks(client, since):
    return [m for t, m in client.get_events("daskflow-kv") if t >= since and isinstance(m, dict)
            and str(m.get("key", "")).startswith("kvprefill-resume-batch-")]


@pytest.mark.parametrize("model, batched", [("tiny-mistral", True), ("tiny-llama4", False)])
def test_workflow_agrees_with_text_mode(client, model, batched):
    """RAG with 4 readers on 2 workers: co-located branches batch where the model allows it."""
    rt = KVRuntime(client, model, block_size=16)
    assert (rt.facts.batch_unsupported is None) == batched
    wf = WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=160, max_new_tokens=8, agents=4)
    since = time.time()
    compile_ = lambda: wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)  # noqa: E731
    cmp = Comparison(run_state_mode(compile_(), rt), run_text_mode(compile_(), rt))
    assert cmp.agreement == {a: True for a in wf.agents}
    assert bool(_batch_tasks(client, since)) == batched
