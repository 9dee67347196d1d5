"""A transformers cache layer that grows by doubling instead of concatenating per token.

transformers' ``DynamicLayer.update`` runs ``torch.cat`` on every call, so decoding n tokens
copies the whole cache n times (O(n^2) bytes). ``GrowableLayer`` keeps a buffer with spare
capacity and writes new keys/values in place; ``keys``/``values`` are views of the filled
part, so attention sees exactly what DynamicLayer would have given it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class GrowableLayer(DynamicLayer):
    """One layer's K/V in a preallocated [batch, kv_heads, capacity, head_dim] buffer."""

    def __init__(self, capacity: int = 0, **kwargs):
        super().__init__(**kwargs)
        self._k_buf: torch.Tensor | None = None  # backing storage for keys, capacity >= length
        self._v_buf: torch.Tensor | None = None  # backing storage for values
        self._length = 0  # tokens filled
        self._capacity_hint = capacity  # first allocation size, when known up front

    def _ensure(self, like: torch.Tensor, need: int) -> None:
        if self._k_buf is not None and self._k_buf.shape[-2] >= need:
            return
        cap = max(need, self._capacity_hint, 2 * (self._k_buf.shape[-2] if self._k_buf is not None else 0))
        shape = (*like.shape[:-2], cap, like.shape[-1])
        k = torch.empty(shape, dtype=like.dtype, device=like.device)
        v = torch.empty(shape, dtype=like.dtype, device=like.device)
        if self._length:
            k[..., : self._length, :].copy_(self._k_buf[..., : self._length, :])
            v[..., : self._length, :].copy_(self._v_buf[..., : self._length, :])
        self._k_buf, self._v_buf = k, v

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._ensure(key_states, self._length + n)
        self._k_buf[..., self._length : self._length + n, :].copy_(key_states)
        self._v_buf[..., self._length : self._length + n, :].copy_(value_states)
        self._length += n
        self.keys = self._k_buf[..., : self._length, :]
        self.values = self._v_buf[..., : self._length, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self._length = max(0, self._length + tokens_to_remove)
        if self._k_buf is not None:
            self.keys = self._k_buf[..., : self._length, :]
            self.values = self._v_buf[..., : self._length, :]

    def reset(self) -> None:
        self._k_buf = self._v_buf = None
        self._length = 0
        super().reset()


def growable_cache(num_layers: int, capacity: int = 0) -> Cache:
    """An empty cache of ``num_layers`` growable layers."""
    return Cache(layers=[GrowableLayer(capacity=capacity) for _ in range(num_layers)])


def load_prefix(cache: Cache, per_layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write an existing prefix ([batch, heads, seq, dim] per layer) into an empty cache."""
    for layer, (k, v) in zip(cache.layers, per_layer_kv, strict=True):
        layer.update(k, v)
