"""Tools, run-time steps and the KV of a conversation across a tool call, on a real 2-worker
LocalCluster with the tiny model: every agent's tokens equal text replay's, a ReAct turn
extends its own conversation's KV, a tool's failure spares what does not depend on it.

Tiny random models write gibberish, so the tool calls here are chosen by a predicate over the
step (``propose``); the agents' tokens are still generated, and compared, in both modes."""

import pytest
from distributed import Client

from daskflow_kv.errors import ToolFailed, WorkflowError
from daskflow_kv.flow.executor import run_workflow
from daskflow_kv.flow.growing import for_run
from daskflow_kv.flow.executor import run_state_mode
from daskflow_kv.flow.operators import Corpus
from daskflow_kv.flow.prompts import prompt_tokens
from daskflow_kv.flow.retrieval import BM25, Passage
from daskflow_kv.flow.steps import ToolCall
from daskflow_kv.flow.tool_calls import HISTORY
from daskflow_kv.flow.workflow import Workflow
from daskflow_kv.runtime.cluster import drop_kv, local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.state.blocks import chain_keys
from daskflow_kv.workflows import debate_until, react_tools, tot_pruned
from daskflow_kv.workflows.tool_latency import Latency

MAX_NEW = 6


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    store = tmp_path_factory.mktemp("kv-store")
    with local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", resources={"tools": 1}) as c, \
            Client(c) as client:
        runtime = KVRuntime(client, "tiny-llama", block_size=16, kv_store=f"file://{store}")
        yield runtime
        drop_kv(runtime)


def _calls(k, text):
    """Two calculator calls, then an answer: a ReAct agent's choice as a predicate."""
    return ToolCall("calculator", f"{k + 2} * 7") if k < 2 else None


def _agree(cmp, memory=()):
    """Same agents, same tokens, same tool outputs (but ``memory`` reads: the state run wrote first)."""
    assert cmp.agreement == {a: True for a in cmp.text.agents}, cmp.agreement
    assert set(cmp.state.agents) == set(cmp.text.agents)
    tools = [t for t in cmp.state.tools if t not in memory]
    assert {t: cmp.state.tools[t]["text"] for t in tools} == {t: cmp.text.tools[t]["text"] for t in tools}


def test_react_matches_text_and_each_turn_extends_its_own_conversation(rt):
    wf = react_tools.build(max_steps=4, context_tokens=96, max_new_tokens=MAX_NEW, tokenizer=rt.tokenizer,
                           propose=_calls, name="react-exact")
    cmp = run_workflow(wf, mode="both", runtime=rt)
    _agree(cmp)
    assert list(cmp.state.agents) == ["agent.0", "agent.1", "agent.2"]
    assert [cmp.state.tools[f"agent.t{k}"]["text"] for k in range(2)] == ["14", "21"]
    for k in (1, 2):  # the turn before (its prompt and its answer) is reused, only the observation is new
        prev, now = cmp.text.agents[f"agent.{k - 1}"], cmp.state.agents[f"agent.{k}"]
        assert now.tokens_reused >= prev.prompt_tokens + len(prev.tokens) - 2
        assert now.tokens_computed < now.prompt_tokens - prev.prompt_tokens
    graph = cmp.state.graph
    assert graph.levels == [["agent.0"], ["agent.1"], ["agent.2"]]
    assert any("calls calculator[2 * 7] as agent.t0" in line for line in graph.taken)
    assert any(line.startswith("agent.0 waits on agent.t0: keep") for line in graph.taken)
    assert "decided at run time" in cmp.state.explain
    pytest.importorskip("graphviz")
    dot = wf.visualize(result=cmp, format="dot")
    assert "agent.t1" in dot and "react step" in dot and "class=tool" in dot and "decided at run time" in dot


@pytest.mark.parametrize("variant", ["debate-2-rounds", "debate-stops-at-once", "tot-scoring-agent", "tot-score-fn"])
def test_loops_and_beams_match_text_and_take_the_steps_they_decide(rt, variant):
    kw = dict(context_tokens=96, max_new_tokens=MAX_NEW, tokenizer=rt.tokenizer, name=f"grow-{variant}")
    if variant.startswith("debate"):
        stop = variant.endswith("at-once")
        wf = debate_until.build(agents=2, max_rounds=2, until=lambda text: stop, **kw)
        judges = [f"debate.r{r}.judge" for r in range(1 if stop else 2)]
    else:
        score = tot_pruned.RATE if variant.endswith("agent") else (lambda text: len(text))
        wf = tot_pruned.build(branch=2, keep=1, depth=2, score=score, **kw)
    cmp = run_workflow(wf, mode="both", runtime=rt)
    _agree(cmp)
    ran = set(cmp.state.agents)
    if variant.startswith("debate"):
        assert {a for a in ran if a.endswith("judge")} == set(judges) and "moderator" in ran
        assert any(("until() held" if stop else "max_rounds reached") in line for line in cmp.state.graph.taken)
    else:
        first = [a for a in ran if a.count(".") == 1]
        second = [a for a in ran if a.count(".") == 2]
        assert sorted(first) == ["tot.0", "tot.1"] and len(second) == 2  # only the kept thought grew
        kept = second[0].rsplit(".", 1)[0]
        assert all(a.startswith(kept + ".") for a in second)
        for child in second:  # a kept thought's children continue its conversation
            assert cmp.state.agents[child].tokens_reused >= cmp.text.agents[kept].prompt_tokens
        if variant.endswith("agent"):
            assert {f"tot.score.{a}" for a in first + second} <= ran


