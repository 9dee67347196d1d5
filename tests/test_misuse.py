"""Reuse that cannot be proven compatible is refused with a message naming what differs."""

import pytest
from conftest import CONTEXT, make_engine

from daskflow_kv.engine import Engine
from daskflow_kv.errors import ContextTooLongError, IncompatibleStateError, MergeError, StateReleasedError
from daskflow_kv.model.runner import ModelRunner


def test_state_from_another_model_architecture():
    llama, qwen = make_engine("tiny-llama"), make_engine("tiny-qwen2")
    state = llama.materialize(CONTEXT)
    with pytest.raises(IncompatibleStateError, match="model_id.*tiny-llama.*tiny-qwen2"):
        qwen.resume(state, [5], max_new_tokens=2)


def test_state_from_same_architecture_other_weights():
    base = make_engine("tiny-llama")
    model = base.runner.model
    twin = type(model)(model.config)  # same config, fresh random weights
    twin.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()})
    other = Engine(runner=ModelRunner(twin.eval(), base.tokenizer, base.fingerprint.model_id, base.block_size))
    with pytest.raises(IncompatibleStateError, match="weights"):
        other.resume(base.materialize(CONTEXT), [5], max_new_tokens=2)


def test_state_with_another_tokenizer():
    import copy

    base = make_engine("tiny-llama")
    tok = copy.deepcopy(base.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|agent|>"]})
    other = Engine(runner=ModelRunner(base.runner.model, tok, base.fingerprint.model_id, base.block_size))
    with pytest.raises(IncompatibleStateError, match="tokenizer"):
        other.resume(base.materialize(CONTEXT), [5], max_new_tokens=2)


def test_dtype_mismatch():
    fp32, bf16 = make_engine(dtype="float32"), make_engine(dtype="bfloat16")
    with pytest.raises(IncompatibleStateError, match="dtype: 'float32' != 'bfloat16'"):
        bf16.resume(fp32.materialize(CONTEXT), [5], max_new_tokens=2)


def test_namespace_isolates_tenants():
    a, b = make_engine(namespace="tenant-a"), make_engine(namespace="tenant-b")
    with pytest.raises(IncompatibleStateError, match="namespace"):
        b.extend(a.materialize(CONTEXT), [5])
    assert a.fingerprint.digest != b.fingerprint.digest


def test_block_size_mismatch():
    a, b = make_engine(block_size=16), make_engine(block_size=32)
    with pytest.raises(IncompatibleStateError, match="block_size"):
        b.resume(a.materialize(CONTEXT), [5], max_new_tokens=2)


def test_merge_across_models_refused():
    llama, qwen = make_engine("tiny-llama"), make_engine("tiny-qwen2")
    a = llama.materialize(CONTEXT)
    b = qwen.materialize(CONTEXT)
    with pytest.raises(IncompatibleStateError):
        llama.merge(a, b)
    from daskflow_kv.state import compat

    with pytest.raises(MergeError, match="model_id"):
        compat.check_pair(a, b)


def test_resume_released_state():
    eng = make_engine()
    state = eng.materialize(CONTEXT)
    eng.release(state)
    with pytest.raises(StateReleasedError, match="released"):
        eng.resume(state, [5], max_new_tokens=2)
    with pytest.raises(StateReleasedError):
        eng.fork(state, 2)


def test_context_over_model_limit():
    eng = make_engine()
    limit = eng.runner.max_positions
    with pytest.raises(ContextTooLongError, match=f"exceeds the model's {limit} positions"):
        eng.materialize([5] * (limit + 1))
    state = eng.materialize([5] * (limit - 4))
    with pytest.raises(ContextTooLongError):
        eng.resume(state, [6, 7], max_new_tokens=8)
    with pytest.raises(ContextTooLongError):
        eng.generate_text([5] * limit, max_new_tokens=1)


def test_tokens_outside_vocabulary():
    eng = make_engine()
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        eng.materialize([1, 2, 10**6])


def test_empty_inputs():
    eng = make_engine()
    with pytest.raises(ValueError):
        eng.materialize([])
    state = eng.materialize(CONTEXT)
    with pytest.raises(ValueError):
        eng.extend(state, [])
    with pytest.raises(ValueError):
        eng.fork(state, 0)
    with pytest.raises(ValueError):
        eng.resume(state, [5], max_new_tokens=0)


def test_bf16_fp32_states_never_share_keys():
    fp32, bf16 = make_engine(dtype="float32"), make_engine(dtype="bfloat16")
    assert set(fp32.materialize(CONTEXT).block_keys).isdisjoint(bf16.materialize(CONTEXT).block_keys)
