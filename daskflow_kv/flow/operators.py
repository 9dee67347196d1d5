"""The operators that ship beside agents: BM25 retrieval over a corpus on the cluster, and a
memory (a key-value store agents write to and read from, across runs).

Both are ordinary tools (``spec.Tool``): a function run as a Dask task, its output text a
later agent reads. ``Workflow.retrieve`` / ``remember`` / ``recall`` add them.

A ``Corpus`` lives on the cluster, not in each call: one read from a file every worker can
reach is loaded and indexed once per worker process; one given as passages is scattered
once per client (``ToolCalls.shared``) and indexed once per worker process. Retrieval is
deterministic (``retrieval.BM25``), so a workflow's state and text runs read the same
passages.

A memory lives in the scheduler's metadata (``Client.set_metadata``), one entry per key,
named by a digest of the namespace's secret and the key (``MemoryKey``): another tenant
cannot name one, but, as everything on a Dask scheduler, whoever can run code on the
cluster can read it (docs/security.md). It outlives a run: that is what it is for.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from .. import keys
from .retrieval import BM25, Passage, load_corpus

MAX_INDEXES = 8  # BM25 indexes a worker process keeps (least recently used out)
_INDEXES: OrderedDict[str, BM25] = OrderedDict()
_INDEX_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class Corpus:
    """Passages to search: a JSON-lines file (id, title, text) or the passages themselves."""

    ident: str  # a digest of the file's path and size, or of the passages
    path: str | None = None  # read on each worker (every worker must reach it)
    passages: tuple[Passage, ...] = field(default=(), repr=False)

    @classmethod
    def from_file(cls, path: str | Path) -> Corpus:
        path = Path(path).resolve()
        load_corpus(path)  # a missing or malformed file fails here, before any run
        return cls(_digest(f"{path}|{path.stat().st_size}|{path.stat().st_mtime_ns}"), str(path))

    @classmethod
    def from_passages(cls, passages) -> Corpus:
        passages = tuple(passages)
        if not passages or not all(isinstance(p, Passage) for p in passages):
            raise ValueError("a corpus needs at least one passage, each a retrieval.Passage")
        return cls(_digest("\x1e".join(f"{p.id}\x1f{p.title}\x1f{p.text}" for p in passages)), None, passages)

    def for_cluster(self, calls):
        """What a tool call carries: the file's name, or the passages scattered once."""
        return self if self.path is not None else calls.shared(f"corpus-{self.ident}", self)

    def index(self) -> BM25:
        """This process's BM25 index of the corpus, built once."""
        with _INDEX_LOCK:
            if self.ident in _INDEXES:
                _INDEXES.move_to_end(self.ident)
                return _INDEXES[self.ident]
        bm25 = BM25(load_corpus(self.path) if self.path is not None else list(self.passages))
        with _INDEX_LOCK:
            _INDEXES[self.ident] = bm25
            while len(_INDEXES) > MAX_INDEXES:
                _INDEXES.popitem(last=False)
        return bm25


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def bm25_search(corpus: Corpus, k: int, *texts: str) -> str:
    """The ``k`` best passages for the texts read (joined as one query), one per line."""
    found = corpus.index().search(" ".join(texts), k)
    return "\n".join(f"[{p.title}] {p.text}" for p in found) or "(no passage matched)"


@dataclass(frozen=True, slots=True)
class Search:
    """A search tool for an agent's calls (ReAct): the query is the call's argument."""

    corpus: Corpus
    k: int = 3
    __name__ = "search"  # how its durations are kept (``tool_calls.history_key``)

    def __call__(self, query: str) -> str:
        return bm25_search(self.corpus, self.k, query)


@dataclass(frozen=True, slots=True)
class MemoryKey:
    store: str  # a memory's name
    key: str  # the entry within it

    def for_cluster(self, calls) -> str:
        """The entry's name: the namespace's tag and a keyed digest of store and key."""
        mac = hmac.new(calls.key_digest.encode(), f"{self.store}\x1f{self.key}".encode(), hashlib.sha256)
        return f"daskflow-kv-memory-{keys.namespace_tag(calls.namespace)}-{mac.hexdigest()[:32]}"


MEMORY = "daskflow-kv-memory"  # the scheduler metadata entry memories live under


def memory_write(entry: str, *texts: str) -> str:
    """On a worker: store the texts read, joined, as ``entry``; -> what was stored."""
    from distributed import get_client

    value = "\n\n".join(t.strip() for t in texts)
    get_client().set_metadata([MEMORY, entry], value)
    return value


def memory_read(entry: str, default: str) -> str:
    """On a worker: what ``entry`` holds, or ``default`` when nothing was written."""
    from distributed import get_client

    value = get_client().get_metadata([MEMORY, entry], default=default)
    return value if isinstance(value, str) else default
