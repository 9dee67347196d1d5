"""Chunked prefill with per-layer K/V relay (the model side of parallel materialize), no Dask.

Each chunk runs in its own thread, as it would on its own worker; queues stand in for the
worker-to-worker channel. Resuming from the chunks' blocks must give text mode's tokens.
"""

import queue
import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import ARCHS, CONTEXT, SUFFIXES, assert_same_generation, make_engine

from daskflow_kv.model.sampling import GREEDY
from daskflow_kv.state.blocks import aligned_floor


def _relayed(runner, tokens, spans, prefix_blocks=(), prefix_len=0):
    """Run every chunk of ``spans`` in its own thread; -> (start, end, block) of all chunks."""
    inbox = [dict() for _ in spans]  # chunk -> layer -> Queue of (from_chunk, k, v)
    for box in inbox:
        for layer in range(runner.num_layers):
            box[layer] = queue.Queue()
    outs, errors = [None] * len(spans), []

    def work(i):
        s, e = spans[i]

        def send(layer, k, v):
            for j in range(i + 1, len(spans)):
                inbox[j][layer].put((i, k.clone(), v.clone()))

        def recv(layer):
            parts = {}
            while len(parts) < i:
                j, k, v = inbox[i][layer].get(timeout=30)
                parts[j] = (k, v)
            return [parts[j] for j in range(i)]

        try:
            outs[i] = runner.prefill_relayed(list(prefix_blocks), prefix_len, s, list(tokens[s:e]), recv, send)
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(spans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return [b for out in outs for b in out.new_blocks]


def _gen(out):
    return SimpleNamespace(tokens=out.generated, logits=out.logits)


def _resume(runner, blocks, prefix_len, suffix, new=12):
    return _gen(runner.run([b for _, _, b in blocks], prefix_len, suffix, new, GREEDY, 0, True, export=False))


def _text(runner, tokens, new=12):
    return _gen(runner.run([], 0, tokens, new, GREEDY, 0, True, export=False))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32"])  # below fp32 the runtime never relays (see parallel_materialize)
@pytest.mark.parametrize("width", [2, 3])
def test_relayed_chunks_resume_like_text_mode(arch, dtype, width):
    engine = make_engine(arch, dtype, block_size=16)
    runner = engine.runner
    ctx = engine.encode(CONTEXT * 3)
    bs = runner.block_size
    # later chunks shorter, boundaries on the block grid
    fractions = {2: [0.6], 3: [0.45, 0.75]}[width]
    edges = [0, *(aligned_floor(int(len(ctx) * f), bs) for f in fractions), len(ctx)]
    spans = list(zip(edges[:-1], edges[1:]))
    assert len(spans) == width
    blocks = _relayed(runner, ctx, spans)
    assert [(s, e) for s, e, _ in blocks] == [(s, min(s + bs, len(ctx))) for s in range(0, len(ctx), bs)]
    single = runner.run([], 0, ctx, 0).new_blocks
    for (_, _, got), (_, _, want) in zip(blocks, single):
        assert torch.allclose(got.float(), want.float(), rtol=2e-2 if dtype != "float32" else 1e-4, atol=1e-3)
    for suffix in SUFFIXES[:2]:
        suf = engine.encode(suffix)
        got = _resume(runner, blocks, len(ctx), suf)
        assert_same_generation(got, _text(runner, ctx + suf))


def test_relayed_chunks_after_a_cached_prefix():
    """Chunk 0 starts mid-block after a cached prefix; every chunk reads the prefix blocks."""
    engine = make_engine("tiny-llama", "float32", block_size=16)
    runner = engine.runner
    ctx = engine.encode(CONTEXT * 3)
    reused = 37  # inside the third block
    prefix = runner.run([], 0, ctx[:reused], 0).new_blocks
    spans = [(reused, 96), (96, len(ctx))]
    blocks = _relayed(runner, ctx, spans, [b for _, _, b in prefix], reused)
    assert blocks[0][0] == aligned_floor(reused, 16)  # the partial block is rewritten whole
    kept = [b for b in prefix if b[1] <= aligned_floor(reused, 16)]
    suf = engine.encode(SUFFIXES[0])
    got = _resume(runner, kept + blocks, len(ctx), suf)
    assert_same_generation(got, _text(runner, ctx + suf))


def test_a_chunk_waits_for_the_earlier_chunk_before_attending():
    """Without the earlier chunk's K/V the relay refuses rather than attend to a short cache."""
    engine = make_engine("tiny-llama", "float32", block_size=16)
    runner = engine.runner
    ctx = engine.encode(CONTEXT)
    with pytest.raises(ValueError, match="received K/V of 0 tokens"):
        runner.prefill_relayed([], 0, 32, ctx[32:], lambda layer: [], None)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_split_attention_is_masked_attention(heads, kv_heads):
    """Earlier keys unmasked + own keys causal, merged by log-sum-exp = one causal call over all."""
    import torch.nn.functional as F

    from daskflow_kv.model import relay_attention

    if relay_attention._FLASH is None:
        pytest.skip("this torch has no CPU flash kernel returning log-sum-exp")
    torch.manual_seed(0)
    past, q, d = 70, 33, 16
    query = torch.randn(1, heads, q, d)
    key, value = torch.randn(1, kv_heads, past + q, d), torch.randn(1, kv_heads, past + q, d)
    g = heads // kv_heads
    k_all, v_all = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    mask = torch.ones(q, past + q, dtype=torch.bool).tril(diagonal=past)
    want = F.scaled_dot_product_attention(query, k_all, v_all, attn_mask=mask)
    got = relay_attention.split_attention(query, key, value, d**-0.5)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_relay_twin_shares_the_weights_and_keeps_other_dtypes():
    from daskflow_kv.model.relay_attention import RELAY_ATTENTION, relay_twin

    fp32 = make_engine("tiny-llama", "float32", block_size=16).runner.model
    twin = relay_twin(fp32)
    assert twin is relay_twin(fp32) and twin.config._attn_implementation == RELAY_ATTENTION
    assert fp32.config._attn_implementation == "sdpa"  # the loaded model is untouched
    assert all(a is b for a, b in zip(twin.parameters(), fp32.parameters()))
    bf16 = make_engine("tiny-llama", "bfloat16", block_size=16).runner.model
    assert relay_twin(bf16) is bf16  # the exact kernel stays: its rounding is what matches text mode
