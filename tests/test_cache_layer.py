"""The growable cache layer writes in place: no whole-cache copy per decoded token."""

import torch

from daskflow_kv.model.cache_layer import GrowableLayer, growable_cache


def test_decode_appends_in_place_without_reallocation():
    layer = GrowableLayer(capacity=64)
    k = torch.randn(1, 2, 10, 8)
    layer.update(k, k.clone())
    ptr = layer.keys.data_ptr()
    for _ in range(40):
        step = torch.randn(1, 2, 1, 8)
        keys, _ = layer.update(step, step)
        assert keys.data_ptr() == ptr  # same storage: nothing was copied
        assert torch.equal(keys[..., -1:, :], step)
    assert layer.get_seq_length() == 50 and torch.equal(layer.keys[..., :10, :], k)


def test_growth_doubles_and_keeps_contents():
    layer = GrowableLayer()
    chunks = [torch.randn(1, 2, n, 4) for n in (3, 5, 9, 17)]
    reallocations, ptr = 0, None
    for c in chunks + [torch.randn(1, 2, 1, 4) for _ in range(30)]:
        layer.update(c, c)
        if layer.keys.data_ptr() != ptr:
            reallocations, ptr = reallocations + 1, layer.keys.data_ptr()
    assert reallocations <= 5  # logarithmic in length, not one per token
    assert torch.equal(layer.keys[..., :3, :], chunks[0])


def test_crop_and_cache_length():
    cache = growable_cache(2, capacity=8)
    for layer in cache.layers:
        layer.update(torch.ones(1, 1, 6, 2), torch.ones(1, 1, 6, 2))
    for layer in cache.layers:
        layer.crop(-2)
    assert cache.get_seq_length() == 4
