"""Functions that run on Dask workers for the baselines and the memory measurements.

* ``hf_recipe``: the Hugging Face prefix-cache recipe, in one task per worker: prefill the
  shared prompt once into a ``DynamicCache``, then per branch ``copy.deepcopy`` the cache
  and ``model.generate`` greedily (what the transformers docs recommend for a shared prompt).
  The prompt cache may be kept for the next run with the same prefix (warm runs).
* the ``local`` baseline (a per-worker engine with prefix cache and batched decode) is in
  ``bench.local_engine``.
* ``start_sampler`` / ``stop_sampler``: a thread in the worker process that samples its RSS
  every 10 ms and the bytes of KV keys it holds (blocks, replicas, prefill outputs) every 50 ms.

Every baseline uses the model the worker already loaded for the KV runtime
(``runtime.tasks.get_runner``), so every system runs the very same weights.
"""

from __future__ import annotations

import copy
import ctypes
import threading
import time

import torch

from ..dask_internals import clear_incoming_transfers, in_memory, incoming_transfers
from ..keys import holds_kv
from ..runtime import tasks



def address_or_local() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:
        return "local"


def _cache_nbytes(cache) -> int:
    n = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                n += t.numel() * t.element_size()
    return n


class _FirstToken:
    """A generate() streamer that only notes when the first new token came out."""

    def __init__(self):
        self.calls = 0
        self.first_at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_at is None:  # call 1 is the prompt
            self.first_at = time.time()

    def end(self) -> None:
        pass


_HF_PROMPTS: dict[tuple, object] = {}  # prefix tokens -> DynamicCache kept between runs (``keep``)


def clear_hf(dask_worker=None) -> int:
    """Forget the HF recipe's kept prompt caches (a cold start); returns how many."""
    n = len(_HF_PROMPTS)
    _HF_PROMPTS.clear()
    malloc_trim()
    return n


def hf_recipe(spec: tasks.ModelSpec, prefix: list[int], branches: list[tuple[int, list[int]]],
              max_new_tokens: int, keep: bool = True) -> dict:
    """Prefill ``prefix`` once, then per (index, suffix): deepcopy the cache and generate.

    ``keep``: the prompt cache stays in this process for the next run with the same prefix
    (exact match only, the one it holds last), as a server applying the recipe would keep it.
    """
    from transformers import DynamicCache

    runner = tasks.get_runner(spec)
    model, dev = runner.model, runner.device
    eos = sorted(runner.eos_ids)
    start = time.time()
    key = (spec, tuple(prefix))
    cache = _HF_PROMPTS.get(key)
    computed = 0
    if cache is None:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([prefix], device=dev), cache=cache, use_cache=True, logits_to_keep=1)
        computed = len(prefix)
        _HF_PROMPTS.clear()
        if keep:
            _HF_PROMPTS[key] = cache
    prefix_done = time.time()
    prefix_bytes = _cache_nbytes(cache)
    out, peak_copy, copy_s = [], 0, 0.0
    for index, suffix in branches:
        t0 = time.time()
        branch_cache = copy.deepcopy(cache)
        t1 = time.time()
        ids = torch.tensor([list(prefix) + list(suffix)], device=dev)
        streamer = _FirstToken()
        with torch.inference_mode():
            seq = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), cache=branch_cache,
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None,
                temperature=None, top_p=None, top_k=None, streamer=streamer,
            )
        t2 = time.time()
        first = streamer.first_at or t2
        peak_copy = max(peak_copy, _cache_nbytes(branch_cache))
        copy_s += t1 - t0
        out.append({
            "index": index, "tokens": seq[0, ids.shape[1]:].tolist(), "first_token_at": first,
            "copy_s": t1 - t0, "prefill_s": first - t1, "decode_s": t2 - first, "start": t0, "stop": t2,
            "copied_bytes": prefix_bytes, "tokens_computed": len(suffix),
        })
        del branch_cache
    return {
        "worker": address_or_local(), "start": start, "prefix_prefill_s": prefix_done - start,
        "prefix_ready_at": prefix_done, "prefix_tokens_computed": computed,
        "prefix_bytes": prefix_bytes, "peak_kv_bytes": prefix_bytes + peak_copy, "copy_s": copy_s,
        "branches": out, "stop": time.time(),
    }


