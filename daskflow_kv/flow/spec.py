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

from dataclasses import dataclass, field

from .. import validation
from ..errors import InvalidInputError, WorkflowError
from ..model.sampling import GREEDY, SamplingParams

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


@dataclass(slots=True)
class WorkflowSpec:
    name: str
    system: str = "You are a helpful assistant."
    contexts: dict[str, Context] = field(default_factory=dict)
    agents: dict[str, Agent] = field(default_factory=dict)

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
        reads = (reads,) if isinstance(reads, str) else tuple(reads)
        for r in reads:
            _as_workflow_error(validation.instance, f"{who} reads", r, str)
        self.agents[name] = Agent(name, instructions, reads, role, max_new_tokens, sampling, policy, merge, follows)
        return name

    def _new_name(self, name: str) -> None:
        if not isinstance(name, str):
            raise WorkflowError(f"names in workflow {self.name!r} must be strings, got {type(name).__name__} {name!r}")
        if not name or name in self.contexts or name in self.agents:
            raise WorkflowError(f"name {name!r} is empty or already used in workflow {self.name!r}")


def _as_workflow_error(check, *args):
    """A ``validation`` check whose failure is reported as what it is here: a malformed workflow."""
    try:
        return check(*args)
    except InvalidInputError as e:
        raise WorkflowError(str(e)) from None
