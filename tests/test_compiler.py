"""Compile-time checks and G_s construction, without a cluster or a model forward."""

import pytest

from daskflow_kv.flow.compiler import group_by_prefix
from daskflow_kv.errors import ContextTooLongError, WorkflowError
from daskflow_kv.model.zoo.loader import load_tokenizer
from daskflow_kv.flow.workflow import Workflow
from daskflow_kv.workflows import WORKFLOWS

TOK = load_tokenizer("tiny-llama")


def _compile(wf, max_positions=2048, block_size=16):
    return wf.compile(TOK, max_positions, block_size)


def test_group_by_prefix_partitions_by_shared_tokens():
    prompts = {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 4, 9], "c": [7, 7, 7], "d": [1, 2, 3, 4, 5, 6]}
    groups = group_by_prefix(prompts, min_shared=3)
    assert sorted((g.members, g.prefix_len) for g in groups) == [(("a", "b", "d"), 4), (("c",), 2)]


def test_group_keeps_one_token_for_each_member():
    groups = group_by_prefix({"a": [1, 2, 3], "b": [1, 2, 3, 4]}, min_shared=2)
    assert groups[0].prefix_len == 2  # a must still feed one token of its own to get logits


def test_shared_context_gives_one_materialize_and_a_fork():
    wf = Workflow("w")
    wf.context("doc", "A shared document about caches. " * 20)
    for i in range(3):
        wf.agent(f"a{i}", f"Question {i}?", reads=["doc"])
    cw = _compile(wf)
    kinds = [n.kind for n in cw.state_nodes]
    assert kinds.count("materialize") == 1 and kinds.count("fork") == 1 and kinds.count("resume") == 3
    fork = next(n for n in cw.state_nodes if n.kind == "fork")
    assert fork.agents == ("a0", "a1", "a2") and fork.tokens > 100
    assert "materialize" in cw.explain() and "a0" in cw.explain()


def test_levels_follow_data_edges():
    cw = _compile(WORKFLOWS["planner"](agents=2, context_tokens=64, tokenizer=TOK))
    assert cw.levels == [["planner"], ["solver0", "solver1"], ["judge"]]
    assert ("planner", "solver0") in cw.data_edges and ("solver1", "judge") in cw.data_edges


def test_unknown_agent_or_missing_context():
    wf = Workflow("w")
    wf.context("doc", "text")
    wf.agent("a", "go", reads=["doc", "ghost"])
    with pytest.raises(WorkflowError, match="reads 'ghost', which is neither a context nor an agent"):
        _compile(wf)
    wf2 = Workflow("w2")
    wf2.agent("b", "go", follows="nobody")
    with pytest.raises(WorkflowError, match="follows 'nobody'"):
        _compile(wf2)


def test_cycle_is_reported_with_its_path():
    wf = Workflow("w")
    wf.agent("a", "go", reads=["c"])
    wf.agent("b", "go", reads=["a"])
    wf.agent("c", "go", reads=["b"])
    with pytest.raises(WorkflowError, match=r"cycle in workflow 'w': (a|b|c) -> .* -> \1"):
        _compile(wf)


def test_concat_merge_of_sibling_branches_is_refused():
    wf = Workflow("w")
    wf.context("doc", "text")
    wf.agent("x", "one", reads=["doc"])
    wf.agent("y", "two", reads=["doc"])
    wf.agent("j", "judge", reads=["x", "y"], merge="concat")
    with pytest.raises(WorkflowError, match="cannot concat-merge the states of 'x' and 'y'.*merge='text'"):
        _compile(wf)
    wf.agents.pop("j")
    wf.agent("j", "judge", reads=["x", "y"], merge="text")
    _compile(wf)  # text reduction is always possible


def test_prompt_over_context_limit_fails_at_compile_time():
    wf = Workflow("w")
    wf.context("doc", "word " * 400)
    wf.agent("a", "summarize", reads=["doc"], max_new_tokens=16)
    wf.agent("b", "again", reads=["a"], max_new_tokens=600)
    with pytest.raises(ContextTooLongError, match="agent .a.: prompt of up to .* exceeds the model.s 256 positions"):
        _compile(wf, max_positions=256)
    wf2 = Workflow("w2")
    wf2.agent("a", "short", max_new_tokens=150)
    wf2.agent("b", "reads a long answer", reads=["a"], max_new_tokens=8)
    with pytest.raises(ContextTooLongError, match="agent 'b'"):  # a's output may be 200 tokens long
        _compile(wf2, max_positions=200)


def test_bad_agent_settings():
    wf = Workflow("w")
    with pytest.raises(WorkflowError, match="state policy"):
        wf.agent("a", "go", policy="teleport")
    with pytest.raises(WorkflowError, match="already used"):
        wf.context("a", "x")
        wf.agent("a", "go")
    with pytest.raises(WorkflowError, match="no agents"):
        _compile(Workflow("empty"))
