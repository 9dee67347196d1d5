"""Notebook HTML for a workflow, a run's result and a state-vs-text comparison.

``Workflow._repr_html_``, ``WorkflowResult._repr_html_`` and ``Comparison._repr_html_``
call these. They read the objects duck-typed (this module imports nothing else from
``flow``: the compiler and executor import it, not the other way round) and escape every
piece of user text - agent and context names, instructions, outputs - before it reaches
the page.
"""

from __future__ import annotations

from html import escape

from ..runtime.html_repr import box, clip, facts_table, html_table

AGREE = '<span style="color: #2ca02c;">yes</span>'
DISAGREE = '<span style="color: #d62728; font-weight: bold;">NO</span>'


def _names(names) -> str:
    return escape(", ".join(names)) if names else "-"


def workflow_html(wf, levels: list[list[str]] | None, problem: str = "") -> str:
    """``levels``: the agents by level (None when the spec does not compile: ``problem`` says why)."""
    level_of = {a: i for i, names in enumerate(levels or []) for a in names}
    sub = (f"{len(wf.contexts)} contexts · {len(wf.agents)} agents · "
           + (f"{len(levels)} levels" if levels is not None else f"does not compile: {problem}"))
    ctx_rows = [[escape(c.name), escape(c.title or "-"), f"{len(c.text):,}", clip(c.text, 60)]
                for c in wf.contexts.values()]
    agent_rows = [[escape(a.name), escape(str(level_of.get(a.name, "?"))), _names(a.reads), escape(a.follows or "-"),
                   escape(a.merge), escape(a.policy), str(a.max_new_tokens), clip(a.instructions, 60)]
                  for a in wf.agents.values()]
    body = facts_table([("System", clip(wf.system, 60))])
    if ctx_rows:
        body += html_table(["context", "title", "chars", "text"], ctx_rows)
    if agent_rows:
        body += html_table(["agent", "level", "reads", "follows", "merge", "policy", "max new", "instructions"],
                           agent_rows)
    tools, steps = getattr(wf, "tools", {}), getattr(wf, "steps", {})
    if tools:
        body += html_table(["tool", "kind", "reads", "resources", "retries"],
                           [[escape(t.name), escape(t.kind), _names(t.reads), escape(str(t.resources or "-")),
                             str(t.retries)] for t in tools.values()])
    if steps:
        body += html_table(["step (decided at run time)", "kind", "reads"],
                           [[escape(st.name), escape(st.kind), _names(st.reads)] for st in steps.values()])
    return box(f"Workflow {wf.name}", sub, body)


def _tokens_prefilled(run) -> int:
    return sum(run.level_tokens_computed)


def result_html(run) -> str:
    """A ``WorkflowResult``: per agent where it ran, the plan, reuse and timings."""
    rows = [[escape(a.name), str(a.level), escape(a.worker or "-"), escape(a.decision or "-"),
             f"{a.tokens_reused:,}", f"{a.tokens_computed:,}", f"{a.ttft_s:.3f} s", f"{a.prefill_s:.3f} s",
             f"{a.decode_s:.3f} s", clip(a.text, 60)]
            for a in run.agents.values()]
    facts = facts_table([("Wall", escape(f"{run.wall_s:.2f} s")),
                         ("Tokens prefilled", escape(f"{_tokens_prefilled(run):,}")),
                         ("Tokens generated", escape(f"{run.generated_tokens:,}")),
                         ("Agents", escape(str(len(run.agents))))])
    table = html_table(["agent", "level", "worker", "plan", "reused", "computed", "TTFT", "prefill", "decode",
                        "output"], rows)
    return box(f"WorkflowResult {run.workflow}", f"{run.mode} mode", facts + table)


def comparison_html(cmp) -> str:
    """A ``Comparison``: state mode against text mode, agent by agent, agreement first."""
    s, t = cmp.state, cmp.text
    agree = cmp.agreement
    rows = [[escape(n), str(a.level), escape(a.worker or "-"), escape(a.decision or "-"), f"{a.tokens_reused:,}",
             f"{a.tokens_computed:,}", f"{a.ttft_s:.3f} s", f"{t.agents[n].ttft_s:.3f} s",
             AGREE if agree[n] else DISAGREE, clip(a.text, 50)]
            for n, a in s.agents.items()]
    ratio = t.wall_s / max(s.wall_s, 1e-9)
    facts = facts_table([
        ("Agreement", escape(f"{sum(agree.values())}/{len(agree)} agents identical")),
        ("Wall", escape(f"state {s.wall_s:.2f} s · text {t.wall_s:.2f} s ({ratio:.2f}x)")),
        ("Tokens prefilled", escape(f"state {_tokens_prefilled(s):,} · text {_tokens_prefilled(t):,}")),
        ("Tokens generated", escape(f"{s.generated_tokens:,}")),
    ])
    table = html_table(["agent", "level", "worker", "plan", "reused", "computed", "TTFT state", "TTFT text",
                        "agree", "output (state)"], rows)
    colour = "#c7e9c0" if cmp.all_agree else "#fcbba1"
    return box(f"Comparison {s.workflow}", "state mode vs text mode", facts + table, colour=colour)
