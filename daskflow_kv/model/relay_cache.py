"""A cache layer that takes earlier chunks' K/V from elsewhere, one layer at a time.

Parallel materialize prefills one prompt as W chunks at once, one per worker: at every
layer, the worker of chunk i needs the keys and values of all earlier chunks for that
layer. ``RelayLayer`` lets the model's own forward do the hand-off, whatever the
architecture: when attention gives it a layer's new K/V (``update``), it first passes them
on (``send``: later chunks may start that layer while this one waits), then waits for the
earlier chunks' K/V of the layer (``recv``) and returns [prefix | earlier | own] as any
cache would. Position ids and masks come out right because the layer counts the earlier
chunks' tokens (``pending``) before they have arrived.

Transport-agnostic: ``send`` and ``recv`` are plain callables (a worker-to-worker channel on
Dask, a queue in tests). Nothing here knows about workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from .cache_layer import GrowableLayer

# recv(layer) -> [(keys, values), ...] of the earlier chunks in order; send(layer, keys, values)
Recv = Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]
Send = Callable[[int, torch.Tensor, torch.Tensor], None]


class RelayLayer(GrowableLayer):
    """A growable layer that, once armed, relays its own K/V and splices in earlier chunks'."""

    def __init__(self, layer_idx: int, capacity: int = 0):
        super().__init__(capacity=capacity)
        self._idx = layer_idx  # which layer recv/send speak for
        self._pending = 0  # tokens of earlier chunks still to arrive before the own ones
        self._recv: Recv | None = None
        self._send: Send | None = None
        self.waited_s = 0.0  # seconds spent in recv (waiting for another worker)

    def arm(self, pending: int, recv: Recv | None, send: Send | None) -> None:
        """From now on ``update`` relays (loading a cached prefix before this must not)."""
        self._pending, self._recv, self._send = pending, recv, send

    def get_seq_length(self) -> int:
        return super().get_seq_length() + self._pending

    def update(self, key_states, value_states, *args, **kwargs):
        if self._send is not None:
            self._send(self._idx, key_states, value_states)
        if self._pending:
            t0 = time.perf_counter()
            parts = self._recv(self._idx)
            self.waited_s += time.perf_counter() - t0
            got = sum(k.shape[-2] for k, _ in parts)
            if got != self._pending:
                raise ValueError(f"layer {self._idx}: received K/V of {got} tokens, expected {self._pending}")
            self._pending = 0
            for k, v in parts:
                super().update(k.to(key_states.device, key_states.dtype), v.to(value_states.device, value_states.dtype))
        return super().update(key_states, value_states)


def relay_cache(num_layers: int, capacity: int = 0) -> Cache:
    """An empty cache of relay layers (they behave as growable layers until armed)."""
    return Cache(layers=[RelayLayer(i, capacity=capacity) for i in range(num_layers)])


def arm(cache: Cache, pending: int, recv: Recv | None, send: Send | None) -> None:
    for layer in cache.layers:
        layer.arm(pending, recv, send)


def waited_seconds(cache: Cache) -> float:
    return sum(layer.waited_s for layer in cache.layers)
