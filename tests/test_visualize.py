"""Workflow.visualize draws G_s: the DOT output's nodes and edges are G_s's, user text is
escaped, svg needs Graphviz's dot (one line when it is missing), dot never does. No cluster."""

import html
import re
import shutil
import xml.etree.ElementTree as ET

import pytest

from daskflow_kv.cli import main as cli_main
from daskflow_kv.errors import InvalidInputError
from daskflow_kv.flow.visualize import GraphvizNotFoundError
from daskflow_kv.flow.workflow import Workflow
from daskflow_kv.model.zoo.loader import load_tokenizer

pytest.importorskip("graphviz")
TOK = load_tokenizer("tiny-llama")
DOC = "A shared document about caches and how they are reused by agents. " * 12
HAS_DOT = shutil.which("dot") is not None


def _workflow(doc="doc", a="optimist", b="skeptic"):
    wf = Workflow("review", system="You are a careful analyst.")
    wf.context(doc, DOC)
    wf.agent(a, "List the strengths.", reads=[doc])
    wf.agent(b, "List the weaknesses.", reads=[doc])
    wf.agent("judge", "Weigh both views.", reads=[doc, a, b], merge="text")
    wf.agent("editor", "Shorten the verdict to one line.", follows="judge")
    return wf


# -- a small reader of the DOT that graphviz writes ------------------------------------------------
def _value(text: str, i: int) -> tuple[str, int]:
    """One attribute value starting at text[i]: <html>, "quoted" or bare; returns (value, end)."""
    if text[i] == "<":
        depth, j = 0, i
        while True:
            depth += {"<": 1, ">": -1}.get(text[j], 0)
            j += 1
            if depth == 0:
                return text[i:j], j
    if text[i] == '"':
        m = re.compile(r'"((?:[^"\\]|\\.)*)"').match(text, i)
        return m.group(1), m.end()
    m = re.compile(r"[^\s\]]+").match(text, i)
    return m.group(0), m.end()


def _attrs(text: str) -> dict:
    out, i = {}, 0
    while True:
        m = re.compile(r"\s*(\w+)=").match(text, i)
        if not m:
            return out
        out[m.group(1)], i = _value(text, m.end())


def parse_dot(source: str):
    """(nodes {id: attrs}, edges [(tail, head, attrs)]) of the statements with attributes."""
    nodes, edges = {}, []
    for line in source.splitlines():
        m = re.match(r"\s*(\w+) -> (\w+) \[(.*)\]$", line)
        if m:
            edges.append((m.group(1), m.group(2), _attrs(m.group(3))))
            continue
        m = re.match(r"\s*(\w+) \[(.*)\]$", line)
        if m and m.group(1) not in ("node", "edge", "graph"):
            nodes[m.group(1)] = _attrs(m.group(2))
    return nodes, edges


def _name(attrs) -> str:
    """The node's name: its label's bold first line, unescaped."""
    return html.unescape(re.search(r"<b>(.*?)</b>", attrs["label"]).group(1))


def _graph_of(source: str):
    nodes, edges = parse_dot(source)
    name = {nid: _name(a) for nid, a in nodes.items()}
    kind = {name[nid]: a["class"].split()[0] for nid, a in nodes.items()}
    by_class = {}
    for tail, head, a in edges:
        by_class.setdefault(a["class"], set()).add((name[tail], name[head]))
    return name, kind, by_class, nodes


# -- G_s, node for node and edge for edge -----------------------------------------------------------
def test_the_dot_output_is_g_s(tmp_path):
    wf = _workflow()
    cw = wf.compile(TOK, 2048, 16)
    source = cw.visualize(tmp_path / "review", format="dot")
    assert (tmp_path / "review.dot").read_text() == source
    name, kind, edges, nodes = _graph_of(source)
    assert len(set(name.values())) == len(name)  # one node per G_s vertex, none twice
    expected = {c: "context" for c in wf.contexts} | {a: "agent" for a in wf.agents}
    expected |= {n.id: n.kind for n in cw.state_nodes}
    assert kind == expected
    assert edges["data"] == set(cw.data_edges)
    assert edges["state"] == set(cw.state_edges)
    assert edges["serves"] == {(n.id, n.agents[0]) for n in cw.state_nodes if n.kind == "resume"}
    assert set(edges) == {"data", "state", "serves"}
    # The judge's materialize combines both readers' states: drawn (and classed) as a merge.
    merges = [a for a in nodes.values() if "merge" in a["class"].split()]
    [judge_m] = [n for n in cw.state_nodes if n.kind == "materialize" and n.agents == ("judge",)]
    assert [_name(a) for a in merges] == [judge_m.id]
    assert "merges optimist, skeptic (text)" in merges[0]["label"]
    # Each level is its own frame, holding that level's agents and operators.
    for lvl, agents in enumerate(cw.levels):
        frame = source.split(f"subgraph cluster_level{lvl} {{", 1)[1].split("}", 1)[0]
        inside = {name[nid] for nid in re.findall(r"^\s*(\w+) \[", frame, re.M)}
        assert inside == set(agents) | {n.id for n in cw.state_nodes if n.level == lvl}


