"""How many workers share one prefill, and where their chunks end. Pure: numbers in, a plan out.

Parallel materialize (KV-Runahead, ICML 2024) splits the tokens a prefill must compute into
W chunks, one per worker. The worker of chunk i attends to the K/V of chunks < i, which
reach it layer by layer while they are produced, so all W compute at once and the last
lags the first by about a layer, not by a chunk. Two choices, on the fitted prefill
profile t(n, p) = a + b n + c n (p + n/2) and the measured link:

* ``chunk_spans``: block-aligned chunk ends such that every chunk costs the same. A later
  chunk attends to a longer prefix, so it is shorter.
* ``choose_parallelism``: the width W whose pipeline (``predict_seconds``: simulated layer by
  layer, hand-off latency and bytes included) finishes first; W = 1 unless some W > 1 is
  predicted faster by at least ``min_gain``, so it is never chosen when it would be slower.

Workers are taken in address order, the same total order for every materialize: a chunk
only ever waits for a worker earlier in that order, so concurrent parallel prefills sharing
workers cannot wait on each other in a circle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .cost_model import DEFAULT_LATENCY, LinkProfile, PrefillProfile

HANDOFF_LATENCY = 0.005  # s per layer message besides its bytes (pooled worker RPC, loopback; measured: SmolLM2
# layers of 4.7 MB took 14-16 ms on a loaded 2-core machine, ~9 ms of it the bytes at 0.5 GB/s)


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    workers: tuple[str, ...]  # one per chunk, in chunk order (address order)
    spans: tuple[tuple[int, int], ...]  # each chunk's [start, end) in prompt positions
    seconds: float  # predicted prefill time of this plan
    single_seconds: float  # predicted time on one worker, for comparison
    reason: str  # one sentence, for explain()

    @property
    def width(self) -> int:
        return len(self.workers)


def _max_tokens(profile: PrefillProfile, prefix: float, budget: float) -> float:
    """Most new tokens after ``prefix`` whose prefill fits in ``budget`` seconds."""
    a, b, c = profile.a, profile.b, profile.c
    if budget <= a:
        return 0.0
    if c == 0:
        return math.inf if b == 0 else (budget - a) / b
    lin = b + c * prefix  # solve c/2 m^2 + lin m + (a - budget) = 0 for m >= 0
    return (-lin + math.sqrt(lin * lin + 2 * c * (budget - a))) / c


def _equal_cost_bounds(start: int, end: int, profiles: Sequence[PrefillProfile]) -> list[float]:
    """Real-valued chunk ends that give every chunk the same predicted cost (bisection)."""

    def ends(budget: float) -> list[float]:
        out, pos = [], float(start)
        for prof in profiles[:-1]:
            pos = min(float(end), pos + _max_tokens(prof, pos, budget))
            out.append(pos)
        return out

    def fits(budget: float) -> bool:
        last = (ends(budget) or [float(start)])[-1]
        return profiles[-1].seconds(end - last, int(last)) <= budget if end > last else True

    lo, hi = 0.0, max(p.seconds(end - start, start) for p in profiles)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return ends(hi)


def chunk_spans(start: int, end: int, profiles: Sequence[PrefillProfile], block_size: int) -> list[tuple[int, int]]:
    """[start, end) cut into ``len(profiles)`` chunks of equal predicted cost (fewer if too few blocks).

    Chunk i runs on the worker whose profile is ``profiles[i]`` and attends to everything
    before it. Inner boundaries fall on the block grid, so each chunk is whole blocks (the
    first may begin, and the last end, inside one), at least one block each. A profile that
    sees no cost in tokens (b = c = 0, a noisy fit of tiny prefills) splits by token count.
    """
    if end <= start:
        return []
    first = (start // block_size + 1) * block_size  # the first boundary the grid allows
    room = max(0, (end - 1) // block_size * block_size - first) // block_size + 1 if first < end else 0
    width = min(len(profiles), room + 1)
    if width <= 1:
        return [(start, end)]
    profiles = list(profiles[:width])
    if all(p.b == 0 and p.c == 0 for p in profiles):
        profiles = [PrefillProfile(0.0, 1.0, 0.0)] * width
    bounds = []
    for k, x in enumerate(_equal_cost_bounds(start, end, profiles), start=1):
        lo = first + (k - 1) * block_size if not bounds else bounds[-1] + block_size
        hi = first + (room - (width - k)) * block_size  # leave a block for every later chunk
        bounds.append(min(hi, max(lo, int(round(x / block_size)) * block_size)))
    edges = [start, *bounds, end]
    return list(zip(edges[:-1], edges[1:]))


def chunk_sizes(n: int, width: int, profile: PrefillProfile, block_size: int = 1, prefix: int = 0) -> list[int]:
    """Tokens per chunk when ``width`` alike workers split ``n`` tokens after ``prefix`` cached ones."""
    return [e - s for s, e in chunk_spans(prefix, prefix + n, [profile] * width, block_size)]


def predict_seconds(spans: Sequence[tuple[int, int]], profiles: Sequence[PrefillProfile], link: LinkProfile | None,
                    bytes_per_token: int, num_layers: int, handoff_latency: float = HANDOFF_LATENCY,
                    start_seconds: Sequence[float] | None = None) -> float:
    """Predicted wall time of the chunks prefilled as a pipeline.

    Chunk i's layer l starts when its layer l-1 is done and the layer-l K/V of every chunk
    j < i have arrived. Those leave j when j starts layer l (they are its first product
    there) and cross the j -> i link one layer after another (a layer waits for the link to
    finish the previous one), plus ``handoff_latency``. ``start_seconds``: when each chunk's
    task can begin (e.g. after fetching cached prefix blocks).
    """
    layers = max(1, num_layers)
    n = len(spans)
    starts = list(start_seconds or [0.0] * n)
    if n == 1:
        (s, e), prof = spans[0], profiles[0]
        return starts[0] + prof.seconds(e - s, s)
    per_layer = [(p.seconds(e - s, s) - p.a) / layers for (s, e), p in zip(spans, profiles)]
    xfer = [((e - s) * bytes_per_token / layers / link.bandwidth) if link else 0.0 for s, e in spans]
    ready = [t0 + p.a for t0, p in zip(starts, profiles)]  # when each chunk may begin its next layer
    free = [[0.0] * n for _ in range(n)]  # when the j -> i link is done with what it carries
    arrive = [[0.0] * n for _ in range(n)]  # when j's current layer reaches i
    for _ in range(layers):
        for i in range(n):
            began = max([ready[i]] + [arrive[j][i] for j in range(i)])
            ready[i] = began + per_layer[i]
            for k in range(i + 1, n):  # this layer's K/V leave for every later chunk now
                free[i][k] = max(began, free[i][k]) + xfer[i]
                arrive[i][k] = free[i][k] + handoff_latency
    overhead = link.latency if link else DEFAULT_LATENCY  # one more task round trip to collect
    return max(ready) + overhead


def _plan(workers: Sequence[str], start: int, end: int, profiles: dict[str, PrefillProfile],
          link: LinkProfile | None, bytes_per_token: int, num_layers: int, block_size: int,
          fetch: dict[str, float]) -> tuple[tuple[str, ...], list[tuple[int, int]], float]:
    order = sorted(workers)  # the global order: see the module docstring
    spans = chunk_spans(start, end, [profiles[w] for w in order], block_size)
    order = order[: len(spans)]
    secs = predict_seconds(spans, [profiles[w] for w in order], link, bytes_per_token, num_layers,
                           start_seconds=[fetch.get(w, 0.0) for w in order])
    return tuple(order), spans, secs


def choose_parallelism(start: int, end: int, target: str, candidates: Sequence[str],
                       profiles: dict[str, PrefillProfile], link: LinkProfile | None, bytes_per_token: int,
                       num_layers: int, block_size: int, min_gain: float = 0.1, width: int | None = None,
                       prefix_bytes: int = 0) -> ParallelPlan:
    """The plan for prefilling positions [start, end) (after ``start`` cached tokens).

    ``target``: the worker a single prefill would run on (it holds any cached prefix);
    ``candidates``: other workers that may join (idle ones, for an automatic choice).
    ``width``: None chooses W (the fastest predicted, 1 unless W > 1 is at least
    ``min_gain`` faster); an integer forces it, as far as workers and blocks allow.
    ``prefix_bytes``: cached prefix K/V every helper fetches from ``target`` first.
    """
    single = profiles[target].seconds(end - start, start)
    one = ParallelPlan((target,), ((start, end),), single, single, "one worker")
    pool = [target] + [w for w in dict.fromkeys(candidates) if w != target]
    fetch = {w: (link.seconds(prefix_bytes) if (link and prefix_bytes) else 0.0) for w in pool if w != target}
    widths = range(2, len(pool) + 1) if width is None else [min(width, len(pool))]
    best = None
    for w in widths:
        if w < 2:
            continue
        workers, spans, secs = _plan(pool[:w], start, end, profiles, link, bytes_per_token, num_layers, block_size,
                                     fetch)
        if len(spans) > 1 and (best is None or secs < best[2]):
            best = (workers, spans, secs)
    if best is None:
        return ParallelPlan(one.workers, one.spans, single, single,
                            "one worker: no other worker, or too few blocks to split")
    workers, spans, secs = best
    plan = ParallelPlan(workers, tuple(spans), secs, single,
                        f"{len(workers)} workers predicted {secs:.3f}s vs {single:.3f}s on one")
    if width is not None or secs <= (1.0 - min_gain) * single:
        return plan
    return ParallelPlan(one.workers, one.spans, single, single,
                        f"one worker: {len(workers)} predicted {secs:.3f}s, not {min_gain:.0%} under {single:.3f}s")


__all__ = ["HANDOFF_LATENCY", "ParallelPlan", "choose_parallelism", "chunk_sizes", "chunk_spans", "predict_seconds"]
