"""Compat(Sa, Sb): may these two be combined, or this state be used by that model?

Pure checks on descriptors. Every operator calls one of them before touching tensors, so a
mismatch fails with a message naming the field, not with a silently wrong continuation.
"""

from __future__ import annotations

from typing import Sequence

from ..keys import content_key
from .blocks import common_prefix_len
from ..validation import token_ids
from ..errors import ContextTooLongError, IncompatibleStateError, MergeError
from .fingerprint import Fingerprint
from .kv_state import KVState


def check_state_for_model(state: KVState, fingerprint: Fingerprint, block_size: int) -> None:
    """The state's blocks were made by this exact model/tokenizer/dtype/rope/namespace."""
    diffs = state.fingerprint.differences(fingerprint)
    if state.block_size != block_size:
        diffs.append(f"block_size: {state.block_size} != {block_size}")
    if diffs:
        raise IncompatibleStateError(
            f"state {state.state_id} was made for {state.fingerprint.model_id} and cannot be used here", diffs
        )


def check_pair(a: KVState, b: KVState) -> None:
    """Both states were made under one fingerprint and block size."""
    diffs = a.fingerprint.differences(b.fingerprint)
    if a.block_size != b.block_size:
        diffs.append(f"block_size: {a.block_size} != {b.block_size}")
    if diffs:
        raise MergeError(f"states {a.state_id} and {b.state_id} are incompatible", diffs)


def check_positions(length: int, new_tokens: int, max_new_tokens: int, max_positions: int) -> None:
    total = length + new_tokens + max_new_tokens
    if total > max_positions:
        raise ContextTooLongError(
            f"{length} cached + {new_tokens} new + {max_new_tokens} generated = {total} tokens "
            f"exceeds the model's {max_positions} positions"
        )


def check_tokens(tokens: Sequence[int], vocab_size: int) -> None:
    """Kept for existing callers; the check lives in ``daskflow_kv.validation.token_ids``."""
    token_ids("tokens", tokens, vocab_size)


def check_concat(a: KVState, b: KVState) -> None:
    """``b`` continues ``a`` exactly: same chain of block keys over a's tokens, related lineage.

    Block keys chain over the fingerprint and every earlier token, so equal keys at a's last
    full block prove b's K/V were computed attending to exactly a's prefix.
    """
    check_pair(a, b)
    a_tokens, b_tokens = a.tokens, b.tokens
    p = common_prefix_len(a_tokens, b_tokens)
    if p < len(a_tokens):
        raise MergeError(
            f"cannot concatenate {a.state_id} and {b.state_id}",
            [f"divergent: they differ at position {p}; {b.state_id} was not computed on top of {a.state_id}"],
        )
    full = [blk for blk in a.blocks if blk.is_full(a.block_size)]
    b_keys = {content_key(k) for k in b.block_keys}  # a block made again has a fresh Dask key
    if any(content_key(blk.key) not in b_keys for blk in full):
        raise MergeError(f"cannot concatenate {a.state_id} and {b.state_id}", ["block chains differ"])
    if not (a.ancestors() & b.ancestors()):
        raise MergeError(
            f"cannot concatenate {a.state_id} and {b.state_id}",
            ["lineage: the states share no ancestor, so contiguity cannot be proven"],
        )
