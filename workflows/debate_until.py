"""A debate that runs until the judge says the debaters agree (at most ``max_rounds``).

Each round the debaters read the topic and every earlier message; the judge reads the
round and answers whether they agree. The loop (``Workflow.loop``) decides after each
round from the judge's words whether another round runs, so the graph is known only as
it is taken. Each round's prompts begin with the last round's: the shared prefix is
extended, not prefilled again.
"""

from __future__ import annotations

import re

from daskflow_kv.flow.workflow import Workflow

from .common import corpus_document

STANCES = ["move the cache", "recompute it", "keep it pinned", "spill it to disk"]
_AGREE = re.compile(r"\bagree(d|ment)?\b", re.IGNORECASE)
_DISAGREE = re.compile(r"\b(not|no|dis|don't|do not)\s*agree", re.IGNORECASE)


def agreed(text: str) -> bool:
    """The judge says the debaters agree (and does not say they do not)."""
    return bool(_AGREE.search(text)) and not _DISAGREE.search(text)


def build(agents: int = 2, max_rounds: int = 3, context_tokens: int = 256, max_new_tokens: int = 24,
          tokenizer=None, until=agreed, name: str = "debate_until", document: str | None = None) -> Workflow:
    """``until(judge's text)``: the debate ends (default: ``agreed``); ``document``: what it is about."""
    wf = Workflow(name, system="You are in a debate. Be brief and concrete.")
    wf.context("topic", "Should a multi-agent system move shared KV state between workers or recompute it?\n"
               + (document or corpus_document(context_tokens, tokenizer, start=8)), title="Topic")

    def said_before(r: int) -> list[str]:
        return [f"debate.r{q}.d{d}" for q in range(r) for d in range(agents)]

    def round_(g, r, last):
        transcript = said_before(r)
        now = [g.agent(f"debate.r{r}.d{d}", f"Round {r + 1}: argue to {STANCES[d % len(STANCES)]}, replying "
                       "to the others.", reads=["topic", *transcript], role=f"debater {d + 1}",
                       max_new_tokens=max_new_tokens) for d in range(agents)]
        return g.agent(f"debate.r{r}.judge", "Do the debaters now agree? Start with 'agreed' or 'not yet'.",
                       reads=["topic", *transcript, *now], max_new_tokens=max_new_tokens)

    wf.loop("debate", round_, until=until, max_rounds=max_rounds, reads=["topic"])
    wf.agent("moderator", "State the conclusion of the debate in one sentence.", reads=["topic", "debate"],
             max_new_tokens=max_new_tokens)
    return wf
