"""References this client holds to cached blocks: prefix lookups and acquires, as futures.

The plugin acquires blocks for this client before it answers (``kv_lookup``, ``kv_acquire``),
so none can be evicted in between; ``hold_futures`` turns those references into futures this
process owns, and dropping the futures gives them back. A ``HeldPrefix`` is a lookup's typed
answer together with those futures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from distributed import Client, Future

from ..dask_internals import hold_futures
from ..policy.cluster_view import CachedBlock, PrefixMatch
from ..state.blocks import BlockRef, aligned_floor, chain_keys
from .plugin_client import PluginClient


@dataclass(frozen=True, slots=True)
class HeldPrefix:
    """A cached prefix whose blocks this client now holds futures for."""

    match: PrefixMatch  # the plugin's answer: tokens covered, blocks and where they are
    futures: Mapping[str, Future]  # block key -> the future that keeps it alive, one per block
    request: Sequence[int] = ()  # the tokens looked up (the blocks' tokens, up to ``match.tokens``)
    snapshot: Mapping | None = None  # the planner's snapshot, when it came with the lookup (``find(view=True)``)

    @property
    def tokens(self) -> int:
        return self.match.tokens

    @property
    def blocks(self) -> tuple[CachedBlock, ...]:
        return self.match.blocks

    def futures_of(self, blocks: Iterable[CachedBlock]) -> list[Future]:
        return [self.futures[b.key] for b in blocks]

    def kept(self, upto: int) -> list[tuple[BlockRef, Future]]:
        """Whole blocks ending at or before ``upto``: they enter the new state unchanged.

        Their tokens are the request's own: the plugin never sends a block's token ids.
        """
        return [(BlockRef(b.key, b.start, tuple(self.request[b.start:b.end]), b.nbytes), self.futures[b.key])
                for b in self.blocks if b.end <= upto]

    def extended(self, keep: int, more: Sequence[tuple[CachedBlock, Future]]) -> HeldPrefix:
        """The first ``keep`` blocks, then ``more`` (blocks loaded since, with their futures)."""
        blocks = self.blocks[:keep] + tuple(b for b, _ in more)
        futures = {b.key: self.futures[b.key] for b in self.blocks[:keep]}
        futures.update((b.key, f) for b, f in more)
        return HeldPrefix(PrefixMatch(blocks[-1].end if blocks else 0, blocks), futures, self.request, self.snapshot)


@dataclass(slots=True, eq=False)
class PrefixCache:
    client: Client  # owns the futures
    plugin: PluginClient  # answers lookups and acquires
    key_digest: str  # seeds this tenant's chain keys (``state.blocks.keyed_digest``)
    block_size: int  # tokens per block

    def find(self, tokens: Sequence[int], view: bool | str = False) -> HeldPrefix:
        """The longest cached prefix of ``tokens`` in this namespace, asked by its own chain keys.
        ``view``: the planner's snapshot comes in the same round trip (``HeldPrefix.snapshot``;
        ``"uncovered"``: only when tokens are left to prefill)."""
        full = aligned_floor(len(tokens), self.block_size)
        keys = [k for k, _, _ in chain_keys(self.key_digest, tokens[:full], self.block_size,
                                            namespace=self.plugin.session.namespace)]
        match, snapshot = self.plugin.lookup(self.key_digest, keys, tokens, self.block_size, view)
        return HeldPrefix(match, hold_futures(self.client, [b.key for b in match.blocks]), tokens, snapshot)

    def acquire(self, contents: Iterable[str]) -> tuple[dict[str, Future], set[str]]:
        """(content address -> future of the block the scheduler holds or is computing for it,
        the addresses it keeps only released: made again under a fresh key). The rest need a
        task under their own key."""
        answer = self.plugin.acquire(contents)
        futures = hold_futures(self.client, [k for k in answer.values() if k])
        return {c: futures[k] for c, k in answer.items() if k}, {c for c, k in answer.items() if not k}
