"""Multi-agent debate: ``agents`` debaters argue over ``rounds``; a moderator concludes.

Round r's prompt is the topic plus the whole transcript of rounds before r, so every
round's prompts begin with the previous round's shared prefix: that state is extended by
the new messages only, never re-prefilled from the start.
"""

from __future__ import annotations

from daskflow_kv.flow.workflow import Workflow

from .common import corpus_document

STANCES = ["move the cache", "recompute it", "keep it pinned", "spill it to disk"]


def build(agents: int = 2, rounds: int = 3, context_tokens: int = 256, max_new_tokens: int = 24, tokenizer=None) -> Workflow:
    wf = Workflow("debate", system="You are a debater. Be brief and concrete.")
    wf.context("topic", "Should a multi-agent system move shared KV state between workers or recompute it?\n"
               + corpus_document(context_tokens, tokenizer, start=8), title="Topic")
    transcript: list[str] = []
    for r in range(rounds):
        said = []
        for d in range(agents):
            name = f"d{d}_r{r}"
            wf.agent(name, f"Round {r + 1}: argue to {STANCES[d % len(STANCES)]}, replying to the others.",
                     reads=["topic", *transcript], role=f"debater {d + 1}", max_new_tokens=max_new_tokens)
            said.append(name)
        transcript += said
    wf.agent("moderator", "Summarize the debate and state which side was more convincing.",
             reads=["topic", *transcript], merge="text", max_new_tokens=max_new_tokens)
    return wf
