"""In-process home of KV block tensors, reference-counted by the states that use them.

One process, one store: the single-process engine keeps blocks here; under Dask each
worker's blocks are task results instead and Dask counts the references. A block lives
while at least one live state refers to it, so forks share blocks and releasing one
branch never frees a prefix that another branch still reads.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..errors import StateReleasedError
from .kv_state import KVState


class BlockStore:
    def __init__(self) -> None:
        self._blocks: dict[str, torch.Tensor] = {}  # key -> [layers, 2, kv_heads, tokens, head_dim]
        self._refs: Counter[str] = Counter()  # key -> number of live states holding it
        self._live: dict[str, tuple[str, ...]] = {}  # state id -> its block keys
        self._owner: dict[str, str] = {}  # key -> id of the state that first stored it
        self.bytes_copied = 0  # tensor bytes written into the store, for copy accounting

    # -- blocks -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._blocks

    def put(self, key: str, tensor: torch.Tensor, owner: str) -> None:
        if key not in self._blocks:  # content-addressed: an equal key is an equal tensor
            self._blocks[key] = tensor
            self._owner[key] = owner
            self.bytes_copied += tensor.numel() * tensor.element_size()

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._blocks[key]
        except KeyError:
            raise StateReleasedError(f"block {key} is not held (released or evicted)") from None

    def owner(self, key: str) -> str | None:
        return self._owner.get(key)

    # -- states -------------------------------------------------------------------------
    def register(self, state: KVState) -> KVState:
        missing = [k for k in state.block_keys if k not in self._blocks]
        if missing:
            raise StateReleasedError(f"state {state.state_id} refers to {len(missing)} blocks not held here")
        self._live[state.state_id] = state.block_keys
        self._refs.update(state.block_keys)
        return state

    def is_live(self, state_id: str) -> bool:
        return state_id in self._live

    def require_live(self, state: KVState) -> None:
        if state.state_id not in self._live:
            raise StateReleasedError(f"state {state.state_id} was released; materialize it again")

    def hold(self, keys) -> list[str]:
        """Reference ``keys`` without a state (a prefill reading them); ``drop`` ends it."""
        keys = list(keys)
        missing = [k for k in keys if k not in self._blocks]
        if missing:
            raise StateReleasedError(f"{len(missing)} blocks are not held (released or evicted)")
        self._refs.update(keys)
        return keys

    def drop(self, keys) -> dict[str, int]:
        """End a ``hold``; returns {key: bytes} of blocks nothing holds any more (freed)."""
        return self._unref(list(keys))

    def release(self, state: KVState) -> dict[str, int]:
        """Drop one state's references; returns {key: bytes} of blocks no other state holds."""
        keys = self._live.pop(state.state_id, None)
        if keys is None:
            return {}
        return self._unref(keys)

    def _unref(self, keys) -> dict[str, int]:
        freed = {}
        self._refs.subtract(keys)
        for k in set(keys):
            if self._refs[k] <= 0:
                del self._refs[k]
                t = self._blocks.pop(k)
                self._owner.pop(k, None)
                freed[k] = t.numel() * t.element_size()
        return freed

    # -- accounting ---------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._blocks.values())

    def __len__(self) -> int:
        return len(self._blocks)

    def refcount(self, key: str) -> int:
        return self._refs.get(key, 0)
