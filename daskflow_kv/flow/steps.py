"""Parts of a workflow decided at run time: run a step, look at its output, then decide.

A ``Step`` is a generator function ``plan(g)``: it adds agents and tools through ``g`` (a
``growing.Growth``: ``g.agent``, ``g.tool``, ``g.note``), ``yield``s the
names it must see finished and receives their outputs ({name: text}), and ``return``s its
own output - what agents that read the step see. Each run calls ``plan`` afresh, so
the same workflow runs again (and in state and text mode) from the beginning; the steps it
takes are added to that run's graph, which ``explain`` and ``visualize`` show.

Three plans ship here, as LangGraph's conditional edges and AutoGen's loops offer them:

loop      run a round, test its output with ``until``, run another (at most ``max_rounds``);
beam      expand every kept node ``width`` ways, score each candidate (a function of its
          text, or a scoring agent that continues its conversation), keep the best ``keep``,
          ``depth`` times; ``best_of`` is one such level: best k of n;
react     an agent proposes a tool call in a given format; the tool runs; the agent goes on
          in its own conversation (``follows``) with the observation appended, until it gives
          a final answer or ``max_steps``. ``propose`` may replace the parser (a predicate over
          the step and its output): the agent's tokens are generated either way.

Every choice depends only on the agents' outputs, so a state run and a text run whose
tokens agree take the same steps.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import WorkflowError


@dataclass(frozen=True, slots=True)
class Step:
    name: str  # unique among contexts, agents, tools and steps; readers see its output
    plan: Callable  # plan(g) -> generator (see the module docstring)
    reads: tuple[str, ...] = ()  # what must be finished before it starts
    kind: str = "step"  # loop | beam | react | step (a user's own plan)


@dataclass(frozen=True, slots=True)
class ToolCall:
    tool: str  # a tool name the agent was given
    arg: str  # its argument, as the agent wrote it


# -- parsing what a model wrote --------------------------------------------------------------------
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_FINAL = re.compile(r"final\s*answer\s*[:\-]", re.IGNORECASE)


def parse_action(text: str, tools: Sequence[str]) -> ToolCall | None:
    """The first call of one of ``tools`` in ``text``, in any of the forms small models write:
    ``Action: name[arg]``, ``name(arg)``, ``Action: name`` then ``Action Input: arg``; None
    when a final answer comes first or no known tool is called. Never raises."""
    if not isinstance(text, str) or not tools:
        return None
    final = _FINAL.search(text)
    names = "|".join(re.escape(t) for t in sorted(tools, key=len, reverse=True))
    forms = [
        re.compile(rf"\b({names})\s*\[([^\]\n]*)\]", re.IGNORECASE),
        re.compile(rf"\b({names})\s*\(([^)\n]*)\)", re.IGNORECASE),
        re.compile(rf"action\s*:\s*({names})\s*\n+\s*action\s*input\s*:\s*([^\n]*)", re.IGNORECASE),
    ]
    found = [m for form in forms if (m := form.search(text))]
    if not found:
        return None
    m = min(found, key=lambda m: m.start())
    if final is not None and final.start() < m.start():
        return None
    tool = next(t for t in tools if t.lower() == m.group(1).lower())
    return ToolCall(tool, m.group(2).strip().strip("\"'`").strip())


def final_answer(text: str) -> str:
    """What follows ``Final Answer:``, or the whole text when the agent wrote none."""
    m = _FINAL.search(text)
    return (text[m.end():] if m else text).strip()


def parse_score(text: str) -> float:
    """The first number in a scoring agent's output (0 when it wrote none): never raises."""
    m = _NUMBER.search(text or "")
    try:
        return float(m.group(0)) if m else 0.0
    except ValueError:
        return 0.0


# -- loop ------------------------------------------------------------------------------------------
def loop(name: str, body: Callable, until: Callable[[str], bool], max_rounds: int, reads=()) -> Step:
    """``body(g, round, last)`` adds round ``round``'s agents (``last``: the name the previous
    round was tested on, None at first) and returns the name to test; ``until(text)`` ends
    the loop. The step's output is the last tested output."""
    _positive(name, "max_rounds", max_rounds)

    def plan(g):
        last = None
        for r in range(max_rounds):
            check = body(g, r, last)
            outs = yield [check]
            last = check
            if until(outs[check]):
                g.note(f"{name}: round {r + 1}: until() held on {check}: stop")
                return outs[check]
            more = "max_rounds reached: stop" if r + 1 == max_rounds else "another round"
            g.note(f"{name}: round {r + 1}: until() did not hold on {check}: {more}")
        return outs[last]

    return Step(name, plan, tuple(reads), "loop")


