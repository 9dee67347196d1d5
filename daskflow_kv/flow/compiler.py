"""Compile a workflow into the stateful graph G_s = (V, E_data, E_state) and check it.

Compile time catches bad specs (unknown names, cycles, impossible concat merges, prompts
over the model's context) and orders agents into levels: an agent runs once everything it
reads exists. Inside a level, agents whose prompts share a token prefix form a group: the
prefix is materialized once, forked to the members, and each member resumes with its own
suffix. Prompts that depend on upstream outputs are only known at run time, so groups are
found per level as the run reaches it (``level_groups``, the same function here and in
the executor); at compile time those prompts are estimated with placeholder outputs of the
upstream agents' maximum length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..state.blocks import common_prefix_len
from ..errors import ContextTooLongError, WorkflowError
from .prompts import prompt_tokens
from .spec import WorkflowSpec


@dataclass(frozen=True, slots=True)
class Group:
    members: tuple[str, ...]  # agents sharing the prefix, in declaration order
    prefix_len: int  # tokens they all start with (each keeps >= 1 token of its own)


def group_by_prefix(prompts: Mapping[str, Sequence[int]], min_shared: int) -> list[Group]:
    """Partition agents into groups whose prompts share >= ``min_shared`` leading tokens.

    Greedy over prompts in sorted token order (neighbours share the longest prefixes): an
    agent joins the current group while the group's common prefix stays >= min_shared.
    A lone agent is a group of one with prefix_len = len(prompt) - 1.
    """
    order = sorted(prompts, key=lambda a: (list(prompts[a]), a))
    groups: list[list[str]] = []
    lcp: list[int] = []
    for name in order:
        if groups:
            shared = min(lcp[-1], common_prefix_len(prompts[groups[-1][0]], prompts[name]))
            if shared >= min_shared:
                groups[-1].append(name)
                lcp[-1] = shared
                continue
        groups.append([name])
        lcp.append(len(prompts[name]))
    out = []
    for members, shared in zip(groups, lcp):
        shortest = min(len(prompts[m]) for m in members)
        out.append(Group(tuple(sorted(members, key=list(prompts).index)), min(shared, shortest - 1)))
    return out


def level_groups(wf: WorkflowSpec, prompts: Mapping[str, Sequence[int]], min_shared: int) -> list[Group]:
    """``group_by_prefix`` within each set of agents that continue the same conversation
    (``follows`` the same agent; the agents that follow none are one set). A continuation
    grouped with others on a shorter shared prefix - the system prompt and a document - would
    prefill again the conversation its state already holds; its siblings share all of it."""
    parts: dict[str | None, dict[str, Sequence[int]]] = {}
    for name, toks in prompts.items():
        parts.setdefault(wf.agents[name].follows, {})[name] = toks
    return [g for part in parts.values() for g in group_by_prefix(part, min_shared)]


@dataclass(slots=True)
class StateNode:
    id: str  # "m0", "f0", "r:agent" ...
    kind: str  # materialize | fork | resume
    tokens: int  # tokens this node covers (prefix length, or the agent's suffix)
    agents: tuple[str, ...]  # agents served
    level: int
    estimated: bool = False  # prompt built with placeholder upstream outputs


@dataclass(slots=True)
class CompiledWorkflow:
    workflow: WorkflowSpec
    levels: list[list[str]]  # agents by topological level
    data_edges: list[tuple[str, str]]  # (source context/agent, reader agent)
    state_nodes: list[StateNode] = field(default_factory=list)
    state_edges: list[tuple[str, str]] = field(default_factory=list)  # (producer node, consumer node)
    block_size: int = 64
    taken: list[str] = field(default_factory=list)  # a growing run's decisions, in order (``flow.growing``)
    owners: dict[str, str] = field(default_factory=dict)  # agent or tool a step added -> that step

    def visualize(self, filename: str | None = None, format: str = "svg", result=None):
        """Draw G_s with graphviz, as ``dask.visualize`` draws a task graph (``flow.visualize``).

        ``filename``: where to write it (its extension, if any, chooses the format); None
        returns the drawing (an IPython SVG/Image in a notebook). ``format``: svg, png, pdf,
        jpeg, or dot (the DOT source: the only one that needs no Graphviz ``dot`` program).
        ``result``: a ``WorkflowResult`` or ``Comparison`` of a run of this graph, to show
        where each agent ran, its plan and what it reused (a run keeps the groups it found in
        ``result.graph``; ``Workflow.visualize(result=...)`` draws that one).
        """
        from .visualize import visualize

        return visualize(self, filename, format, result)

    def explain(self) -> str:
        wf = self.workflow
        lines = [f"workflow {wf.name}: {len(wf.contexts)} contexts, {len(wf.agents)} agents, {len(self.levels)} levels"
                 + (f", {len(wf.tools)} tools" if wf.tools else "") + (f", {len(wf.steps)} steps" if wf.steps else "")]
        lines.append("data edges: " + ", ".join(f"{a}->{b}" for a, b in self.data_edges))
        for lvl, names in enumerate(self.levels):
            lines.append(f"level {lvl}: {', '.join(names)}")
            for node in (n for n in self.state_nodes if n.level == lvl):
                est = " (estimated: upstream outputs unknown until run time)" if node.estimated else ""
                lines.append(f"  {node.id:<14} {node.kind:<11} {node.tokens:>6} tok  {','.join(node.agents)}{est}")
        lines.append("state edges: " + ", ".join(f"{a}->{b}" for a, b in self.state_edges))
        if self.taken:
            lines.append("decided at run time:")
            lines += [f"  {line}" for line in self.taken]
        return "\n".join(lines)


def agent_levels(wf: WorkflowSpec) -> list[list[str]]:
    """The agents by topological level (declaration order inside one); a malformed spec
    (unknown name, cycle) raises ``WorkflowError``."""
    known = set(wf.contexts) | set(wf.agents) | set(wf.tools) | set(wf.steps)
    for agent in wf.agents.values():
        if agent.follows is not None and agent.follows not in wf.agents:
            raise WorkflowError(f"agent {agent.name!r} follows {agent.follows!r}, which is not an agent")
        for src in agent.reads:
            if src not in known:
                raise WorkflowError(
                    f"agent {agent.name!r} reads {src!r}, which is neither a context nor an agent "
                    f"(contexts: {sorted(wf.contexts)}; agents: {sorted(wf.agents)})"
                    + (f"; tools: {sorted(wf.tools)}" if wf.tools else "")
                    + (f"; steps: {sorted(wf.steps)}" if wf.steps else "")
                )
    for tool in wf.tools.values():
        for src in tool.reads + tool.after:
            if src not in known:
                raise WorkflowError(f"tool {tool.name!r} reads {src!r}, which is not in workflow {wf.name!r}")
    level: dict[str, int] = {}
    visiting: list[str] = []

    def visit(name: str) -> int:
        if name in level:
            return level[name]
        if name in visiting:
            cycle = visiting[visiting.index(name) :] + [name]
            raise WorkflowError(f"cycle in workflow {wf.name!r}: {' -> '.join(cycle)}")
        visiting.append(name)
        ups = [visit(src) + 1 for src in _upstream(wf, name)]
        visiting.pop()
        level[name] = max(ups, default=0)
        return level[name]

    for name in wf.agents:
        visit(name)
    out: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for name in wf.agents:  # declaration order inside a level
        out[level[name]].append(name)
    return out


def _upstream(wf: WorkflowSpec, name: str) -> list[str]:
    agent = wf.agents[name]
    return _agents_behind(wf, agent.reads, ()) + ([agent.follows] if agent.follows else [])


def _agents_behind(wf: WorkflowSpec, names, path: tuple[str, ...]) -> list[str]:
    """The agents among ``names``, and those behind the tools among them (what the tools read,
    transitively): a tool runs between its readers' level and theirs. Steps are decided at
    run time and count for nothing here."""
    out = []
    for src in names:
        if src in wf.agents:
            out.append(src)
        elif src in wf.tools:
            if src in path:
                cycle = path[path.index(src):] + (src,)
                raise WorkflowError(f"cycle in workflow {wf.name!r}: {' -> '.join(cycle)}")
            tool = wf.tools[src]
            out += _agents_behind(wf, tool.reads + tool.after, path + (src,))
    return out


def _ancestors(wf: WorkflowSpec, name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for src in _upstream(wf, todo.pop()):
            if src not in seen:
                seen.add(src)
                todo.append(src)
    return seen


def _outputs_in_prompt(wf: WorkflowSpec, name: str) -> set[str]:
    """Agents whose outputs an agent's prompt contains (its reads, and its follows chain's)."""
    agent = wf.agents[name]
    out = {r for r in agent.reads if r in wf.agents}
    if agent.follows:
        out |= {agent.follows} | _outputs_in_prompt(wf, agent.follows)
    return out


def _check_merges(wf: WorkflowSpec) -> None:
    """concat merges only along one chain: each read agent must descend from the previous."""
    for agent in wf.agents.values():
        ups = [r for r in agent.reads if r in wf.agents]
        if agent.merge != "concat" or len(ups) < 2:
            continue
        for prev, nxt in zip(ups, ups[1:]):
            if prev not in _ancestors(wf, nxt):
                raise WorkflowError(
                    f"agent {agent.name!r}: cannot concat-merge the states of {prev!r} and {nxt!r}: they are "
                    f"separate branches whose K/V never attended to each other; use merge='text'"
                )


def compile_workflow(wf: WorkflowSpec, tokenizer, max_positions: int, block_size: int) -> CompiledWorkflow:
    if not wf.agents and not wf.steps:
        raise WorkflowError(f"workflow {wf.name!r} has no agents")
    levels = agent_levels(wf)
    _check_merges(wf)
    cw = CompiledWorkflow(wf, levels, data_edges(wf), block_size=block_size)
    # upstream outputs (agents', tools', steps') are unknown until run time
    empty = {n: "" for n in (*wf.agents, *wf.tools, *wf.steps)}
    for lvl, names in enumerate(levels):
        prompts = {}
        for name in names:
            toks = prompt_tokens(wf, wf.agents[name], empty, tokenizer)
            # Upper bound: every upstream output that appears in the prompt at its maximum length.
            bound = len(toks) + sum(wf.agents[u].max_new_tokens for u in _outputs_in_prompt(wf, name))
            need = bound + wf.agents[name].max_new_tokens
            if need > max_positions:
                raise ContextTooLongError(
                    f"agent {name!r}: prompt of up to {bound} tokens + {wf.agents[name].max_new_tokens} to generate "
                    f"= {need} exceeds the model's {max_positions} positions"
                )
            prompts[name] = toks
        add_level_nodes(cw, lvl, prompts, estimated=lvl > 0)
    return cw


def data_edges(wf: WorkflowSpec) -> list[tuple[str, str]]:
    """(source, reader) for every agent's reads and follows and every tool's reads and after."""
    edges = [(src, a.name) for a in wf.agents.values() for src in a.reads + ((a.follows,) if a.follows else ())]
    return edges + [(src, t.name) for t in wf.tools.values() for src in t.reads + t.after]


def add_level_nodes(cw: CompiledWorkflow, lvl: int, prompts: Mapping[str, Sequence[int]], estimated: bool) -> None:
    """Materialize/fork/resume nodes for one level; state edges from upstream resumes."""
    old = {n.id for n in cw.state_nodes if n.level == lvl}  # run time replaces the estimate
    cw.state_nodes = [n for n in cw.state_nodes if n.level != lvl]
    cw.state_edges = [e for e in cw.state_edges if e[1] not in old]
    wf = cw.workflow
    for gi, group in enumerate(level_groups(wf, prompts, cw.block_size)):
        mid = f"m{lvl}.{gi}"
        cw.state_nodes.append(StateNode(mid, "materialize", group.prefix_len, group.members, lvl, estimated))
        for up in sorted({u for a in group.members for u in _upstream(wf, a)}):
            cw.state_edges.append((f"r:{up}", mid))  # an upstream state may hold part of the prefix
        if len(group.members) > 1:
            fid = f"f{lvl}.{gi}"
            cw.state_nodes.append(StateNode(fid, "fork", group.prefix_len, group.members, lvl, estimated))
            cw.state_edges.append((mid, fid))
            mid = fid
        for a in group.members:
            rid = f"r:{a}"
            suffix = len(prompts[a]) - group.prefix_len
            cw.state_nodes.append(StateNode(rid, "resume", suffix, (a,), lvl, estimated))
            cw.state_edges.append((mid, rid))
