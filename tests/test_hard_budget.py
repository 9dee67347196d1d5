"""The KV budget is a hard limit: sampled every 50 ms in the workers through a workflow, no
worker ever holds more KV than budget + one block, and the outputs stay exact.

The same RAG workflow first runs without a budget to measure its natural peak; the budget
is then set well below that peak (but above what its largest task needs), and the run is
repeated on fresh prompts. Admission (evict before a KV task is sent, hold it otherwise) is
what keeps the sampled peak down; the periodic eviction loop alone let a workflow reach
4.9x its budget.
"""

import time

from daskflow_kv.bench import worker_tasks as wt
from daskflow_kv.flow.executor import Comparison, run_state_mode, run_text_mode
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.runtime.serialization import _SIZEOF_OVERHEAD
from daskflow_kv.workflows import WORKFLOWS

BLOCK_SIZE = 16


def _run(rt, salt: str):
    """State and text mode of a 4-reader RAG over a context unique to ``salt``; per-worker peaks."""
    wf = WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=320, max_new_tokens=8, agents=4,
                          question=f"{salt}: when should a cached prefix be transferred instead of recomputed?")
    compile_ = lambda: wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)  # noqa: E731
    rt.client.run(wt.start_sampler, interval=0.05)
    try:
        state = run_state_mode(compile_(), rt)
    finally:
        peaks = {w: s["peak_kv"] for w, s in rt.client.run(wt.stop_sampler).items()}
    return Comparison(state, run_text_mode(compile_(), rt)), peaks


def test_sampled_peak_stays_within_budget_plus_one_block(client):
    rt = KVRuntime(client, "tiny-llama", block_size=BLOCK_SIZE)
    block = BLOCK_SIZE * rt.facts.bytes_per_token + _SIZEOF_OVERHEAD
    cmp, free_peaks = _run(rt, "unbounded")
    assert cmp.all_agree
    natural = max(free_peaks.values())
    # Room for the largest single task (the longest prompt rebuilt on one worker), and no more.
    longest = max(a.prompt_tokens for a in cmp.state.agents.values()) + 8
    budget = max(int(natural * 0.6), (longest // BLOCK_SIZE + 3) * block)
    assert natural > budget + block, (natural, budget)  # the budget really binds
    rt.configure(kv_budget_bytes=budget)  # trims what the first run left cached
    deadline = time.time() + 10
    while max(rt.client.run(wt._kv_bytes).values()) > budget and time.time() < deadline:
        time.sleep(0.05)
    try:
        cmp, peaks = _run(rt, "bounded")
    finally:
        rt.configure(unset_budget=True)
    assert cmp.all_agree, cmp.agreement
    assert all(p <= budget + block for p in peaks.values()), (peaks, budget, block, natural)
    assert rt.counters()["counters"]["evictions"] > 0
