"""A run whose graph grows: tools in flight beside the agents, steps that decide what comes next.

The executor runs agents level by level; for a workflow with tools or steps it asks a
``GrowingRun`` for each next level instead of reading compiled ones:

* ``next_level`` starts the steps whose inputs exist (``steps.Step``: their plans add
  agents and tools), submits every tool whose inputs exist (``tool_calls``: a Dask task,
  so it runs while agents run), and returns the agents that can run now - everything they
  read and follow has finished. With none ready it waits for a tool to return (waking for
  the prefetches ``kv_wait`` scheduled), and when nothing is left, returns None.
* ``after_level`` records the level's agents, resumes the plans that waited for them,
  lets go of the states nothing will continue (a state is held while an agent yet to run
  follows it, or while its step still waits on it), and for each conversation now waiting
  on a tool has ``kv_wait`` keep, spill or drop its KV.

A tool that raises stops only what depends on it: the rest runs to its end, then
``failure`` names the tool (its exception as the cause). Every added agent, tool and
decision lands in the run's own copy of the workflow and in ``CompiledWorkflow.taken``,
so ``explain`` and ``visualize`` show the steps as they were taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from ..errors import ToolFailed, WorkflowError
from .compiler import CompiledWorkflow, compile_workflow, data_edges
from .kv_wait import KVWait
from .steps import Step
from .tool_calls import HISTORY, ToolCalls, ToolOutput, history_key


def grows(wf) -> bool:
    """Whether ``wf`` needs a growing run (it has tools or steps)."""
    return bool(wf.tools or wf.steps)


def for_run(wf, rt, mode: str, wait_forced: str | None = None) -> tuple[CompiledWorkflow, GrowingRun]:
    """A run of ``wf`` in ``mode`` (state | text | local) on ``rt``: its graph, compiled from
    its own copy of the workflow (the steps it takes are added there), and its growing run.
    ``wait_forced``: keep, spill or drop every waiting conversation's KV (state mode; None:
    the cost model decides). A tool no worker has the resources for fails here, first."""
    own = replace(wf, contexts=dict(wf.contexts), agents=dict(wf.agents), tools=dict(wf.tools), steps=dict(wf.steps))
    cw = compile_workflow(own, rt.tokenizer, rt.facts.max_positions, rt.block_size)
    calls = ToolCalls(rt.client, rt.spec.namespace, rt.key_digest)
    for tool in own.tools.values():
        calls.check(tool)
    if mode == "state":
        return cw, GrowingRun(cw, calls, KVWait(rt, wait_forced), rt.release)
    return cw, GrowingRun(cw, calls)


class Growth:
    """What a step's plan adds to: its run's workflow, checked as the plan adds."""

    __slots__ = ("_run", "_step")

    def __init__(self, run: GrowingRun, step: str):
        self._run = run  # the run it grows
        self._step = step  # the step adding

    def agent(self, name: str, instructions: str, reads=(), follows: str | None = None, **settings) -> str:
        """``Workflow.agent`` at run time: what it reads and follows must exist already."""
        reads = (reads,) if isinstance(reads, str) else tuple(reads)
        self._run.check_known(self._step, name, reads + ((follows,) if follows else ()))
        self._run.spec.agent(name, instructions, reads=reads, follows=follows, **settings)
        self._run.owner[name] = self._step
        return name

    def tool(self, name: str, fn: Callable, reads=(), **options) -> str:
        """``Workflow.tool`` at run time; it is submitted as soon as what it reads exists."""
        reads = (reads,) if isinstance(reads, str) else tuple(reads)
        self._run.check_known(self._step, name, reads + tuple(options.get("after", ())))
        self._run.spec.tool(name, fn, reads=reads, **options)
        self._run.owner[name] = self._step
        return name

    def note(self, text: str) -> None:
        """A line of the run's ``explain``: what the step decided, and why."""
        self._run.cw.taken.append(str(text))


