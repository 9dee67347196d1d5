"""Longest cached prefix by a radix walk over chained block keys. Pure: no tensors.

Full blocks are found by recomputing the request's chain keys and looking each one up
(O(blocks) hashes, no string compare). Past the last full match, the children of the
matched block are scanned for the one sharing the most leading tokens with the request:
its K/V up to that point are exact too (causal attention), so a prefix can be reused to
the token, not only to the block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .blocks import BlockRef, block_key, common_prefix_len



def _root(fingerprint_digest: str) -> str:
    # First blocks hang under a per-fingerprint root, so one model never matches another's.
    return f"root:{fingerprint_digest}"


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
        self._by_key: dict[str, BlockRef] = {}  # key -> block
        self._parent: dict[str, str] = {}  # key -> parent key (a root for a first block)
        self._children: dict[str, dict[str, BlockRef]] = {}  # parent key -> its blocks

    def add(self, block: BlockRef, parent_key: str | None, fingerprint_digest: str) -> None:
        if block.key in self._by_key:
            return
        parent_key = parent_key or _root(fingerprint_digest)
        self._by_key[block.key] = block
        self._parent[block.key] = parent_key
        self._children.setdefault(parent_key, {})[block.key] = block

    def remove(self, key: str) -> None:
        block = self._by_key.pop(key, None)
        if block is None:
            return
        parent = self._parent.pop(key)
        siblings = self._children.get(parent, {})
        siblings.pop(key, None)
        if not siblings:
            self._children.pop(parent, None)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def longest_prefix(self, fingerprint_digest: str, tokens: Sequence[int], block_size: int) -> PrefixMatch:
        blocks: list[BlockRef] = []
        parent: str | None = None
        pos = 0
        while pos + block_size <= len(tokens):
            key = block_key(fingerprint_digest, parent, tokens[pos : pos + block_size])
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
            parent, pos = key, pos + block_size
        best, best_len = None, 0
        for child in self._children.get(parent or _root(fingerprint_digest), {}).values():
            n = common_prefix_len(child.token_ids, tokens[pos:])
            if n > best_len:
                best, best_len = child, n
        if best is not None:
            blocks.append(best)
            pos += best_len
        return PrefixMatch(tuple(blocks), pos)
