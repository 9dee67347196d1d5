"""Draw the stateful graph G_s with graphviz, as ``dask.visualize`` draws a task graph.

Nodes: contexts (notes), agents (rounded boxes), tools (components), steps decided at run
time (hexagons: what a loop, best-of-n or ReAct step settled on, the agents and tools it
added drawn as the run took them, its decisions in a note) and the KV operators the compiler inserts
per level (materialize: a 3-D box, drawn doubled where it merges several upstream states;
fork; resume: an ellipse), each level in its own frame. Edges: data edges (what an agent
reads), state edges (how KV state flows between operators, bold) and a dashed edge from
each resume to the agent it serves. Given a run's result, agents and resumes say where
they ran, the plan (reuse / transfer / recompute / text), what they reused and computed,
their TTFT and, for a comparison, whether state mode agreed with text mode.

Every node has a plain id (``ctx0``, ``agent3``, ``state5``: names can hold ``:``, which
DOT reads as a port) and an HTML label, so user text is escaped once, with ``html.escape``.
Each element carries its kind as its SVG ``class``.

``format="dot"`` writes the DOT source and needs only the ``graphviz`` package; svg, png,
pdf and jpeg need Graphviz's ``dot`` program, and its absence is one line, raised before
anything is drawn.
"""

from __future__ import annotations

import os
import shutil
from html import escape

from dask.utils import format_bytes

from .. import validation
from ..errors import DaskflowKVError

FORMATS = ("svg", "png", "pdf", "jpeg", "jpg", "dot")
SHAPES = {"context": "note", "agent": "box", "materialize": "box3d", "fork": "invhouse", "resume": "ellipse",
          "tool": "component", "step": "hexagon", "taken": "note"}
MAX_TAKEN_LINES = 40  # run-time decisions drawn in the graph's note (explain() has them all)
PLAN_COLOURS = {"reuse": "#c7e9c0", "transfer": "#fdd0a2", "recompute": "#fcbba1", "text": "#e0e0e0"}
DATA, STATE, SERVES = "data", "state", "serves"  # the edges' classes


class GraphvizNotFoundError(DaskflowKVError, RuntimeError):
    """Graphviz's ``dot`` program, which renders svg/png/pdf/jpeg, is not on PATH."""


def _graphviz():
    try:
        import graphviz
    except ImportError:
        raise ImportError("drawing G_s needs the graphviz package: pip install 'daskflow-kv[viz]' "
                          "(svg/png also need Graphviz's dot program; format='dot' does not)") from None
    return graphviz


def _label(title: str, *lines: str) -> str:
    """An HTML-like label: the title bold, then smaller lines; all of it escaped."""
    rest = "".join(f'<br/><font point-size="9">{escape(line)}</font>' for line in lines if line)
    return f"<<b>{escape(title)}</b>{rest}>"


def _run_of(result):
    """(the state-mode or only run, agreement per agent or None) of a WorkflowResult or Comparison."""
    if result is None:
        return None, None
    if hasattr(result, "agreement"):
        return result.state, result.agreement
    return result, None


def _run_lines(a, agree) -> list[str]:
    lines = [f"ran on {a.worker}", f"{a.decision}: {a.tokens_reused} reused, {a.tokens_computed} computed"]
    if a.tokens_recomputed:
        lines.append(f"{a.tokens_recomputed} prefix tokens rebuilt there")
    if a.bytes_transferred:
        lines.append(f"{format_bytes(a.bytes_transferred)} moved")
    lines.append(f"TTFT {a.ttft_s:.3f} s")
    if agree is not None:
        lines.append("same tokens as text mode" if agree.get(a.name) else "DIFFERS from text mode")
    return lines


def _merged(cw, node) -> list[str]:
    """Upstream agents whose states a materialize combines (two or more: a merge)."""
    ups = [src.removeprefix("r:") for src, dst in cw.state_edges if dst == node.id and src.startswith("r:")]
    return ups if len(ups) > 1 else []


