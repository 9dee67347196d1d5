"""What arrives: workflows as prompt shapes - exp 7's generator, or a JSON-lines trace.

A prompt is a list of *segments* ``(key, tokens)``. Prompts whose leading segments have
the same keys share that token prefix (and its KV blocks); a key names content, so two
workflows over one document share ``doc:<k>`` and nothing after it. An agent's level is
one more than the deepest agent whose output it reads (the executor runs levels in turn).

Trace format (one JSON object per line, one line per workflow)::

    {"at": 0.0, "client": 0, "doc": 3, "agents": [
        {"name": "reader0", "level": 0, "max_new": 16, "segments": [["doc:3", 1060], ["own", 18]]},
        {"name": "synth", "level": 1, "max_new": 16,
         "segments": [["doc:3", 1060], ["out:reader0", 22], ["own", 12]]}]}

``at`` is seconds after the stream's start; a segment key other than ``doc:...`` is made
unique to its workflow (``out:reader0`` of workflow 5 is not workflow 6's): ``out:`` and
``task:`` keys are shared by that workflow's agents (an upstream output; the head of a task
text several agents share, e.g. ``["task:reader0", 14]``), any other key is the agent's own.
``level`` may be left out (then computed from the ``out:`` segments).

``exp7_stream`` builds exp 7's workflows with ``bench.load_stream`` (its ``doc_sequence``,
``schedule`` and ``build``: the same seeds, documents and agents as the measured stream) and
turns each agent's rendered prompt into segments. Token counts are estimated from text
(``TOKENS_PER_CHAR``, chat-template overheads) because no tokenizer is loaded here; the
document segment has exactly ``context`` tokens, as ``load_stream.documents`` makes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

TOKENS_PER_CHAR = 0.25  # English text through a byte-level BPE: ~4 characters a token
SYSTEM_OVERHEAD = 8  # chat-template tokens around the system line and the user turn's start
READ_OVERHEAD = 6  # "## <agent> said" and separators around a read output
TASK_OVERHEAD = 10  # "## Task", the end of the user turn and the assistant header


@dataclass(frozen=True, slots=True)
class SimCall:
    """One agent's model call."""

    name: str  # agent name, unique in its workflow
    level: int  # executor level: 0 reads only contexts
    segments: tuple[tuple[str, int], ...]  # (content key, tokens), in prompt order
    max_new: int  # tokens it decodes

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass(frozen=True, slots=True)
class SimWorkflow:
    index: int  # workflow number
    at: float  # s after the stream's start
    client: int  # which client submitted it
    doc: int  # its shared document (-1: none)
    calls: tuple[SimCall, ...]  # every agent

    def levels(self) -> list[list[SimCall]]:
        out: list[list[SimCall]] = []
        for c in self.calls:
            while len(out) <= c.level:
                out.append([])
            out[c.level].append(c)
        return [lvl for lvl in out if lvl]

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.calls)


def _est(text: str) -> int:
    return max(1, round(len(text) * TOKENS_PER_CHAR))


def workflow_calls(wf, index: int, doc: int, context: int) -> tuple[SimCall, ...]:
    """Segments of every agent of a built ``Workflow`` (``flow.prompts``' order: system,
    contexts, read outputs, task)."""
    doc_tokens = SYSTEM_OVERHEAD + _est(wf.system)
    for ctx in wf.contexts.values():
        doc_tokens += _est(f"## {ctx.title or ctx.name}\n") + context
    level: dict[str, int] = {}
    heads: dict[tuple, list[str]] = {}  # agents whose prompts are equal up to their task text
    rows = []
    for name, agent in wf.agents.items():
        segs = [(f"doc:{doc}", doc_tokens)]
        lvl = 0
        for r in agent.reads:
            if r in wf.contexts:
                continue
            segs.append((f"out:{index}:{r}", READ_OVERHEAD + _est(f"## {r} said\n") + wf.agents[r].max_new_tokens))
            lvl = max(lvl, level[r] + 1)
        level[name] = lvl
        heads.setdefault((lvl, tuple(agent.reads)), []).append(name)
        rows.append((name, agent, lvl, segs))
    calls = []
    for name, agent, lvl, segs in rows:
        own = TASK_OVERHEAD + _est(agent.instructions)
        peers = heads[(lvl, tuple(agent.reads))]
        head = task_head([wf.agents[p].instructions for p in peers]) if len(peers) > 1 else ""
        if head:  # "## Task\nRequest 3. Round 1: argue": shared by the peers' prompts, so by their group's prefix
            n = min(own - 1, _est("## Task\n" + head))
            segs.append((f"task:{index}:{peers[0]}", n))
            own -= n
        segs.append((f"own:{index}:{name}", own))
        calls.append(SimCall(name, lvl, tuple(segs), agent.max_new_tokens))
    return tuple(calls)


