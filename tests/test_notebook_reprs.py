"""What a notebook shows: the HTML reprs of a workflow, a run's result, a comparison and a
runtime hold their key facts and escape user text; a run draws its progress bar only when
asked or watched; G_s after a run says where each agent ran and what it reused."""

import re

import pytest
from dask.utils import format_bytes

from daskflow_kv.flow.workflow import Workflow
from daskflow_kv.runtime.cluster import embedded_runtime
from daskflow_kv.runtime.html_repr import RuntimeFacts, render_runtime_html, runtime_html

EVIL = "<script>alert(1)</script>"
DOC = "Quarterly notes: sales rose, costs rose faster, the margin fell. " * 6


def _workflow():
    wf = Workflow(f"review {EVIL}", system="You are a careful analyst.")
    wf.context("report & notes", DOC)
    wf.agent("opt<i>mist", f"List the strengths. {EVIL}", reads=["report & notes"], max_new_tokens=4)
    wf.agent("skeptic", "List the weaknesses.", reads=["report & notes"], max_new_tokens=4)
    wf.agent("judge", "Weigh both views.", reads=["report & notes", "opt<i>mist", "skeptic"], merge="text",
             max_new_tokens=4)
    return wf


def _no_raw_user_markup(page: str) -> None:
    assert "<script>" not in page and "<i>" not in page


# -- without a cluster ----------------------------------------------------------------------------
def test_workflow_repr_lists_contexts_agents_and_levels_escaped():
    page = _workflow()._repr_html_()
    _no_raw_user_markup(page)
    assert "Workflow review &lt;script&gt;" in page and "1 contexts · 3 agents · 2 levels" in page
    assert "opt&lt;i&gt;mist" in page and "report &amp; notes" in page and f"{len(DOC):,}" in page
    judge = re.search(r"<tr><td[^>]*>judge</td>(.*?)</tr>", page).group(1)
    assert ">1<" in judge and "opt&lt;i&gt;mist, skeptic" in judge and ">text<" in judge


def test_a_workflow_that_does_not_compile_still_shows_why():
    wf = Workflow("loop")
    wf.agent("a", "go", reads=["b"])
    wf.agent("b", "go", reads=["a"])
    page = wf._repr_html_()
    assert "does not compile: cycle in workflow &#x27;loop&#x27;" in page


def test_runtime_repr_from_plain_facts():
    facts = RuntimeFacts("tiny<llama>", "float32", 16, "team&co", "cpu",
                         workers={"tcp://10.0.0.2:1": {"nthreads": 1, "kv_bytes": 3 << 20, "busy_s": 0.5},
                                  "tcp://10.0.0.1:1": {"nthreads": 2, "kv_bytes": 1 << 20, "busy_s": 0.0}},
                         kv_budget_bytes=8 << 20, dashboard_link="http://10.0.0.1:8787/status?a=1&b=2")
    page = render_runtime_html(facts)
    assert "tiny&lt;llama&gt; (float32, cpu)" in page and "team&amp;co" in page and "16 tokens" in page
    assert "<strong>Workers:</strong> 2" in page
    assert "4.00 MiB / 16.00 MiB (25%)" in page  # held against the budget of every worker
    assert "3.00 MiB / 8.00 MiB (38%)" in page and "0.50 s" in page
    assert 'href="http://10.0.0.1:8787/status?a=1&amp;b=2"' in page and 'href="http://10.0.0.1:8787/kv"' in page
    assert page.index("tcp://10.0.0.1:1") < page.index("tcp://10.0.0.2:1")
    gone = render_runtime_html(RuntimeFacts("m", "float32", 64, "default", "cpu", error="scheduler not reachable "
                                                                                          "(OSError)"))
    assert "scheduler not reachable (OSError)" in gone and "(no budget)" in gone


# -- one real run on a small cluster ----------------------------------------------------------------
@pytest.fixture(scope="module")
def rt():
    with embedded_runtime(n_workers=2, dashboard_address=":0", model="tiny-llama", block_size=16) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def run(rt):
    return _workflow().run(mode="both", runtime=rt, progress=False)


def test_progress_bar_only_when_asked(rt, capsys):
    wf = _workflow()
    wf.run(mode="both", runtime=rt, progress=True)
    err = capsys.readouterr().err
    assert "6/6" in err and "agent" in err  # 3 agents in each mode, all counted
    wf.run(mode="state", runtime=rt)  # nobody watches pytest's captured stderr: no bar
    err = capsys.readouterr().err
    assert "agent" not in err and "level" not in err


def test_comparison_repr(run):
    page = run._repr_html_()
    _no_raw_user_markup(page)
    assert "Comparison review &lt;script&gt;" in page
    assert f"{sum(run.agreement.values())}/3 agents identical" in page and run.all_agree
    for name, a in run.state.agents.items():
        row = re.search(rf"<tr><td[^>]*>{re.escape(name.replace('<', '&lt;').replace('>', '&gt;'))}</td>(.*?)</tr>",
                        page).group(1)
        assert a.worker in row and f">{a.decision}<" in row and f"{a.ttft_s:.3f} s" in row
        assert f"{run.text.agents[name].ttft_s:.3f} s" in row and ">yes<" in row
    assert f"state {run.state.wall_s:.2f} s · text {run.text.wall_s:.2f} s" in page


def test_result_repr(run):
    page = run.state._repr_html_()
    _no_raw_user_markup(page)
    assert "WorkflowResult review &lt;script&gt;" in page and "state mode" in page
    assert f"{sum(run.state.level_tokens_computed):,}" in page and f"{run.state.generated_tokens:,}" in page
    for a in run.state.agents.values():
        assert a.worker in page and f"{a.tokens_reused:,}" in page
    assert "text mode" in run.text._repr_html_()


def test_runtime_repr(rt, run):
    page = runtime_html(rt)
    workers = rt.client.scheduler_info()["workers"]
    assert "tiny-llama (float32, cpu)" in page and f"<strong>Workers:</strong> {len(workers)}" in page
    assert all(w in page for w in workers)
    held = sum(w.kv_bytes for w in rt.view().workers.values())
    assert held > 0 and f"{format_bytes(held)} (no budget)" in page
    assert rt.client.dashboard_link in page


def test_the_graph_after_a_run_says_where_each_agent_ran(run, tmp_path):
    from test_visualize import parse_dot, _name

    source = _workflow().visualize(tmp_path / "run.dot", result=run)
    nodes, _ = parse_dot(source)
    labels = {_name(a): a["label"] for a in nodes.values()}
    for name, a in run.state.agents.items():
        assert f"ran on {a.worker}" in labels[name]
        assert f"{a.decision}: {a.tokens_reused} reused, {a.tokens_computed} computed" in labels[name]
        assert "same tokens as text mode" in labels[name]
        assert f"{a.decision} on {a.worker}" in labels[f"r:{name}"]
    assert "(estimated)" not in source  # the run's own groups, not the compile-time estimate
