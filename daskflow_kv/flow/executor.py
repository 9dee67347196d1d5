"""Run a compiled workflow on Dask, in state mode, text mode, or both side by side.

State mode lowers each level to KV operations on a ``KVRuntime``: per group of agents
sharing a prompt prefix, one materialize (which itself reuses any cached prefix, such as
an upstream agent's continuation state, and may split a cold one over idle workers:
``parallel``), a fork, and one resume per agent placed by the cost model. Text mode sends
every agent's whole prompt to a worker, the baseline. Both build prompts from the same
text, so their tokens must agree exactly.

A workflow with tools or steps (``growing``) runs the same levels, each asked of its
``GrowingRun`` as the run reaches it (``grow``): the only hooks here are ``taken_levels``,
``grow.keeps`` and ``grow.after_level``.
"""

from __future__ import annotations

import itertools
import json
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

from distributed import KilledWorker

from .. import validation
from ..errors import KVPreempted
from ..runtime.plugin_client import gather
from ..runtime.workflow_gate import admitted, wait_turn
from ..runtime.workflow_run import new_run_name, workflow_run
from . import html_repr
from . import growing
from .compiler import CompiledWorkflow, add_level_nodes, compile_workflow, level_groups
from .prompts import prompt_tokens
from .spec import WorkflowSpec

# A level preempted this often gives up with the budget's error: a workflow that a budget able
# to hold it preempts again and again says so instead of retrying for ever. (Preemption is the
# budget's last resort: where workers keep a spill disk it spills younger runs' idle blocks
# instead, and nothing is redone.)
MAX_PREEMPTIONS = 30
# Dask fails a task once more than ``allowed-failures`` workers died while it was assigned to
# them, queued there or running (KilledWorker): its guard against a task that kills workers.
# A KV task is pinned to its planned worker and queues there behind others, so under workers
# dying from outside it is blamed for deaths it did not cause. A level so failed is redone
# under new keys (a fresh count) this often; a task that really kills its workers still fails.
MAX_KILLED_WORKER_REDOS = 2

_RUNTIME_POLICY = {"auto": "auto", "fork": "auto", "evict": "auto", "alias": "pin", "pin": "pin",
                   "transfer": "transfer", "recompute": "recompute"}


@dataclass(slots=True)
class AgentResult:
    name: str
    level: int
    text: str  # decoded output
    tokens: list[int]  # generated ids
    prompt_tokens: int  # prompt length fed to the model
    worker: str  # where the agent's decode ran
    ttft_s: float  # from the workflow's start to this agent's first token: queueing, shared prefill and upstream levels included
    prefill_s: float  # seconds prefilling on the worker (this agent's part)
    decode_s: float
    tokens_reused: int  # prompt tokens taken from KV blocks
    tokens_computed: int  # prompt tokens prefilled for this agent (its share of a group prefix excluded)
    tokens_recomputed: int = 0  # prefix tokens rebuilt on this agent's worker (recompute plan, first branch)
    bytes_transferred: int = 0  # KV bytes the plan moved to this agent's worker for it
    decision: str = ""  # reuse | transfer | recompute | text
    first_token_at: float = 0.0  # wall clock of the first token (the worker's time.time())
    level_started_at: float = 0.0  # wall clock when this agent's level was started
    planned_finish_at: float = 0.0  # wall clock the placement predicted its batch to finish (state mode)
    finished_at: float = 0.0  # wall clock its decode ended (first token + decode)


@dataclass(slots=True)
class WorkflowResult:
    workflow: str
    mode: str  # state | text
    agents: dict[str, AgentResult]
    wall_s: float
    level_tokens_computed: list[int]  # prompt tokens prefilled per level (group prefixes included)
    graph: CompiledWorkflow | None = None
    lineage: dict[str, list[dict]] = field(default_factory=dict)
    explain: str = ""
    # every prefill the run made: {"level", "op" (materialize | resume | recompute), "worker", "tokens"}
    prefills: list[dict] = field(default_factory=list)
    preemptions: int = 0  # levels redone because the budget preempted them to break a deadlock
    redone_tokens: int = 0  # prompt tokens the attempts later preempted (or killed) had prefilled: computed again
    killed_worker_redos: int = 0  # levels redone because Dask gave up on a task whose workers died
    gate_wait_s: float = 0.0  # s in the workflow gate's line before it started (wall_s and TTFTs count after)
    tools: dict[str, dict] = field(default_factory=dict)  # tool -> its output text, worker, seconds (``growing``)

    @property
    def generated_tokens(self) -> int:
        return sum(len(a.tokens) for a in self.agents.values())

    def _repr_html_(self) -> str:
        return html_repr.result_html(self)

    def as_dict(self) -> dict:
        return {
            "workflow": self.workflow,
            "mode": self.mode,
            "wall_s": self.wall_s,
            "level_tokens_computed": self.level_tokens_computed,
            "agents": {n: asdict(a) for n, a in self.agents.items()},
            "lineage": self.lineage,
            "preemptions": self.preemptions,
            "redone_tokens": self.redone_tokens,
            "killed_worker_redos": self.killed_worker_redos,
            "gate_wait_s": self.gate_wait_s,
            "tools": self.tools,
        }


