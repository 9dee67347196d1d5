"""A multi-agent workflow as data: shared contexts, agents, and who reads what.

Reads like LangGraph/AutoGen: add contexts (documents, retrieved passages) and agents
(role, instructions, generation settings); an agent ``reads`` contexts and other agents,
whose outputs become part of its prompt. Nothing about KV state appears here: the
compiler finds which prompts share token prefixes and decides how state moves.

    wf = Workflow("review", system="You are a careful analyst.")
    doc = wf.context("report", report_text)
    a = wf.agent("optimist", "List the strengths.", reads=[doc])
    b = wf.agent("skeptic", "List the weaknesses.", reads=[doc])
    j = wf.agent("judge", "Weigh both views.", reads=[doc, a, b], merge="text")
    wf.agent("editor", "Shorten the verdict.", follows=j)  # a new turn of j's conversation
    result = wf.run(mode="both")

``WorkflowSpec`` is the description alone; ``flow.workflow.Workflow`` adds ``compile`` and
``run``, so the compiler and executor depend on the description and never on the API.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .. import validation
from ..errors import InvalidInputError, WorkflowError
from ..model.sampling import GREEDY, SamplingParams

TOOL_KINDS = ("tool", "retrieve", "memory")
STATE_POLICIES = ("auto", "transfer", "alias", "fork", "recompute", "pin", "evict")


@dataclass(frozen=True, slots=True)
class Context:
    name: str  # unique among contexts and agents
    text: str  # the document, passages or notes an agent may read
    title: str = ""  # how the prompt introduces it ("" = the name)


@dataclass(frozen=True, slots=True)
class Agent:
    name: str  # unique among contexts and agents
    instructions: str  # this agent's own task; always last in its prompt
    reads: tuple[str, ...] = ()  # contexts and agents whose text precede the instructions
    role: str = ""  # optional persona, placed before the instructions
    max_new_tokens: int = 48
    sampling: SamplingParams = GREEDY
    policy: str = "auto"  # state policy sigma for this agent's state edge
    merge: str = "auto"  # how outputs of several read agents combine: auto | text | concat
    follows: str | None = None  # continue this agent's conversation (its prompt + answer) in a new turn


@dataclass(frozen=True, slots=True)
class Tool:
    """An operator beside the agents: ``fn`` run as a Dask task, its output a context later
    agents read (``flow.operators``: tools, retrieval, memory; ``flow.tool_calls`` runs them)."""

    name: str  # unique among contexts, agents, tools and steps
    fn: Callable  # called as fn(*args, *texts of reads), on whatever worker fits
    reads: tuple[str, ...] = ()  # contexts, agents, tools or steps whose texts it is given, in order
    args: tuple = ()  # leading arguments (a ReAct call's argument); small and picklable
    after: tuple[str, ...] = ()  # run after these too, their outputs not passed (a memory read after its write)
    resources: Mapping[str, float] | None = None  # Dask worker resources it needs ({"search": 1})
    retries: int = 0  # Dask retries of a failed run
    render: Callable | None = None  # its return value -> text (None: str)
    kind: str = "tool"  # tool | retrieve | memory
    title: str = ""  # how an agent's prompt introduces its output ("" = the name)


@dataclass(slots=True)
class WorkflowSpec:
    name: str
    system: str = "You are a helpful assistant."
    contexts: dict[str, Context] = field(default_factory=dict)
    agents: dict[str, Agent] = field(default_factory=dict)
    tools: dict[str, Tool] = field(default_factory=dict)
    # parts of the graph decided at run time (``flow.steps.Step``): a loop, best-of-n, ReAct
    steps: dict[str, object] = field(default_factory=dict)

    # -- building -----------------------------------------------------------------------------
    def context(self, name: str, text: str, title: str = "") -> str:
        self._new_name(name)
        _as_workflow_error(validation.instance, f"context {name!r}: text", text, str)
        self.contexts[name] = Context(name, text, title)
        return name

    def agent(
        self,
        name: str,
        instructions: str,
        reads=(),
        role: str = "",
        max_new_tokens: int = 48,
        sampling: SamplingParams = GREEDY,
        policy: str = "auto",
        merge: str = "auto",
        follows: str | None = None,
    ) -> str:
        self._new_name(name)
        if policy not in STATE_POLICIES:
            raise WorkflowError(f"agent {name!r}: unknown state policy {policy!r}; expected one of {STATE_POLICIES}")
        if merge not in ("auto", "text", "concat"):
            raise WorkflowError(f"agent {name!r}: merge must be auto, text or concat, not {merge!r}")
        who = f"agent {name!r}:"
        max_new_tokens = _as_workflow_error(validation.max_new_tokens, f"{who} max_new_tokens", max_new_tokens)
        _as_workflow_error(validation.instance, f"{who} instructions", instructions, str)
        _as_workflow_error(validation.instance, f"{who} sampling", sampling, SamplingParams)
        if follows is not None:
            _as_workflow_error(validation.instance, f"{who} follows", follows, str)
        reads = name_tuple(who, "reads", reads)
        self.agents[name] = Agent(name, instructions, reads, role, max_new_tokens, sampling, policy, merge, follows)
        return name

    def tool(self, name: str, fn: Callable, reads=(), resources: Mapping[str, float] | None = None,
             retries: int = 0, render: Callable | None = None, title: str = "", args=(), after=(),
             kind: str = "tool") -> str:
        """``fn`` as a Dask task on any worker that has ``resources``, called with the texts of
        ``reads`` in order; its output (``render(value)``, else ``str``) is a context later
        agents read. A tool that raises fails the run, naming it (``ToolFailed``)."""
        self._new_name(name)
        who = f"tool {name!r}:"
        if not callable(fn):
            raise WorkflowError(f"{who} fn must be callable, got {type(fn).__name__}")
        if render is not None and not callable(render):
            raise WorkflowError(f"{who} render must be callable or None, got {type(render).__name__}")
        retries = _as_workflow_error(validation.integer, f"{who} retries", retries, 0, 10)
        _as_workflow_error(validation.choice, f"{who} kind", kind, TOOL_KINDS)
        if resources is not None:
            _as_workflow_error(validation.instance, f"{who} resources", resources, Mapping)
            for r, amount in resources.items():
                _as_workflow_error(validation.instance, f"{who} resource name", r, str)
                _as_workflow_error(validation.number, f"{who} resources[{r!r}]", amount, 0, 1 << 20)
            resources = dict(resources)
        reads, after = name_tuple(who, "reads", reads), name_tuple(who, "after", after)
        self.tools[name] = Tool(name, fn, reads, tuple(args), after, resources, retries, render, kind, title)
        return name

    def _new_name(self, name: str) -> None:
        if not isinstance(name, str):
            raise WorkflowError(f"names in workflow {self.name!r} must be strings, got {type(name).__name__} {name!r}")
        if not name or name in self.contexts or name in self.agents or name in self.tools or name in self.steps:
            raise WorkflowError(f"name {name!r} is empty or already used in workflow {self.name!r}")


def name_tuple(who: str, what: str, names) -> tuple[str, ...]:
    """A name or a sequence of names, as a tuple of strings."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for r in names:
        _as_workflow_error(validation.instance, f"{who} {what}", r, str)
    return names


def _as_workflow_error(check, *args):
    """A ``validation`` check whose failure is reported as what it is here: a malformed workflow."""
    try:
        return check(*args)
    except InvalidInputError as e:
        raise WorkflowError(str(e)) from None
