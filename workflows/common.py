"""Shared pieces of the example workflows: a sized context made from the shipped corpus."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from daskflow_kv.flow.retrieval import Passage, load_corpus

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.jsonl"


@lru_cache(maxsize=1)
def corpus() -> tuple[Passage, ...]:
    """The passages shipped with the example workflows."""
    return tuple(load_corpus(CORPUS_PATH))


def corpus_document(approx_tokens: int, tokenizer=None, start: int = 0) -> str:
    """Passages of the corpus, in order from ``start``, until about ``approx_tokens`` tokens."""
    passages = corpus()
    parts, used, i = [], 0, start
    while used < approx_tokens:
        p = passages[i % len(passages)]
        piece = f"{p.title}. {p.text}"
        n = len(tokenizer(piece, add_special_tokens=False)["input_ids"]) if tokenizer else len(piece) // 4
        if parts and used + n > approx_tokens * 1.1:
            break
        parts.append(piece)
        used += n
        i += 1
    return "\n".join(parts)