def test_a_failing_tool_fails_the_run_once_the_rest_has_finished(rt):
    def broken(text):
        raise ZeroDivisionError("the search service is down")

    wf = Workflow("fails", system="Tool failure test.")
    wf.context("doc", "A short shared document about caches and agents. " * 6)
    wf.agent("early", "Answer.", reads=["doc"], max_new_tokens=MAX_NEW)
    wf.tool("lookup", broken, reads=["early"])
    wf.agent("needs_it", "Use the lookup.", reads=["doc", "lookup"], max_new_tokens=MAX_NEW)
    wf.agent("independent", "Answer differently.", reads=["doc"], max_new_tokens=MAX_NEW)
    wf.agent("later", "Go on.", follows="independent", max_new_tokens=MAX_NEW)
    with pytest.raises(ToolFailed, match="tool 'lookup' failed: ZeroDivisionError.*not run: needs_it") as info:
        run_workflow(wf, mode="state", runtime=rt)
    err = info.value
    assert err.tool == "lookup" and isinstance(err.__cause__, ZeroDivisionError)
    assert set(err.result.agents) == {"early", "independent", "later"}  # everything that did not need it ran
    later = err.result.agents["later"]
    # their KV was kept: run again (the tool fixed), the conversation "later" had is reused whole
    again = run_workflow(_without(wf, "needs_it"), mode="state", runtime=rt)
    assert again.agents["later"].tokens == later.tokens and again.agents["later"].tokens_computed <= 1


def _without(wf, name):
    """``wf`` without the failing tool's reader and the tool: the rest, to run again."""
    again = Workflow(wf.name, system=wf.system)
    again.contexts.update(wf.contexts)
    again.agents.update({n: a for n, a in wf.agents.items() if n != name})
    again.tools.update({n: t for n, t in wf.tools.items() if n != "lookup"})
    again.tool("lookup", str.upper, reads=["early"])
    return again


def test_retrieval_and_memory_are_operators_of_the_graph(rt):
    ps = [Passage(f"p{i}", t, x) for i, (t, x) in enumerate([
        ("Caches", "keys and values are cached per token"), ("Dask", "futures run on workers"),
        ("Eviction", "under memory pressure blocks are evicted"), ("BM25", "ranks passages by terms")])]
    wf = Workflow("ops", system="Operators test.")
    wf.context("question", "How are blocks evicted under memory pressure?")
    wf.retrieve("found", Corpus.from_passages(ps), reads=["question"], k=2)
    wf.recall("before", "notes", default="(nothing yet)")
    wf.remember("write", "notes", reads=["found"])
    wf.recall("after", "notes")
    wf.agent("reader", "Answer from what was found.", reads=["question", "found", "after"], max_new_tokens=MAX_NEW)
    cmp = run_workflow(wf, mode="both", runtime=rt)
    _agree(cmp, memory=["before"])
    expected = "\n".join(f"[{p.title}] {p.text}" for p in BM25(ps).search("How are blocks evicted under memory "
                                                                          "pressure?", 2))
    tools = cmp.state.tools
    assert tools["found"]["text"] == expected and tools["after"]["text"] == expected
    assert tools["before"]["text"] in ("(nothing yet)", expected)  # "before" has no order against the write
    assert cmp.text.tools["before"]["text"] == expected  # the memory outlived the state run
    assert cmp.state.graph.levels == [["reader"]]


def test_tools_run_where_their_resources_are_and_refuse_what_no_worker_has(rt):
    wf = Workflow("res", system="Resources test.")
    wf.context("doc", "x " * 20)
    wf.tool("t", str.upper, reads=["doc"], resources={"tools": 1}, retries=1)
    wf.agent("a", "go", reads=["t"], max_new_tokens=2)
    assert run_workflow(wf, mode="state", runtime=rt).tools["t"]["text"] == ("x " * 20).upper()
    wf.tool("gpu", str.upper, reads=["doc"], resources={"GPU": 1})
    with pytest.raises(WorkflowError, match="tool 'gpu' needs resources {'GPU': 1}, which no worker"):
        run_workflow(wf, mode="state", runtime=rt)


@pytest.mark.parametrize("action", ["spill", "drop"])
def test_kv_across_the_wait_spilled_and_prefetched_or_dropped_gives_the_same_tokens(rt, action):
    wf = react_tools.build(max_steps=2, context_tokens=96, max_new_tokens=MAX_NEW, tokenizer=rt.tokenizer,
                           propose=_calls, latency=Latency(1, 0.6, 0.6), name=f"react-{action}")
    HISTORY.record("tool:calculator", 0.6)  # measured before: the prefetch is timed by it
    cw, grow = for_run(wf, rt, "state", wait_forced=action)
    state = run_state_mode(cw, rt, grow=grow)
    grow.finish(state)
    text = run_workflow(wf, mode="text", runtime=rt)
    assert {a: r.tokens for a, r in state.agents.items()} == {a: r.tokens for a, r in text.agents.items()}
    [d] = grow.wait.decisions
    assert d["action"] == action and d["conversation"] == "agent.0" and d["nbytes"] > 0
    turn = state.agents["agent.1"]
    if action == "spill":  # written whole, read back before the tool returned, then extended
        assert d["at"] < d["prefetched_at"] < state.tools["agent.t0"]["seconds"] + d["at"] + 0.5
        assert rt.flush_store() == 0
        first = cw.workflow.agents["agent.0"]
        fed = prompt_tokens(cw.workflow, first, {}, rt.tokenizer) + state.agents["agent.0"].tokens[:-1]
        chain = chain_keys(rt.key_digest, fed, rt.block_size, namespace=rt.spec.namespace)
        assert rt.store.leading(k for k, _, _ in chain) == len(chain)
        assert turn.tokens_reused >= text.agents["agent.0"].prompt_tokens
    assert any(line.startswith(f"agent.0 waits on agent.t0: {action}") for line in cw.taken)
