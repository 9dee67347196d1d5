"""BM25 retrieval over a small corpus: real ranking, no model, no network.

Okapi BM25 (k1=1.5, b=0.75) with a lowercase word tokenizer. Enough for the RAG
workflows' corpus of a few dozen passages; the ranking is deterministic, so both modes of
a workflow retrieve the same passages.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True, slots=True)
class Passage:
    id: str
    title: str
    text: str


class BM25:
    def __init__(self, passages: list[Passage], k1: float = 1.5, b: float = 0.75):
        self.passages = passages
        self.k1, self.b = k1, b
        self._tf = [Counter(words(p.title + " " + p.text)) for p in passages]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg = sum(self._len) / max(1, len(self._len))
        df = Counter(w for tf in self._tf for w in tf)
        n = len(passages)
        self._idf = {w: math.log(1 + (n - d + 0.5) / (d + 0.5)) for w, d in df.items()}

    def scores(self, query: str) -> list[float]:
        q = words(query)
        out = []
        for tf, length in zip(self._tf, self._len):
            s = 0.0
            for w in q:
                f = tf.get(w, 0)
                if f:
                    s += self._idf[w] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * length / self._avg))
            out.append(s)
        return out

    def search(self, query: str, k: int = 3) -> list[Passage]:
        scored = sorted(zip(self.scores(query), range(len(self.passages))), key=lambda t: (-t[0], t[1]))
        return [self.passages[i] for s, i in scored[:k] if s > 0]


def load_corpus(path: str | Path) -> list[Passage]:
    """A corpus of JSON lines (id, title, text); the example workflows ship one."""
    with open(path) as f:
        return [Passage(**json.loads(line)) for line in f if line.strip()]