class GrowingRun:
    """One run of a growing workflow, in one mode (its own copy of the spec, its own plans)."""

    def __init__(self, cw: CompiledWorkflow, calls: ToolCalls, wait=None, release: Callable | None = None):
        self.cw = cw  # the run's graph: its workflow is this run's own copy, grown in place
        self.calls = calls  # tool calls in flight
        self.wait = wait  # state mode: the KV of conversations waiting on tools (``kv_wait.KVWait``)
        self.release = release  # lets go of a held state (state mode)
        self.done: set[str] = set(cw.workflow.contexts)  # names whose output exists
        self.ran: set[str] = set()  # agents handed to a level
        self.owner = cw.owners  # agent or tool -> the step that added it
        self.plans: dict[str, object] = {}  # step -> its running plan (a generator)
        self.awaiting: dict[str, tuple[str, ...]] = {}  # step -> the names its plan waits for
        self.failed: dict[str, BaseException] = {}  # tool -> its error, in the order they failed
        self.tool_results: dict[str, dict] = {}  # tool -> {"text", "seconds", "worker", "waited_s"}
        self._waited: set[tuple[str, str]] = set()  # (conversation, tool) pairs already decided
        self.held: dict | None = None  # the executor's held states (state mode), where prefetches land
        cw.levels = []  # the levels as they are taken

    @property
    def spec(self):
        return self.cw.workflow

    def check_known(self, step: str, name: str, refs) -> None:
        known = self.done | set(self.spec.agents) | set(self.spec.tools) | set(self.spec.steps)
        missing = [r for r in refs if r not in known]
        if missing:
            raise WorkflowError(f"step {step!r} adds {name!r}, which refers to {missing}: "
                                "nothing of that name exists yet")

    # -- what runs next -------------------------------------------------------------------------
    def next_level(self, outputs: dict) -> list[str] | None:
        """The agents that can run now; None when nothing is left (or all that is depends on a
        failed tool). Waits for tool calls while no agent can run."""
        while True:
            self._advance(outputs)
            ready = [a for a, ag in self.spec.agents.items() if a not in self.ran
                     and all(r in self.done for r in ag.reads) and (ag.follows is None or ag.follows in self.done)]
            if ready:
                self.ran.update(ready)
                return ready
            if not self.calls.pending:
                self._check_finished()
                return None
            due = self.wait.next_due() if self.wait is not None else None
            self._record(self.calls.finished(None if due is None else max(0.0, due - time.time())), outputs)

    def _advance(self, outputs: dict) -> None:
        """Start and resume every plan that can go on; submit every tool that can run."""
        self._record(self.calls.finished(0), outputs)
        moved = True
        while moved:
            moved = False
            for name, step in list(self.spec.steps.items()):
                if name not in self.plans and name not in self.done and all(r in self.done for r in step.reads):
                    self.plans[name] = step.plan(Growth(self, name))
                    self._resume(name, step, None, outputs)
                    moved = True
                elif name in self.awaiting and all(n in self.done for n in self.awaiting[name]):
                    got = {n: self._text(n, outputs) for n in self.awaiting.pop(name)}
                    self._resume(name, step, got, outputs)
                    moved = True
        for name, tool in self.spec.tools.items():
            if name not in self.calls.submitted_at and all(r in self.done for r in tool.reads + tool.after):
                self.calls.submit(tool, [self._text(r, outputs) for r in tool.reads])

    def _text(self, name: str, outputs: dict) -> str:
        """What a tool reads of ``name``: a context's text, or an agent's, tool's or step's output."""
        ctx = self.spec.contexts.get(name)
        return ctx.text if ctx is not None else outputs[name]

    def _resume(self, name: str, step: Step, got: dict | None, outputs: dict) -> None:
        plan = self.plans[name]
        try:
            wanted = next(plan) if got is None else plan.send(got)
        except StopIteration as stop:
            out = stop.value
            outputs[name] = out if isinstance(out, str) else "" if out is None else str(out)
            self.done.add(name)
            del self.plans[name]
            return
        wanted = (wanted,) if isinstance(wanted, str) else tuple(wanted or ())
        self.check_known(name, f"a wait for {list(wanted)}", wanted)
        self.awaiting[name] = wanted

    def _record(self, finished, outputs: dict) -> None:
        for name, out, err in finished:
            if self.wait is not None:
                self.wait.tool_done(name)
            if err is not None:
                self.failed[name] = err
                self.cw.taken.append(f"tool {name} failed: {type(err).__name__}: {err}")
                continue
            out: ToolOutput
            tool = self.spec.tools[name]
            HISTORY.record(history_key(tool), out.seconds)
            outputs[name] = out.text
            self.done.add(name)
            self.tool_results[name] = {"text": out.text, "seconds": out.seconds, "worker": out.worker,
                                       "waited_s": time.time() - self.calls.submitted_at[name]}
        if self.wait is not None:
            self.wait.prefetch_due()
            if self.held is not None:
                self.wait.collect(self.held)

    # -- after a level --------------------------------------------------------------------------
    def after_level(self, names, outputs: dict, states: dict | None) -> None:
        self.done.update(names)
        self.held = states
        self._advance(outputs)  # collects the read-back states too: the rule below sees them
        if states is None:
            return
        followed = {a.follows for a in self.spec.agents.values() if a.follows and a.name not in self.ran}
        awaited = {n for names_ in self.awaiting.values() for n in names_}
        for name in [n for n in states if n in self.owner and n not in followed and n not in awaited]:
            self.release(states.pop(name))
        if self.wait is None:
            return
        for a in self.spec.agents.values():  # a next turn waiting on a tool call in flight
            if a.name in self.ran or a.follows not in states:
                continue
            for t in (r for r in a.reads if r in self.calls.pending):
                if (a.follows, t) not in self._waited and a.follows in states:
                    self._waited.add((a.follows, t))
                    self.wait.begin(a.follows, states, self.spec.tools[t], self.calls.submitted_at[t],
                                    self.cw.taken.append)

    # -- the end ----------------------------------------------------------------------------------
    def _check_finished(self) -> None:
        if self.failed:
            return
        left = [a for a in self.spec.agents if a not in self.ran] + [s for s in self.spec.steps if s not in self.done]
        if left:
            raise WorkflowError(f"workflow {self.spec.name!r} cannot go on: {left} wait for what never comes "
                                "(a cycle through a step?)")

    def finish(self, result) -> None:
        """Complete the run's graph and result; raise ``ToolFailed`` if a tool failed."""
        self.cw.data_edges = data_edges(self.spec)
        result.tools = dict(self.tool_results)
        if self.wait is not None:
            self.wait.close()
        if self.failed:
            self.calls.cancel()
            name, err = next(iter(self.failed.items()))
            blocked = sorted(set(self.spec.agents) - self.ran)
            raise ToolFailed(name, f"tool {name!r} failed: {type(err).__name__}: {err}"
                             + (f" (not run: {', '.join(blocked)})" if blocked else ""), result) from err
