"""Planner -> retriever -> solvers -> judge.

The planner writes a plan; retrieval (BM25 over the corpus, no model) fetches passages for
the task; each solver reads the plan and the passages, then its own sub-task; the judge
reads every solver's answer - a restricted merge by text reduction, since the solvers'
states diverge after their shared prefix and cannot be concatenated.
"""

from __future__ import annotations

from daskflow_kv.flow.retrieval import BM25
from daskflow_kv.flow.workflow import Workflow

from .common import corpus, corpus_document

TASK = "Design the cache policy of a multi-agent serving system that runs on a Dask cluster."
PARTS = ["placement of shared state", "transfer versus recompute", "eviction under a memory budget", "recovery from a lost worker"]


def build(agents: int = 3, context_tokens: int = 256, max_new_tokens: int = 24, tokenizer=None) -> Workflow:
    wf = Workflow("planner_solvers", system="You are part of a planning team. Be specific and brief.")
    wf.context("task", TASK + "\n" + corpus_document(context_tokens, tokenizer, start=4), title="Task")
    wf.agent("planner", f"Split the task into {agents} parts, one line each.", reads=["task"], max_new_tokens=max_new_tokens)
    passages = BM25(list(corpus())).search(TASK + " " + " ".join(PARTS[:agents]), k=4)
    wf.context("retrieved", "\n".join(f"[{p.title}] {p.text}" for p in passages), title="Retrieved passages")
    solvers = []
    for i in range(agents):
        name = f"solver{i}"
        wf.agent(name, f"Solve the part about {PARTS[i % len(PARTS)]}.", reads=["task", "planner", "retrieved"],
                 max_new_tokens=max_new_tokens)
        solvers.append(name)
    wf.agent("judge", "Merge the solutions into one design and point out conflicts.",
             reads=["task", "planner", *solvers], merge="text", max_new_tokens=max_new_tokens)
    return wf