def to_graphviz(cw, result=None):
    """A ``graphviz.Digraph`` of ``cw``'s G_s (a ``CompiledWorkflow``), annotated with ``result``
    (a ``WorkflowResult`` or ``Comparison`` of a run of it) when given."""
    graphviz = _graphviz()
    wf = cw.workflow
    run, agree = _run_of(result)
    ran = run.agents if run is not None else {}
    ids = {("ctx", n): f"ctx{i}" for i, n in enumerate(wf.contexts)}
    ids |= {("agent", n): f"agent{i}" for i, n in enumerate(wf.agents)}
    ids |= {("state", node.id): f"state{i}" for i, node in enumerate(cw.state_nodes)}
    ids |= {("tool", n): f"tool{i}" for i, n in enumerate(wf.tools)}
    ids |= {("step", n): f"step{i}" for i, n in enumerate(wf.steps)}
    g = graphviz.Digraph("G_s")
    g.attr(rankdir="TB", labelloc="t", fontname="Helvetica", label=_label(f"workflow {wf.name}",
           f"{len(wf.contexts)} contexts, {len(wf.agents)} agents, {len(cw.levels)} levels"))
    g.attr("node", fontname="Helvetica", fontsize="10", style="filled", fillcolor="white")
    g.attr("edge", fontname="Helvetica", fontsize="9")
    with g.subgraph() as top:  # the documents on top, above every level
        top.attr(rank="source")
        for c in wf.contexts.values():
            top.node(ids["ctx", c.name], _label(c.name, "context", f"{len(c.text):,} chars"), shape=SHAPES["context"],
                     **{"class": "context"})
    for lvl, names in enumerate(cw.levels):
        with g.subgraph(name=f"cluster_level{lvl}") as sub:
            sub.attr(label=f"level {lvl}", style="rounded,dashed", color="#9d9d9d")
            for name in names:
                a = wf.agents[name]
                lines = [f"agent, up to {a.max_new_tokens} new tokens"]
                lines += _run_lines(ran[name], agree) if name in ran else []
                colour = PLAN_COLOURS.get(ran[name].decision, "white") if name in ran else "white"
                if agree is not None and not agree.get(name, True):
                    colour = "#ff9896"
                sub.node(ids["agent", name], _label(name, *lines), shape=SHAPES["agent"], style="rounded,filled",
                         fillcolor=colour, **{"class": "agent"})
            for node in (n for n in cw.state_nodes if n.level == lvl):
                _state_node(sub, ids["state", node.id], node, cw, wf, ran)
    _operators(g, ids, wf, cw, run)
    for src, dst in cw.data_edges:
        tail = ids.get(("ctx", src)) or ids.get(("tool", src)) or ids.get(("step", src)) or ids["agent", src]
        g.edge(tail, ids.get(("tool", dst)) or ids["agent", dst], color="#7f7f7f", **{"class": DATA})
    for src, dst in cw.state_edges:
        g.edge(ids["state", src], ids["state", dst], color="#1f77b4", penwidth="2", **{"class": STATE})
    for node in cw.state_nodes:
        if node.kind == "resume":
            g.edge(ids["state", node.id], ids["agent", node.agents[0]], style="dashed", color="#1f77b4",
                   arrowhead="none", **{"class": SERVES})
    return g


def _operators(g, ids, wf, cw, run) -> None:
    """Tools (with where and how long each ran, given a run), steps, and the run's decisions."""
    ran_tools = getattr(run, "tools", None) or {}
    for t in wf.tools.values():
        lines = [t.kind + (f", needs {t.resources}" if t.resources else "")]
        if t.name in ran_tools:
            r = ran_tools[t.name]
            lines.append(f"ran on {r['worker']}, {r['seconds']:.3f} s")
        g.node(ids["tool", t.name], _label(t.name, *lines), shape=SHAPES["tool"], fillcolor="#dadaeb",
               **{"class": "tool"})
    for st in wf.steps.values():
        g.node(ids["step", st.name], _label(st.name, f"{st.kind} step, decided at run time"), shape=SHAPES["step"],
               fillcolor="#fdd0a2", **{"class": "step"})
    for name, step in cw.owners.items():
        g.edge(ids["step", step], ids.get(("tool", name)) or ids["agent", name], style="dotted", color="#e6550d",
               arrowhead="none", **{"class": "adds"})
    if cw.taken:
        lines = cw.taken[:MAX_TAKEN_LINES] + ([f"... {len(cw.taken) - MAX_TAKEN_LINES} more"]
                                              if len(cw.taken) > MAX_TAKEN_LINES else [])
        g.node("taken", _label("decided at run time", *lines), shape=SHAPES["taken"], **{"class": "taken"})


