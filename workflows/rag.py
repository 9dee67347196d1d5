"""Collaborative RAG: BM25 retrieves passages once; several readers answer from them.

The retrieved passages are one shared context placed before each reader's own question,
so they are prefilled once and forked to the readers; a synthesizer merges the answers.
"""

from __future__ import annotations

from daskflow_kv.flow.retrieval import BM25
from daskflow_kv.flow.workflow import Workflow

from .common import corpus

QUESTION = "When should a cached prefix be transferred between workers instead of recomputed?"
ASPECTS = ["the cost of moving data", "the speed of prefill", "memory pressure and eviction", "failures and lineage"]


def build(agents: int = 3, context_tokens: int = 384, question: str = QUESTION, max_new_tokens: int = 24,
          tokenizer=None) -> Workflow:
    """Readers share the best BM25 passages, as many as fit in about ``context_tokens``."""
    ranked = BM25(list(corpus())).search(question, k=12)
    passages, used = [], 0
    for p in ranked:
        n = len(tokenizer(p.text)["input_ids"]) if tokenizer else len(p.text) // 4
        if passages and used + n > context_tokens:
            break
        passages.append(p)
        used += n
    wf = Workflow("rag", system="Answer only from the passages. Cite passage titles.")
    wf.context("passages", "\n".join(f"[{p.title}] {p.text}" for p in passages), title="Retrieved passages")
    wf.context("question", question, title="Question")
    readers = []
    for i in range(agents):
        name = f"reader{i}"
        wf.agent(name, f"Answer the question focusing on {ASPECTS[i % len(ASPECTS)]}.",
                 reads=["passages", "question"], max_new_tokens=max_new_tokens)
        readers.append(name)
    wf.agent("synthesizer", "Combine the readers' answers into one answer.", reads=["passages", "question", *readers],
             merge="text", max_new_tokens=max_new_tokens)
    return wf