# -- beam, best of n -------------------------------------------------------------------------------
def beam(name: str, expand: Callable, width: int, keep: int, depth: int, score: Callable[[str], float] | str,
         reads=(), score_tokens: int = 8) -> Step:
    """``expand(g, depth, parent, i)`` adds candidate ``i`` under ``parent`` (None at the
    root) and returns its name. ``score``: a function of a candidate's text, or the
    instructions of a scoring agent that continues the candidate's conversation (its first
    number is the score). Ties keep the earlier candidate. The step's output: the kept
    candidates' texts, best first, each under its name."""
    for what, v in (("width", width), ("keep", keep), ("depth", depth)):
        _positive(name, what, v)
    if not callable(score) and not (isinstance(score, str) and score.strip()):
        raise WorkflowError(f"step {name!r}: score must be a function of a text or a scoring agent's instructions")

    def plan(g):
        frontier: list[str | None] = [None]
        texts: dict[str, str] = {}
        for d in range(depth):
            cands = [expand(g, d, parent, i) for parent in frontier for i in range(width)]
            texts.update((yield cands))
            if callable(score):
                scores = [float(score(texts[c])) for c in cands]
            else:
                scorers = [g.agent(f"{name}.score.{c}", score, follows=c, max_new_tokens=score_tokens) for c in cands]
                judged = yield cands + scorers  # the candidates stay held until they are ranked
                scores = [parse_score(judged[s]) for s in scorers]
            ranked = sorted(range(len(cands)), key=lambda i: (-scores[i], i))
            frontier = [cands[i] for i in ranked[:keep]]  # the others' states go: nothing continues them
            g.note(f"{name}: depth {d + 1}: kept {', '.join(frontier)} of {len(cands)} "
                   f"(scores {', '.join(f'{c}={scores[i]:g}' for i, c in enumerate(cands))})")
        return "\n\n".join(f"[{c}] {texts[c].strip()}" for c in frontier)

    return Step(name, plan, tuple(reads), "beam")


def best_of(name: str, candidate: Callable, n: int, score: Callable[[str], float] | str, keep: int = 1,
            reads=(), score_tokens: int = 8) -> Step:
    """The best ``keep`` of ``n`` candidates; ``candidate(g, i)`` adds candidate ``i``."""
    return beam(name, lambda g, d, parent, i: candidate(g, i), n, keep, 1, score, reads, score_tokens)


# -- ReAct -----------------------------------------------------------------------------------------
REACT_FORMAT = ("You can call a tool by writing one line `Action: tool[input]`; its result comes back as an "
                "observation. When you know the answer, write `Final Answer: ...`. Tools: {tools}.")


def react(name: str, instructions: str, tools: Mapping[str, Callable], reads=(), max_steps: int = 4,
          propose: Callable[[int, str], ToolCall | None] | None = None, max_new_tokens: int = 48, role: str = "",
          tool_options: Mapping | None = None) -> Step:
    """An agent that calls ``tools`` (name -> function of the call's argument) and continues
    its own conversation with each result, at most ``max_steps`` turns. ``propose(step,
    text)``: which call the agent's ``text`` makes (default: ``parse_action``).
    ``tool_options``: ``Workflow.tool`` keywords for every call (resources, retries, render).
    The step's output is the final answer."""
    _positive(name, "max_steps", max_steps)
    if not tools or not all(isinstance(t, str) and callable(fn) for t, fn in tools.items()):
        raise WorkflowError(f"step {name!r}: tools must map names to functions")
    tools = dict(tools)
    options = dict(tool_options or {})
    task = f"{instructions.strip()}\n{REACT_FORMAT.format(tools=', '.join(tools))}"
    choose = propose or (lambda step, text: parse_action(text, list(tools)))

    def plan(g):
        agent = g.agent(f"{name}.0", task, reads=tuple(reads), role=role, max_new_tokens=max_new_tokens)
        for k in range(max_steps):
            text = (yield [agent])[agent]
            call = choose(k, text)
            if call is not None and call.tool not in tools:
                raise WorkflowError(f"step {name!r}: propose() chose {call.tool!r}, not one of {sorted(tools)}")
            if call is None or k + 1 == max_steps:
                g.note(f"{name}: step {k + 1}: " + ("final answer" if call is None else "max_steps reached: stop"))
                return final_answer(text)
            observed = g.tool(f"{name}.t{k}", tools[call.tool], args=(call.arg,),
                              title=f"Observation: {call.tool}[{call.arg}]", **options)
            g.note(f"{name}: step {k + 1}: calls {call.tool}[{call.arg}] as {observed}")
            agent = g.agent(f"{name}.{k + 1}", "Continue from the observation.", follows=agent, reads=(observed,),
                            max_new_tokens=max_new_tokens)
        return final_answer(text)  # not reached: the last step returns above

    return Step(name, plan, tuple(reads), "react")


def _positive(name: str, what: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise WorkflowError(f"step {name!r}: {what} must be an integer in [1, 1000], got {value!r}")