@dataclass(slots=True)
class Comparison:
    state: WorkflowResult
    text: WorkflowResult

    @property
    def agreement(self) -> dict[str, bool]:
        return {n: a.tokens == self.text.agents[n].tokens for n, a in self.state.agents.items()}

    @property
    def all_agree(self) -> bool:
        return all(self.agreement.values())

    def _repr_html_(self) -> str:
        return html_repr.comparison_html(self)

    def as_dict(self) -> dict:
        return {"state": self.state.as_dict(), "text": self.text.as_dict(), "agreement": self.agreement}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, default=str)


def _metrics(gen) -> dict:
    return gen.metrics if isinstance(gen.metrics, dict) else gen.metrics.as_dict()


def taken_levels(cw: CompiledWorkflow, grow, outputs: dict):
    """(level, its agents): the compiled levels, or each next one as a growing run takes it."""
    if grow is None:
        yield from enumerate(cw.levels)
        return
    while (names := grow.next_level(outputs)) is not None:
        cw.levels.append(names)
        yield len(cw.levels) - 1, names


def run_text_mode(cw: CompiledWorkflow, rt, progress=None, grow=None) -> WorkflowResult:
    with admitted(rt.plugin, new_run_name(cw.workflow.name)) as waited:  # the workflow gate, as state mode
        result = _run_text_levels(cw, rt, progress, grow)
    result.gate_wait_s = waited
    return result


def _run_text_levels(cw: CompiledWorkflow, rt, progress, grow=None) -> WorkflowResult:
    wf = cw.workflow
    outputs: dict[str, str] = {}
    results: dict[str, AgentResult] = {}
    level_tokens = []
    t0, wall0 = time.perf_counter(), time.time()
    for lvl, names in taken_levels(cw, grow, outputs):
        if progress:
            progress("text", lvl, len(cw.levels), names)
        level_at = time.time()
        prompts = {n: prompt_tokens(wf, wf.agents[n], outputs, rt.tokenizer) for n in names}
        futures = {
            n: rt.generate_text(prompts[n], wf.agents[n].max_new_tokens, wf.agents[n].sampling, stream=i)
            for i, n in enumerate(names)
        }
        level_tokens.append(sum(len(p) for p in prompts.values()))
        for n, res in zip(futures, gather(rt.client, list(futures.values()))):
            m = _metrics(res)
            outputs[n] = rt.decode(res.generated)
            results[n] = AgentResult(
                n, lvl, outputs[n], list(res.generated), len(prompts[n]), res.worker, m["first_token_at"] - wall0,
                m["prefill_s"], m["decode_s"], tokens_reused=0, tokens_computed=len(prompts[n]), decision="text",
                first_token_at=m["first_token_at"], level_started_at=level_at,
                finished_at=m["first_token_at"] + m["decode_s"],
            )
        if grow is not None:
            grow.after_level(names, outputs, None)
    return WorkflowResult(wf.name, "text", results, time.perf_counter() - t0, level_tokens, cw)


def run_state_mode(cw: CompiledWorkflow, rt, progress=None, parallel=None, grow=None) -> WorkflowResult:
    """``parallel``: workers a group's shared prefix is prefilled over (KVRuntime.materialize:
    "auto", 1, W; None: ``daskflow-kv.parallel.materialize``). ``grow``: the ``GrowingRun``
    of a workflow with tools or steps."""
    with workflow_run(cw.workflow.name) as run:  # under a budget, its tasks keep this run's place in line
        try:
            with admitted(rt.plugin, run) as waited:  # the workflow gate: at most so many runs per worker
                result = _run_levels(cw, rt, progress, parallel, lambda: wait_turn(rt.plugin, run), grow)
        finally:
            rt.end_run(run)
    result.gate_wait_s = waited
    return result