def task_head(texts: list[str]) -> str:
    """The leading words every one of ``texts`` shares (cut before the first word that differs:
    a byte-level BPE token starts with its word's space, so the shared tokens end there)."""
    first = texts[0]
    n = len(os.path.commonprefix(texts))
    if n == len(first) and all(len(t) == n for t in texts):
        return first
    cut = first.rfind(" ", 0, n + 1)
    return first[:cut] if cut > 0 else ""


def exp7_stream(n: int, rate_per_min: float, docs: int, kind: str = "zipf", context: int = 1024, max_new: int = 16,
                doc_seed: int = 7, arrival_seed: int | None = None, zipf_s: float = 1.1) -> list[SimWorkflow]:
    """Exp 7's stream (``bench.load_stream``): ``n`` workflows, Poisson at ``rate_per_min``,
    over ``docs`` documents in turn (uniform) or Zipf-drawn; RAG and debate alternate.
    ``arrival_seed`` defaults to exp 7's ``int(rate * 1000)`` (repetition 0)."""
    from ..bench.load_stream import build, doc_sequence, schedule  # lazy: it imports the flow API

    doc_of = doc_sequence(n, docs, kind.removesuffix("-budget"), seed=doc_seed, s=zipf_s)
    seed = int(rate_per_min * 1000) if arrival_seed is None else arrival_seed
    out, shapes = [], {}
    for a in schedule(n, rate_per_min, doc_of, seed=seed):
        # The agents depend on the index's parity and the request tag only: build once per
        # shape with a stand-in document (its length is ``context`` tokens by construction).
        key = (a.index % 2, len(str(a.index)))
        if key not in shapes:
            shapes[key] = build(a, "", "sim", max_new)
        out.append(SimWorkflow(a.index, a.at, a.client, a.doc, workflow_calls(shapes[key], a.index, a.doc, context)))
    return out


def write_trace(workflows, path: str | Path) -> None:
    with open(path, "w") as f:
        for w in workflows:
            f.write(json.dumps({"at": w.at, "client": w.client, "doc": w.doc, "agents": [
                {"name": c.name, "level": c.level, "max_new": c.max_new,
                 "segments": [[k.replace(f":{w.index}:", ":", 1), t] for k, t in c.segments]} for c in w.calls]})
                    + "\n")


def read_trace(path: str | Path) -> list[SimWorkflow]:
    """A JSON-lines trace (see the module docstring), sorted by arrival."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: float(r["at"]))
    out = []
    for i, r in enumerate(rows):
        calls, level = [], {}
        for a in r["agents"]:
            segs = []
            for k, t in a["segments"]:
                k = str(k)
                if int(t) < 0:
                    raise ValueError(f"trace line {i + 1}: negative token count in segment {k!r}")
                if k.startswith(("out:", "task:")):
                    head, rest = k.split(":", 1)
                    k = f"{head}:{i}:{rest}"  # another agent's output, or a task head, in this workflow
                elif not k.startswith("doc:"):
                    k = f"{k}:{i}:{a['name']}"  # the agent's own text
                segs.append((k, int(t)))
            lvl = a.get("level")
            if lvl is None:
                lvl = max((level.get(k.split(":", 1)[1], -1) + 1 for k, _ in a["segments"]
                           if str(k).startswith("out:")), default=0)
            level[a["name"]] = int(lvl)
            calls.append(SimCall(str(a["name"]), int(lvl), tuple(segs), int(a.get("max_new", 16))))
        out.append(SimWorkflow(i, float(r["at"]), int(r.get("client", 0)), int(r.get("doc", -1)), tuple(calls)))
    return out
