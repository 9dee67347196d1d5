"""The KV budget is a hard limit: sampled every 50 ms in the workers through a workflow, no
worker ever holds more KV than budget + one block, and the outputs stay exact.

Three RAG workflows first run without a budget to measure their natural peak (three, so that
two contexts share a worker of two whatever placement does: the budget must bind); the budget is
then set well below that peak (but above what their largest task needs), and the runs are
repeated on fresh prompts. Admission (evict before a KV task is sent, hold it otherwise) is
what keeps the sampled peak down; the periodic eviction loop alone let a workflow reach
4.9x its budget.
"""

import time

from daskflow_kv.bench import worker_tasks as wt
from daskflow_kv.flow.executor import Comparison, run_state_mode, run_text_mode
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.transport.serialization import _SIZEOF_OVERHEAD
from daskflow_kv.workflows import WORKFLOWS

BLOCK_SIZE = 16


def _workflow(rt, salt: str):
    return WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=320, max_new_tokens=8, agents=4,
                            question=f"{salt}: when should a cached prefix be transferred instead of recomputed?")


def _run(rt, salt: str):
    """Three 4-reader RAG workflows over different contexts, back to back, in state mode (what
    the first leaves cached is what a budget must evict for the second), then text mode;
    the per-worker KV peaks sampled during the state runs."""
    flows = [_workflow(rt, f"{salt}-{i}") for i in range(3)]
    compile_ = lambda wf: wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)  # noqa: E731
    rt.client.run(wt.start_sampler, interval=0.01)  # KV sampled every 5th tick: every 50 ms
    try:
        states = [run_state_mode(compile_(wf), rt) for wf in flows]
    finally:
        peaks = {w: s["peak_kv"] for w, s in rt.client.run(wt.stop_sampler).items()}
    return [Comparison(s, run_text_mode(compile_(wf), rt)) for s, wf in zip(states, flows)], peaks


def test_sampled_peak_stays_within_budget_plus_one_block(client):
    rt = KVRuntime(client, "tiny-llama", block_size=BLOCK_SIZE)
    block = BLOCK_SIZE * rt.facts.bytes_per_token + _SIZEOF_OVERHEAD
    cmps, free_peaks = _run(rt, "unbounded")
    assert all(c.all_agree for c in cmps)
    natural = max(free_peaks.values())
    # Room for the largest single task's working set (its prompt's blocks and its output),
    # with a margin; the workflows' cached blocks together do not fit.
    longest = max(a.prompt_tokens for c in cmps for a in c.state.agents.values()) + 8
    budget = max(int(natural * 0.6), (longest // BLOCK_SIZE + 8) * block)
    assert natural > budget + block, (natural, budget)  # the budget really binds
    rt.configure(kv_budget_bytes=budget)  # trims what the first run left cached
    deadline = time.time() + 10
    while max(rt.client.run(wt.held_kv_bytes).values()) > budget and time.time() < deadline:
        time.sleep(0.05)
    try:
        cmps, peaks = _run(rt, "bounded")
    finally:
        rt.configure(unset_budget=True)
    assert all(c.all_agree for c in cmps), [c.agreement for c in cmps]
    assert all(p <= budget + block for p in peaks.values()), (peaks, budget, block, natural)
    assert rt.counters()["counters"]["evictions"] > 0
