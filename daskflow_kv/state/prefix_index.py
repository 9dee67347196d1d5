"""Longest cached prefix by a radix walk over chained block keys. Pure: no tensors.

Full blocks are found by the request's chain keys, looked up one by one (O(blocks)
hashes, no string compare). Past the last full match, the children of the matched block
are scanned for the one sharing the most leading tokens with the request: its K/V up to
that point are exact too (causal attention), so a prefix can be reused to the token, not
only to the block.

The caller computes the chain keys (``blocks.chain_keys``) from its own tokens and the
digest that seeds its keys, so the index never needs a tenant's secret: it only compares
keys it was given with keys it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..keys import content_key
from .blocks import BlockRef, aligned_floor, chain_keys, common_prefix_len



def _root(key_digest: str) -> str:
    # First blocks hang under a root per key digest (model, tokenizer, dtype, namespace and
    # the tenant's secret), so one never matches another's.
    return f"root:{key_digest}"


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    blocks: tuple[BlockRef, ...]  # blocks to load, in order (the last may be used only in part)
    tokens: int  # how many leading request tokens their K/V cover

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(b.key for b in self.blocks)


class PrefixIndex:
    """Which blocks exist, keyed by content and by parent, for prefix lookups."""

    def __init__(self) -> None:
        # Keyed by content address (``keys.content_key``); each block carries its Dask key.
        self._by_key: dict[str, BlockRef] = {}  # content -> block
        self._parent: dict[str, str] = {}  # content -> parent's content (a root for a first block)
        self._children: dict[str, dict[str, BlockRef]] = {}  # parent's content -> its blocks

    def add(self, block: BlockRef, parent_key: str | None, fingerprint_digest: str) -> None:
        """Index ``block`` under its content address (``parent_key``: its parent's content
        address). A block rebuilt under a fresh Dask key takes the place of the one Dask let go."""
        content = content_key(block.key)
        held = self._by_key.get(content)
        if held is not None:
            if held.key == block.key:
                return
            self.remove(held.key)
        parent_key = parent_key or _root(fingerprint_digest)
        self._by_key[content] = block
        self._parent[content] = parent_key
        self._children.setdefault(parent_key, {})[content] = block

    def remove(self, key: str) -> None:
        """Drop Dask key ``key``; a newer key of the same content stays."""
        content = content_key(key)
        block = self._by_key.get(content)
        if block is None or block.key != key:
            return
        del self._by_key[content]
        parent = self._parent.pop(content)
        siblings = self._children.get(parent, {})
        siblings.pop(content, None)
        if not siblings:
            self._children.pop(parent, None)

    def __contains__(self, key: str) -> bool:
        """``key`` is the Dask key its content is indexed under."""
        block = self._by_key.get(content_key(key))
        return block is not None and block.key == key

    def current(self, content: str) -> str | None:
        """The Dask key a content address is indexed under now (None: not indexed)."""
        block = self._by_key.get(content)
        return None if block is None else block.key

    def __len__(self) -> int:
        return len(self._by_key)

    def longest_prefix(self, key_digest: str, tokens: Sequence[int], block_size: int,
                       namespace: str | None = None) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` under ``key_digest`` (keys tagged with ``namespace``)."""
        full = aligned_floor(len(tokens), block_size)
        keys = [k for k, _, _ in chain_keys(key_digest, tokens[:full], block_size, namespace=namespace)]
        return self.match(key_digest, keys, tokens, block_size)

    def match(self, key_digest: str, keys: Sequence[str], tokens: Sequence[int], block_size: int,
              allowed=None) -> PrefixMatch:
        """Walk the request's full-block ``keys`` (its chain, in order), then match its ``tokens``
        past them against the cached children, token by token. ``allowed(block)`` filters."""
        blocks: list[BlockRef] = []
        parent: str | None = None
        for key in keys:
            block = self._by_key.get(key)
            if block is None or (allowed is not None and not allowed(block)):
                break
            blocks.append(block)
            parent = key  # the content address: children hang under it
        pos = len(blocks) * block_size
        best, best_len = None, 0
        for child in self._children.get(parent or _root(key_digest), {}).values():
            if allowed is not None and not allowed(child):
                continue
            n = common_prefix_len(child.token_ids, tokens[pos:])
            if n > best_len:
                best, best_len = child, n
        if best is not None:
            blocks.append(best)
            pos += best_len
        return PrefixMatch(tuple(blocks), pos)