def _run_levels(cw: CompiledWorkflow, rt, progress, parallel, rejoin, grow=None) -> WorkflowResult:
    """``rejoin``: waits until the workflow gate lets the run in again (a preempted run is sent
    back to its line)."""
    wf = cw.workflow
    outputs: dict[str, str] = {}
    results: dict[str, AgentResult] = {}
    lineage: dict[str, list[dict]] = {}
    states = {}
    level_tokens, prefills, preemptions, redos, redone = [], [], 0, 0, 0
    t0, wall0 = time.perf_counter(), time.time()
    for lvl, names in taken_levels(cw, grow, outputs):
        followed = {a.follows for a in wf.agents.values() if a.follows}  # a growing run adds agents
        if progress:
            progress("state", lvl, len(cw.levels), names)
        read_later = {r for later in cw.levels[lvl + 1:] for n in later for r in wf.agents[n].reads}
        level_at = time.time()
        prompts = {n: prompt_tokens(wf, wf.agents[n], outputs, rt.tokenizer) for n in names}
        add_level_nodes(cw, lvl, prompts, estimated=False)
        for attempt in itertools.count():
            tried: list[dict] = []  # the attempt's prefills as they are made: wasted if it is redone
            try:
                computed, made, done = _run_level(rt, wf, lvl, names, prompts, read_later, parallel, tried)
                break
            except KVPreempted:  # the budget's deadlock breaker chose this workflow: redo the level
                if attempt + 1 >= MAX_PREEMPTIONS:
                    raise
                preemptions += 1
            except KilledWorker:  # its workers died under it (see MAX_KILLED_WORKER_REDOS): redo the level
                if redos >= MAX_KILLED_WORKER_REDOS:
                    raise
                redos += 1
            # Hold nothing while waiting to be let in again (outside the handler: the error and
            # its frames are gone): the continuations kept for later levels go to the cache too,
            # evicted last; what is evicted meanwhile is prefilled again. The wait is the
            # workflow gate's, on the scheduler (it sent this run back to the head of its line
            # and lets fewer in): no sleep here, so no worker idles while this run could go.
            redone += sum(p["tokens"] for p in tried)
            rt.release_many(list(states.values()), reuse_expected=True)
            states.clear()
            rejoin()
        prefills += made
        done_with = []  # released together after the level: one scheduler call, not two an agent
        for name, branch, gen, planned_at in done:
            m = _metrics(gen)
            d = gen.placement.decision
            # A destination pays its transfer or rebuild once, charged to its first branch.
            moved = d.nbytes if (d is not None and d.action == "transfer" and gen.placement.first) else 0
            computed += m.get("tokens_recomputed", 0)
            computed += m["tokens_computed"]
            if m.get("tokens_recomputed"):
                prefills.append({"level": lvl, "op": "recompute", "worker": gen.worker,
                                 "tokens": m["tokens_recomputed"]})
            prefills.append({"level": lvl, "op": "resume", "worker": gen.worker, "tokens": m["tokens_computed"]})
            outputs[name] = gen.text
            results[name] = AgentResult(
                name, lvl, gen.text, list(gen.tokens), len(prompts[name]), gen.worker,
                m["first_token_at"] - wall0, m["prefill_s"], m["decode_s"],
                tokens_reused=m["tokens_reused"],
                tokens_computed=m["tokens_computed"],
                tokens_recomputed=m.get("tokens_recomputed", 0),
                bytes_transferred=moved,
                decision=d.action if d is not None else "reuse",
                first_token_at=m["first_token_at"], level_started_at=level_at,
                planned_finish_at=planned_at + gen.placement.finish_s,
                finished_at=m["first_token_at"] + m["decode_s"],
            )
            lineage[name] = [ev.as_dict() for ev in gen.state.state.lineage]
            done_with.append(branch)
            # Keep a continuation live only when a later agent continues it (``follows``):
            # the rest stay cached for reuse but evictable, so under a KV budget the
            # workflow's pinned working set is what it still needs, not all it made.
            if (name in followed or (grow is not None and name in grow.owner)) and wf.agents[name].policy != "evict":
                states[name] = gen.state
            else:
                done_with.append(gen.state)
        rt.release_many(done_with)
        level_tokens.append(computed)
        if grow is not None:  # a step's agent is held until nothing continues it (``growing``)
            grow.after_level(names, outputs, states)
    result = WorkflowResult(wf.name, "state", results, time.perf_counter() - t0, level_tokens, cw, lineage,
                            prefills=prefills, preemptions=preemptions, killed_worker_redos=redos,
                            redone_tokens=redone)
    result.explain = cw.explain() + ("\ncost model:\n" + rt.explain() if rt.decisions else "")
    rt.release_many(list(states.values()))  # the cache keeps the blocks (retention), subject to the budget
    rt.note_workflow(len(results), [a.ttft_s for a in results.values()])  # after the releases: no block stays pinned while it is told
    return result