def _state_node(g, node_id: str, node, cw, wf, ran) -> None:
    lines = [f"{node.kind}, {node.tokens} tok" + (" (estimated)" if node.estimated else "")]
    classes, extra = [node.kind], {}
    merged = _merged(cw, node) if node.kind == "materialize" else []
    if merged:
        how = sorted({"text" if wf.agents[m].merge == "auto" else wf.agents[m].merge for m in node.agents})
        lines.append(f"merges {', '.join(merged)} ({'/'.join(how)})")
        classes.append("merge")
        extra["peripheries"] = "2"
    elif node.kind != "resume":
        lines.append(f"for {', '.join(node.agents)}")
    fill = "white"
    if node.kind == "resume" and node.agents[0] in ran:
        a = ran[node.agents[0]]
        lines.append(f"{a.decision} on {a.worker}")
        fill = PLAN_COLOURS.get(a.decision, "white")
    g.node(node_id, _label(node.id, *lines), shape=SHAPES[node.kind], fillcolor=fill,
           **{"class": " ".join(classes)}, **extra)


def _target(filename: str | None, format: str) -> tuple[str | None, str]:
    """(the file to write or None, the format): an extension on ``filename`` wins over ``format``,
    as in ``dask.visualize``; without one, ``.<format>`` is added."""
    if filename is not None:
        filename = os.fspath(filename)
        stem, ext = os.path.splitext(filename)
        if ext.lower().lstrip(".") in FORMATS:
            return filename, validation.choice("format", ext.lower().lstrip("."), FORMATS)
        return f"{filename}.{validation.choice('format', format, FORMATS)}", format
    return None, validation.choice("format", format, FORMATS)


def require_renderer(format: str) -> None:
    """Raise ``GraphvizNotFoundError`` (one line) when ``format`` needs ``dot`` and there is none."""
    _graphviz()
    if format != "dot" and shutil.which("dot") is None:
        raise GraphvizNotFoundError(
            f"drawing {format} needs Graphviz's `dot` program, which is not on PATH: install Graphviz "
            f"(apt install graphviz, brew install graphviz, conda install graphviz), or ask for the DOT source "
            f"(format='dot', a .dot file), which needs no program")


def _display(format: str, data: bytes | None = None, filename: str | None = None):
    """What ``dask.visualize`` returns: an IPython SVG/Image when IPython is there, else the
    bytes (no filename) or None."""
    try:
        from IPython import display
    except ImportError:
        return data
    if format == "svg":
        return display.SVG(data=data, filename=filename)
    if format in ("png", "jpeg", "jpg"):
        return display.Image(data=data, filename=filename, format=format)
    return data  # pdf: nothing IPython shows inline


def render(graph, filename: str | None = None, format: str = "svg"):
    """Write or return ``graph`` drawn in ``format``.

    ``format="dot"``: the DOT source (a str), written to ``filename`` when given; no Graphviz
    program needed. Otherwise the drawing, through ``dot``: written to ``filename`` when given
    (an IPython object for it is returned when IPython is there), returned as an IPython
    SVG/Image (or the bytes without IPython) when not.
    """
    path, format = _target(filename, format)
    require_renderer(format)  # a bad format or a missing program: one line before dot runs
    if format == "dot":
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(graph.source)
        return graph.source
    data = graph.pipe(format=format)
    if path is None:
        return _display(format, data=data)
    with open(path, "wb") as f:
        f.write(data)
    return _display(format, filename=path)


def visualize(cw, filename: str | None = None, format: str = "svg", result=None):
    """``CompiledWorkflow.visualize`` / ``Workflow.visualize``: see ``to_graphviz`` and ``render``."""
    return render(to_graphviz(cw, result), filename, format)
