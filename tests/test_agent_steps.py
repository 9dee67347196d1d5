"""Tools and run-time steps as data: the parsers of what a model wrote, the checks of a spec
with tools and steps, levels through tools, and a level's groups of continuations. No cluster."""

import pytest

from daskflow_kv.errors import WorkflowError
from daskflow_kv.flow.compiler import level_groups
from daskflow_kv.flow.operators import Corpus, Search, bm25_search
from daskflow_kv.flow.retrieval import Passage
from daskflow_kv.flow.steps import ToolCall, final_answer, parse_action, parse_score
from daskflow_kv.flow.tool_calls import ToolHistory, history_key, run_tool
from daskflow_kv.flow.workflow import Workflow
from daskflow_kv.model.zoo.loader import load_tokenizer
from daskflow_kv.workflows.react_tools import calculator
from daskflow_kv.workflows.tool_latency import Latency, Slow

TOK = load_tokenizer("tiny-llama")
TOOLS = ["calculator", "search"]


@pytest.mark.parametrize("text, call", [
    ("Thought: multiply.\nAction: calculator[30 * 64]\n", ToolCall("calculator", "30 * 64")),
    ("I will use SEARCH(transfer or recompute) now", ToolCall("search", "transfer or recompute")),
    ("Action: search\nAction Input: eviction", ToolCall("search", "eviction")),
    ("Action: calculator['2+2']", ToolCall("calculator", "2+2")),
    ("search[a] then calculator[1]", ToolCall("search", "a")),  # the first call counts
    ("Final Answer: 42. (calculator[1] was not needed)", None),  # an answer before any call
    ("Action: browser[x]", None),  # not a tool it was given
    ("\x00\ufffd gibberish ]]][[ ((", None),
    ("", None),
])
def test_parse_action_reads_the_forms_small_models_write(text, call):
    assert parse_action(text, TOOLS) == call


def test_parse_score_and_final_answer_never_raise():
    assert parse_score("I'd say 7/10") == 7.0 and parse_score("-2.5 points") == -2.5
    assert parse_score("no number") == 0.0 and parse_score(None) == 0.0
    assert final_answer("Thought: done.\nFinal Answer: 46080 bytes") == "46080 bytes"
    assert final_answer("just text ") == "just text"


def test_tool_spec_checks_fail_in_one_line_before_any_run():
    wf = Workflow("w")
    with pytest.raises(WorkflowError, match="fn must be callable"):
        wf.tool("t", "not a function")
    with pytest.raises(WorkflowError, match="retries"):
        wf.tool("t", str, retries=99)
    with pytest.raises(WorkflowError, match=r"resources\['GPU'\]"):
        wf.tool("t", str, resources={"GPU": -1})
    with pytest.raises(WorkflowError, match="max_steps"):
        wf.react("r", "go", {"calculator": calculator}, max_steps=0)
    with pytest.raises(WorkflowError, match="tools must map names to functions"):
        wf.react("r", "go", {"calculator": 3})
    wf.tool("t", str)
    with pytest.raises(WorkflowError, match="already used"):
        wf.loop("t", lambda g, r, last: None, until=bool, max_rounds=2)


def test_levels_run_through_tools_and_cycles_through_them_are_found():
    wf = Workflow("w")
    wf.context("doc", "a document " * 10)
    wf.agent("a", "first", reads=["doc"])
    wf.tool("t", str.upper, reads=["a"])
    wf.agent("b", "second", reads=["doc", "t"])
    cw = wf.compile(TOK, 2048, 16)
    assert cw.levels == [["a"], ["b"]]
    assert ("a", "t") in cw.data_edges and ("t", "b") in cw.data_edges
    bad = Workflow("w")
    bad.tool("x", str, reads=["y"])
    bad.tool("y", str, reads=["x"])
    bad.agent("c", "go", reads=["x"])
    with pytest.raises(WorkflowError, match="cycle in workflow 'w': x -> y -> x"):
        bad.compile(TOK, 2048, 16)
    ghost = Workflow("w")
    ghost.tool("x", str, reads=["nobody"])
    ghost.agent("c", "go", reads=["x"])
    with pytest.raises(WorkflowError, match="tool 'x' reads 'nobody'"):
        ghost.compile(TOK, 2048, 16)


def test_a_workflow_of_steps_alone_compiles():
    wf = Workflow("w")
    wf.react("r", "go", {"calculator": calculator})
    assert wf.compile(TOK, 2048, 16).levels == []


def test_continuations_group_only_with_their_siblings():
    """Two parents' children share the system prompt and the document (>= min_shared), but
    each group's prefix must hold its parent's whole conversation: they are grouped by parent."""
    wf = Workflow("w")
    for p in ("p0", "p1"):
        wf.agent(p, "think")
        for i in range(2):
            wf.agent(f"{p}.{i}", "more", follows=p)
    wf.agent("solo", "alone")
    shared = list(range(40))
    prompts = {"p0.0": shared + [1, 1, 5], "p0.1": shared + [1, 1, 6], "p1.0": shared + [2, 2, 5],
               "p1.1": shared + [2, 2, 6], "solo": shared + [3]}
    groups = sorted((g.members, g.prefix_len) for g in level_groups(wf, prompts, 16))
    assert groups == [(("p0.0", "p0.1"), 42), (("p1.0", "p1.1"), 42), (("solo",), 40)]


def test_tools_run_in_process_and_their_durations_are_kept_by_tool():
    out = run_tool(calculator, ("6 * 7",), [], None)
    assert out.text == "42" and out.seconds >= 0 and out.worker == ""
    assert run_tool(lambda *t: {"n": len(t)}, (), ["a", "b"], lambda v: f"n={v['n']}").text == "n=2"
    with pytest.raises(TypeError, match="render must return str"):
        run_tool(str, (), ["x"], lambda v: 3)
    h = ToolHistory()
    slow = Slow(calculator, Latency(0, 0.0, 0.0))
    wf = Workflow("w")
    wf.tool("t", slow, args=("1",))
    h.record(history_key(wf.tools["t"]), 1.5)
    assert h.durations("tool:calculator") == (1.5,)  # the delayed calculator is the calculator


def test_search_reads_a_corpus_file_or_passages_and_latency_is_seeded():
    ps = [Passage("a", "Caches", "keys and values are cached"), Passage("b", "Dask", "futures and workers")]
    corpus = Corpus.from_passages(ps)
    assert bm25_search(corpus, 1, "dask", "workers") == "[Dask] futures and workers"
    assert Corpus.from_passages(ps).ident == corpus.ident  # the same passages: scattered once
    from daskflow_kv.workflows.common import CORPUS_PATH

    assert "[Transfer or recompute]" in Search(Corpus.from_file(CORPUS_PATH), k=1)("transfer or recompute")
    lat = Latency(3, 0.5, 5.0)
    assert lat.seconds("search", "x") == lat.seconds("search", "x")
    assert 0.5 <= lat.seconds("search", "y") <= 5.0 and lat.seconds("search", "y") != lat.seconds("search", "z")
    with pytest.raises(ValueError):
        Corpus.from_passages([])