def _run_level(rt, wf, lvl: int, names, prompts: dict, read_later: set, parallel, prefills: list):
    """One level in state mode: per prefix group a materialize and a fork, then the agents'
    resumes. -> (tokens computed, ``prefills``, [(name, branch, generation, planned_at)]);
    ``prefills`` gets each materialize's as it is made. A ``KVPreempted`` or ``KilledWorker``
    leaves nothing of the attempt live: its states are released."""
    computed, made, done = 0, [], []
    buckets: dict[tuple, list] = {}
    try:
        for group in level_groups(wf, prompts, rt.block_size):
            first = prompts[group.members[0]]
            # Not waited for: the planner places the branches while the prefix is still being
            # made, so an idle worker may rebuild it in parallel rather than wait for a copy.
            prefix = rt.materialize(first[: group.prefix_len], parallel=parallel)  # reuses any cached part
            event = prefix.state.lineage[-1].as_dict()
            computed += event["tokens_computed"]
            if event["tokens_computed"]:
                prefills.append({"level": lvl, "op": "materialize", "worker": prefix.state.worker,
                                 "tokens": event["tokens_computed"]})
            for member, branch in zip(group.members, rt.fork(prefix, len(group.members))):
                a = wf.agents[member]
                key = (a.max_new_tokens, a.sampling, _RUNTIME_POLICY[a.policy])
                buckets.setdefault(key, []).append((member, branch, prompts[member][group.prefix_len :]))
                made.append(branch)
            # KVFlow's rule, kept soft: a prefix a later level reads again is evicted last
            # (it would be prefilled again), but never pinned - concurrent workflows under a
            # budget must not deadlock on each other's plans. The later level looks it up.
            rt.release(prefix, reuse_expected=any(r in read_later for m in group.members
                                                  for r in wf.agents[m].reads if r in wf.contexts))
        for (max_new, sampling, policy), reqs in buckets.items():
            planned_at = time.time()
            gens = rt.resume_many([(b, s) for _, b, s in reqs], max_new, sampling, policy=policy)
            for (name, branch, _), gen in zip(reqs, gens):
                done.append((name, branch, gen, planned_at))
                made.append(gen.state)
    except (KVPreempted, KilledWorker):
        rt.release_many(made)
        raise
    return computed, prefills, done


def run_workflow(wf: WorkflowSpec, mode: str = "state", runtime=None, parallel=None, progress=None,
                 **runtime_kwargs):
    """Compile ``wf`` and run it; ``mode`` is state, text or both (returns a Comparison).
    ``parallel``: see ``run_state_mode``; ``progress``: the per-level callback of both modes."""
    validation.choice("mode", mode, ("state", "text", "both"))
    if parallel is not None:
        parallel = validation.parallelism("parallel", parallel)
    with ExitStack() as stack:
        if runtime is None:
            from ..runtime.cluster import embedded_runtime

            runtime = stack.enter_context(embedded_runtime(**runtime_kwargs))
        if mode == "text":
            return _run_mode(wf, runtime, "text", progress, parallel)
        state = _run_mode(wf, runtime, "state", progress, parallel)
        if mode == "state":
            return state
        return Comparison(state, _run_mode(wf, runtime, "text", progress, parallel))


def _run_mode(wf: WorkflowSpec, rt, mode: str, progress, parallel) -> WorkflowResult:
    """Compile and run ``wf`` in one mode; a growing workflow on its own copy, as it grows."""
    if not growing.grows(wf):
        cw = compile_workflow(wf, rt.tokenizer, rt.facts.max_positions, rt.block_size)
        return run_text_mode(cw, rt, progress) if mode == "text" else run_state_mode(cw, rt, progress, parallel)
    cw, grow = growing.for_run(wf, rt, mode)
    if mode == "text":
        result = run_text_mode(cw, rt, progress, grow)
    else:
        result = run_state_mode(cw, rt, progress, parallel, grow)
    grow.finish(result)
    return result