def test_workflow_visualize_compiles_for_a_model_without_a_cluster(tmp_path):
    wf = _workflow()
    source = wf.visualize(tmp_path / "g.dot", model="tiny-llama", block_size=16)  # the extension picks dot
    assert (tmp_path / "g.dot").exists() and not (tmp_path / "g.dot.svg").exists()
    _, kind, edges, _ = _graph_of(source)
    cw = wf.compile(TOK, 2048, 16)
    assert kind == {**{c: "context" for c in wf.contexts}, **{a: "agent" for a in wf.agents},
                    **{n.id: n.kind for n in cw.state_nodes}}
    assert edges["state"] == set(cw.state_edges)


def test_names_are_escaped_and_survive_exactly(tmp_path):
    """Names with DOT and HTML specials (":" is a port in DOT, "<" a tag, "\\" an escape)."""
    doc, a, b = 'doc:1 <b>&amp;\\', 'a:"x"<script>alert(1)</script>\\', "b\\"
    wf = _workflow(doc, a, b)
    source = wf.visualize(format="dot", model="tiny-llama", block_size=16)
    assert "<script>" not in source and "&lt;script&gt;" in source
    name, kind, edges, _ = _graph_of(source)
    assert {n for n, k in kind.items() if k in ("context", "agent")} == {doc, a, b, "judge", "editor"}
    assert (a, "judge") in edges["data"] and (doc, b) in edges["data"]


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz's dot program is not installed")
def test_svg_is_drawn_by_dot(tmp_path):
    wf = _workflow()
    wf.visualize(tmp_path / "g", model="tiny-llama", block_size=16)  # svg by default
    root = ET.parse(tmp_path / "g.svg").getroot()
    classes = [g.get("class", "") for g in root.iter("{http://www.w3.org/2000/svg}g")]
    for k in ("context", "agent", "materialize", "fork", "resume", "data", "state", "serves"):
        assert any(k in c.split() for c in classes), k
    data = wf.visualize(model="tiny-llama", block_size=16)  # no file: the drawing itself
    svg = getattr(data, "data", data)
    assert "<svg" in (svg.decode() if isinstance(svg, bytes) else svg)


def test_without_dot_svg_is_one_line_and_dot_still_works(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` anywhere
    cw = _workflow().compile(TOK, 2048, 16)
    with pytest.raises(GraphvizNotFoundError) as err:
        cw.visualize(tmp_path / "g.svg")
    assert "\n" not in str(err.value) and "Graphviz's `dot` program" in str(err.value)
    assert "format='dot'" in str(err.value)
    assert not (tmp_path / "g.svg").exists()
    assert cw.visualize(tmp_path / "g", format="dot").startswith("digraph G_s {")


def test_a_bad_format_is_refused_in_one_line(tmp_path):
    cw = _workflow().compile(TOK, 2048, 16)
    with pytest.raises(InvalidInputError, match="format must be one of svg, png, pdf, jpeg, jpg, dot"):
        cw.visualize(tmp_path / "g", format="gif")


def test_cli_explain_draws_the_graph(tmp_path, capsys):
    out = tmp_path / "rag.dot"
    assert cli_main(["explain", "rag", "--model", "tiny-llama", "--agents", "2", "--graph", str(out)]) == 0
    _, kind, edges, _ = _graph_of(out.read_text())
    assert {"reader0", "reader1", "synthesizer"} <= set(kind) and ("reader0", "synthesizer") in edges["data"]
    assert f"wrote {out}" in capsys.readouterr().out
    assert cli_main(["explain", "rag", "--model", "tiny-llama", "--graph", str(tmp_path / "rag.gif")]) == 2
    assert "--graph" in capsys.readouterr().err