# -- memory sampling (client.run targets) ---------------------------------------------------
_SAMPLER: dict = {}


def malloc_trim() -> bool:
    """Give freed heap back to the OS so RSS starts from what is live (glibc only)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except OSError:
        return False


def held_kv_bytes(dask_worker) -> int:
    """KV tensor bytes the worker holds in Dask's memory: every block, replica and prefill
    output, each storage counted once (a block cut from an output shares its tensor)."""
    seen, total = set(), 0
    data = in_memory(dask_worker)
    for _ in range(5):  # the worker's loop mutates the dict; retry a torn iteration
        try:
            held = [k for k in list(data.keys()) if holds_kv(k)]
            break
        except RuntimeError:
            continue
    else:
        return 0
    for key in held:
        try:
            value = data[key]
        except KeyError:  # freed meanwhile
            continue
        for t in _tensors(value):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    for attr in ("blocks", "outputs"):  # PrefillOutput.blocks, BatchPrefillOutput.outputs
        for v in getattr(value, attr, None) or ():
            yield from _tensors(v)


def start_sampler(dask_worker=None, interval: float = 0.01) -> int:
    """Start sampling RSS and held KV bytes; returns the RSS at start (after a malloc_trim)."""
    import psutil

    stop_sampler()
    malloc_trim()
    proc = psutil.Process()
    state = {"start_rss": proc.memory_info().rss, "peak_rss": 0, "peak_kv": 0, "start_kv": 0, "samples": 0}
    state["start_kv"] = held_kv_bytes(dask_worker) if dask_worker is not None else 0
    stop = threading.Event()

    def loop():
        tick = 0
        while not stop.is_set():
            state["peak_rss"] = max(state["peak_rss"], proc.memory_info().rss)
            # walking the worker's keys holds the GIL (~0.3 ms for 60 keys): every 5th tick
            # only, so the sampler barely slows the model thread of the system that holds KV in Dask
            if dask_worker is not None and tick % 5 == 0:
                state["peak_kv"] = max(state["peak_kv"], held_kv_bytes(dask_worker))
            state["samples"] += 1
            tick += 1
            stop.wait(interval)

    th = threading.Thread(target=loop, name="daskflow-bench-sampler", daemon=True)
    _SAMPLER.update(state=state, stop=stop, thread=th)
    th.start()
    return state["start_rss"]


def stop_sampler(dask_worker=None) -> dict:
    """Stop the sampler; {start_rss, peak_rss, peak_kv, start_kv, samples} (bytes).
    One last KV sample is taken at the stop: a run shorter than the sampling period (or
    one whose sampler thread the model thread starved) still counts what it left held."""
    if not _SAMPLER:
        return {}
    _SAMPLER["stop"].set()
    _SAMPLER["thread"].join(timeout=2)
    state = dict(_SAMPLER["state"])
    if dask_worker is not None:
        state["peak_kv"] = max(state["peak_kv"], held_kv_bytes(dask_worker))
    _SAMPLER.clear()
    return state


def clear_transfer_log(dask_worker) -> None:
    clear_incoming_transfers(dask_worker)


def transfer_log(dask_worker) -> list[dict]:
    """The worker's record of incoming transfers: start, stop, duration, total, keys, who."""
    return [
        {"start": e.get("start"), "stop": e.get("stop"), "duration": e.get("duration"), "total": e.get("total"),
         "who": e.get("who"), "keys": {str(k): v for k, v in (e.get("keys") or {}).items()}}
        for e in incoming_transfers(dask_worker)
    ]


def make_tensor(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random fp32 tensor (random so no transport could compress it)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32)


def make_array(shape: tuple[int, ...], seed: int = 0):
    """Random fp32 NumPy array: the same bytes as ``make_tensor(shape)``."""
    import numpy as np

    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def nbytes_of(*objs) -> int:
    """Depends on its inputs (so Dask moves them here); returns their byte count."""
    n = 0
    for o in objs:
        n += o.numel() * o.element_size() if isinstance(o, torch.Tensor) else getattr(o, "nbytes", 0)
    return n
