"""Shared pieces of the example workflows: a sized context made from the shipped corpus."""

from __future__ import annotations

from daskflow_kv.retrieval import load_corpus


def corpus_document(approx_tokens: int, tokenizer=None, start: int = 0) -> str:
    """Passages of the corpus, in order from ``start``, until about ``approx_tokens`` tokens."""
    passages = load_corpus()
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
