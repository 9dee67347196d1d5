"""Every example workflow: state mode gives text mode's tokens on a real 2-worker cluster,
materializes each shared prefix once, and prefills far fewer tokens."""

import pytest

from daskflow_kv.state.blocks import common_prefix_len
from daskflow_kv.flow.compiler import level_groups
from daskflow_kv.flow.executor import Comparison, run_state_mode, run_text_mode
from daskflow_kv.flow.prompts import prompt_tokens
from daskflow_kv.runtime.cluster import embedded_runtime
from daskflow_kv.workflows import WORKFLOWS

SMALL = {
    "tot": dict(branch=2, depth=2),
    "debate": dict(agents=2, rounds=3),
    "rag": dict(agents=3),
    "planner": dict(agents=3),
}


@pytest.fixture(scope="module")
def rt():
    with embedded_runtime(n_workers=2, model="tiny-llama", block_size=16) as runtime:
        yield runtime


def _both(rt, wf):
    compile_ = lambda: wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)  # noqa: E731
    return Comparison(run_state_mode(compile_(), rt), run_text_mode(compile_(), rt))


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_state_mode_matches_text_mode(rt, name):
    wf = WORKFLOWS[name](tokenizer=rt.tokenizer, context_tokens=160, max_new_tokens=8, **SMALL[name])
    cmp = _both(rt, wf)
    assert cmp.agreement == {a: True for a in wf.agents}
    for a in wf.agents:  # same prompts were fed in both modes
        assert cmp.state.agents[a].prompt_tokens == cmp.text.agents[a].prompt_tokens
    assert sum(cmp.state.level_tokens_computed) < sum(cmp.text.level_tokens_computed)
    # Once per distinct shared prefix: one materialize node per prefix group in every level.
    graph = cmp.state.graph
    outputs = {a: r.text for a, r in cmp.text.agents.items()}
    for lvl, names in enumerate(graph.levels):
        prompts = {n: prompt_tokens(wf, wf.agents[n], outputs, rt.tokenizer) for n in names}
        groups = level_groups(wf, prompts, rt.block_size)
        nodes = [n for n in graph.state_nodes if n.level == lvl and n.kind == "materialize"]
        assert sorted(n.agents for n in nodes) == sorted(g.members for g in groups)
        assert not any(n.estimated for n in graph.state_nodes if n.level == lvl)


def test_shared_prefix_prefilled_once_per_level(rt):
    wf = WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=200, max_new_tokens=6, agents=4)
    cmp = _both(rt, wf)
    readers = [f"reader{i}" for i in range(4)]
    fork = next(n for n in cmp.state.graph.state_nodes if n.kind == "fork" and n.level == 0)
    assert fork.agents == tuple(readers)
    suffixes = sum(cmp.state.agents[r].tokens_computed for r in readers)
    # Level 0: the shared passages at most once, plus each reader's own suffix.
    assert cmp.state.level_tokens_computed[0] <= fork.tokens + suffixes
    assert cmp.text.level_tokens_computed[0] == sum(cmp.text.agents[r].prompt_tokens for r in readers)
    assert all(cmp.state.agents[r].tokens_reused >= fork.tokens for r in readers)


def test_debate_rounds_prefill_only_new_messages(rt):
    rounds = 3
    wf = WORKFLOWS["debate"](tokenizer=rt.tokenizer, context_tokens=160, max_new_tokens=8, agents=2, rounds=rounds)
    wf.system = "Debate briefly (a fresh system prompt: nothing from earlier tests is cached)."
    state = run_state_mode(wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size), rt)
    outputs = {a: r.text for a, r in state.agents.items()}
    shared = []  # each round's shared prompt prefix, in tokens
    for r in range(rounds):
        prompts = [prompt_tokens(wf, wf.agents[f"d{d}_r{r}"], outputs, rt.tokenizer) for d in range(2)]
        shared.append(prompts[0][: common_prefix_len(*prompts)])
    for r in range(1, rounds):
        names = [f"d{d}_r{r}" for d in range(2)]
        # New messages: the part of this round's shared prefix the previous round did not have.
        new_messages = len(shared[r]) - common_prefix_len(shared[r], shared[r - 1])
        suffixes = sum(state.agents[n].tokens_computed for n in names)
        rebuilt = sum(state.agents[n].tokens_recomputed for n in names)  # cost-model copies on other workers
        assert 0 < new_messages < len(shared[r]) // 2
        assert state.level_tokens_computed[r] - rebuilt == new_messages + suffixes
        materialize = state.lineage[names[0]][-3]  # materialize -> fork -> resume
        assert materialize["op"] == "materialize" and materialize["tokens_computed"] == new_messages


def test_each_state_mode_run_is_reported_for_the_live_plots(rt):
    from daskflow_kv.keys import PLUGIN_NAME

    received = lambda: rt.client.run_on_scheduler(  # noqa: E731
        lambda dask_scheduler: dask_scheduler.plugins[PLUGIN_NAME].timeline.received())
    before = received()
    wf = WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=64, max_new_tokens=2, agents=2)
    run_state_mode(wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size), rt)
    assert received() == before + 1
    run_text_mode(wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size), rt)  # the baseline: not daskflow-kv's
    assert received() == before + 1
