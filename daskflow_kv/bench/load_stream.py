"""Exp 7's streams: which workflow arrives when, from which client, over which document.

``n`` workflows arrive as a Poisson process of ``rate`` workflows per minute (the same
seeded schedule for every system), alternately from two clients. Each reads one of
``docs`` shared documents:

uniform   documents in turn (every document equally hot);
zipf      documents drawn from a Zipf law, P(k) proportional to 1 / k**s (s = 1.1 by
          default): a few hot documents and a long tail, as real traffic has.

Even-numbered workflows are RAG (3 readers, then a synthesizer), odd ones a debate (2
debaters x 2 rounds, then a moderator). Every prompt starts with the same system line
and its document, then the workflow's own question, so workflows over one document share
that prefix and nothing more. Pure apart from building the ``Workflow`` objects.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..flow.workflow import Workflow
from ..workflows.common import corpus_document

KINDS = ("uniform", "zipf")
ASPECTS = ["costs", "risks", "the main claim", "what to measure"]


@dataclass(frozen=True, slots=True)
class Arrival:
    index: int  # workflow number
    at: float  # seconds after the stream's start
    client: int  # 0 or 1
    doc: int  # which shared document


def gate_label(gate: float | None) -> str:
    """How a row names the workflow gate it ran behind (nothing when there was none)."""
    return "" if gate is None else f" gate {gate:g}"


def zipf_weights(docs: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(docs)]
    total = sum(w)
    return [x / total for x in w]


def doc_sequence(n: int, docs: int, kind: str, seed: int, s: float = 1.1) -> list[int]:
    """Which document each of ``n`` workflows reads: in turn, or drawn from a Zipf law."""
    if kind == "uniform":
        return [i % docs for i in range(n)]
    if kind == "zipf":
        rng = random.Random(seed)
        return rng.choices(range(docs), weights=zipf_weights(docs, s), k=n)
    raise ValueError(f"unknown stream kind {kind!r}; expected one of {KINDS}")


def schedule(n: int, rate_per_min: float, docs: list[int], seed: int = 0) -> list[Arrival]:
    """Poisson arrivals (exponential gaps), the first at 0; clients alternate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(Arrival(i, t, i % 2, docs[i]))
        t += rng.expovariate(rate_per_min / 60.0)
    return out


def documents(tokenizer, docs: int, context: int) -> list[str]:
    return [corpus_document(context, tokenizer, start=5 * j) for j in range(docs)]


def build(a: Arrival, doc: str, salt: str, max_new: int) -> Workflow:
    wf = Workflow(f"load{a.index}", system=f"Session {salt}. You are one of several agents working on a shared document.")
    wf.context("document", doc, title="Document")
    tag = f"Request {a.index}."
    if a.index % 2 == 0:  # RAG: readers, then a synthesizer
        readers = []
        for r in range(3):
            readers.append(wf.agent(f"reader{r}", f"{tag} Answer from the document, focusing on {ASPECTS[r]}.",
                                    reads=["document"], max_new_tokens=max_new))
        wf.agent("synthesizer", f"{tag} Combine the answers into one.", reads=["document", *readers], merge="text",
                 max_new_tokens=max_new)
    else:  # debate: two rounds of two debaters, then a moderator
        said: list[str] = []
        for r in range(2):
            now = [wf.agent(f"d{d}_r{r}", f"{tag} Round {r + 1}: argue {'for' if d == 0 else 'against'} the "
                            "document's main claim.", reads=["document", *said], max_new_tokens=max_new)
                   for d in range(2)]
            said += now
        wf.agent("moderator", f"{tag} Who argued better?", reads=["document", *said], merge="text",
                 max_new_tokens=max_new)
    return wf
