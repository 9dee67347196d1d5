"""Content-addressed KV blocks: pure arithmetic over token ids, no tensors.

A block holds the K and V of ``block_size`` consecutive tokens for every layer. Its key is
a hash chained over the fingerprint, the previous block's key and the block's token ids,
as in vLLM's prefix caching: two requests that share a prefix produce the same keys for
it, on any worker, so "is this prefix cached?" is a dictionary lookup per block and a
Dask key that is already in memory is never computed twice.

Blocks are aligned to multiples of ``block_size``; only a state's last block may be
partial. A partial block's key covers its tokens exactly, so it never collides with the
full block that later replaces it.

The default block size (``daskflow-kv.block-size`` in dask.config) is 64 tokens. Each block is one Dask key, so the size trades per-key
overhead (scheduler bookkeeping, ~14 ms per dependency fetched across workers) against
reuse granularity (a cached prefix is found to the block boundary; at most 63 tokens are
re-prefilled) and copy size (SmolLM2: 64 tokens x 46 KB = 2.9 MB, large enough for the
comm layer to run near bandwidth; an 8K context is 128 keys).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Sequence

from .. import keys as key_names

_ROOT = "root"  # the parent key of a state's first block


def keyed_digest(fingerprint_digest: str, secret: str | None) -> str:
    """The digest that seeds a tenant's block keys: HMAC(secret, fingerprint digest).

    Without the secret nobody can compute the keys of a known prompt, so a second user of
    the scheduler can neither guess another tenant's keys nor confirm that a prompt is
    cached. No secret (a single trust domain) leaves the digest as it is.
    """
    if secret is None:
        return fingerprint_digest
    msg = b"daskflow-kv/block-keys/v1|" + fingerprint_digest.encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()[:32]


def block_key(fingerprint_digest: str, parent_key: str | None, token_ids: Sequence[int],
              namespace: str | None = None) -> str:
    """Content address of one block; a valid Dask key (a string).

    ``namespace``: whose block it is, tagged into the key (``keys.namespace_tag``) so the
    scheduler plugin runs a task under it only for that namespace; None leaves it untagged.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(fingerprint_digest.encode())
    h.update((parent_key or _ROOT).encode())
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    return key_names.block_key(h.hexdigest(), namespace)


@dataclass(frozen=True, slots=True)
class BlockRef:
    """Where one block sits in a sequence; the tensor itself lives in a store or a worker."""

    key: str  # content address (see block_key)
    start: int  # position of the block's first token
    token_ids: tuple[int, ...]  # the tokens whose K/V the block holds
    nbytes: int  # tensor bytes, for transfer cost and memory accounting

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def is_full(self, block_size: int) -> bool:
        return len(self.token_ids) == block_size


def split_spans(start: int, end: int, block_size: int) -> list[tuple[int, int]]:
    """Aligned [s, e) spans covering [start, end); ``start`` must be block-aligned."""
    if start % block_size:
        raise ValueError(f"span start {start} is not a multiple of block size {block_size}")
    return [(s, min(s + block_size, end)) for s in range(start, end, block_size)]


def chain_keys(
    fingerprint_digest: str,
    tokens: Sequence[int],
    block_size: int,
    start: int = 0,
    parent_key: str | None = None,
    namespace: str | None = None,
) -> list[tuple[str, int, int]]:
    """(key, start, end) of every block of ``tokens[start:]``, chained from ``parent_key``
    (``namespace``: see ``block_key``)."""
    out = []
    parent = parent_key
    for s, e in split_spans(start, len(tokens), block_size):
        parent = block_key(fingerprint_digest, parent, tokens[s:e], namespace)
        out.append((parent, s, e))
    return out


def aligned_floor(n: int, block_size: int) -> int:
    return n - n % block_size


def reusable_prefix(cached: int, block_size: int, aligned: bool) -> int:
    """How many cached tokens a prefill may start after: all of them, or with ``aligned``
    (models below fp32) only whole blocks, so the rest is fed in text mode's chunks."""
    return aligned_floor(cached, block_size) if aligned else cached


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
