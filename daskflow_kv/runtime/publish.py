"""Publishing new states' blocks: one content-addressed key per new span, acquired or submitted.

A new state keeps whole blocks of a cached prefix (``kept``) and adds one block per new span.
Each new span is cut from a task's output on the worker that holds it - a prefill's, one of
a parallel prefill's chunks, a store load's, or a cached block shortened - as its
``BlockSource`` says. A span whose content address the scheduler already knows (cached,
or being computed) is acquired, not submitted again: keys never get a second run spec. One
it keeps only released (evicted, still lineage of later blocks) is made again under a fresh
key (``keys.rebuilt_key``): a planned prefill of what is missing, instead of Dask's rerun of
the whole task that first made it. Every state of one call shares one acquire, and two states
with the same continuation share its blocks' keys and futures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from distributed import Future

from ..keys import content_key, rebuilt_key
from ..state.blocks import BlockRef, block_key
from . import tasks
from .kv_persistence import PersistentTier
from .prefix_cache import PrefixCache
from .submit import Submitter


@dataclass(frozen=True, slots=True)
class BlockSource:
    """Where one new block is cut from."""

    output: Future  # a prefill's (or chunk's, or store load's) output, or one cached block
    index: int  # which block of ``output``; with ``cut``: how many of the cached block's tokens to keep
    worker: str | None  # where ``output`` is: the cutting task runs there
    cut: bool = False  # ``output`` is a cached block to shorten (tasks.cut_block), not an output to index

    def task(self) -> tuple:
        """(function, *args) of the task that makes the block."""
        return (tasks.cut_block if self.cut else tasks.take_block), self.output, self.index


def blocks_of(output: Future, n: int, worker: str | None) -> list[BlockSource]:
    """The first ``n`` blocks of one output on ``worker``."""
    return [BlockSource(output, i, worker) for i in range(n)]


@dataclass(frozen=True, slots=True)
class NewBlocks:
    """The blocks of one state to publish."""

    tokens: Sequence[int]  # the state's tokens: the new blocks' content
    kept: Sequence[tuple[BlockRef, Future]]  # whole cached blocks it starts with, unchanged
    spans: Sequence[tuple[int, int]]  # the new blocks' token spans, in order, after ``kept``
    sources: Sequence[BlockSource]  # where each new span is cut from, one per span
    state_id: str  # the state they are made for (catalog)


@dataclass(frozen=True, slots=True)
class PublishedBlocks:
    refs: tuple[BlockRef, ...]  # every block of the state, kept ones first
    futures: tuple[Future, ...]  # one per ref: holding them keeps the blocks alive


@dataclass(slots=True, eq=False)
class Publisher:
    prefixes: PrefixCache  # acquires blocks the scheduler already knows
    submitter: Submitter  # submits the tasks that make the others
    tier: PersistentTier  # write requests for blocks that are written through
    key_digest: str  # seeds block keys (the tenant's HMAC of the fingerprint)
    fingerprint_digest: str  # the model's fingerprint (catalog)
    bytes_per_token: int  # K/V bytes one token takes

    def publish(self, states: Sequence[NewBlocks], store: bool = False,
                source: str | None = None) -> list[PublishedBlocks]:
        """Every state's blocks, with one acquire for all their new keys.

        ``store``: new blocks are also written to the persistent store (by the task that
        makes them, in the background); ``source="store"``: they were loaded from it.
        """
        plans = [self._chain(s) for s in states]
        held, released = self.prefixes.acquire(dict.fromkeys(r.key for planned in plans for r, _ in planned))
        out = []
        for s, planned in zip(states, plans):
            refs, futures = [r for r, _ in s.kept], [f for _, f in s.kept]
            for (ref, parent), src in zip(planned, s.sources, strict=True):
                content = ref.key
                if content not in held:  # a new block, or one Dask let go: a task under a free key
                    ref = replace(ref, key=rebuilt_key(content) if content in released else content)
                    meta = self._meta(ref, parent, s.state_id)
                    if source:
                        meta["source"] = source
                    if store:
                        meta["persist"] = True
                    task = src.task() + ((self.tier.write_request(content, ref.start, ref.end),) if store else ())
                    held[content] = self.submitter.block(ref.key, meta, src.worker, *task)
                refs.append(replace(ref, key=held[content].key))
                futures.append(held[content])
            out.append(PublishedBlocks(tuple(refs), tuple(futures)))
        return out

    def _chain(self, s: NewBlocks) -> list[tuple[BlockRef, str | None]]:
        """(ref, parent's content address) of each new span, keyed by its content address: it
        hashes its parent's and its own tokens."""
        parent = content_key(s.kept[-1][0].key) if s.kept else None
        planned = []
        for a, b in s.spans:
            key = block_key(self.key_digest, parent, s.tokens[a:b], self.submitter.namespace)
            planned.append((BlockRef(key, a, tuple(s.tokens[a:b]), (b - a) * self.bytes_per_token), parent))
            parent = key
        return planned

    def _meta(self, ref: BlockRef, parent: str | None, state_id: str) -> dict:
        return {"key": ref.key, "start": ref.start, "end": ref.end, "nbytes": ref.nbytes,
                "tokens": list(ref.token_ids), "parent": parent, "fingerprint": self.fingerprint_digest,
                "root": self.key_digest, "state_id": state_id, "device": self.submitter.spec.device}
