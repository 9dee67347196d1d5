"""Cache-aware routing for the ``local`` baseline: what an SGLang router gives a fleet of
independent engines. Pure apart from a lock: no Dask, no model.

The router keeps, per worker, the token sequences it sent there (an approximate radix
tree: it assumes the worker's engine still caches them) and the seconds of work it has
queued there. A group of agents sharing a prefix is placed agent by agent on the worker
where that agent would finish first: the worker's queue, plus prefilling whatever part
of the prefix the worker lacks (once per group and worker), plus the batched suffix
prefill and decode of the agents already placed there - the same estimate
(``policy.placement.batch_seconds``) and the same measured prefill profiles the KV
runtime's planner uses, minus what only a distributed KV store can do: fetch the prefix
from another worker. An idle worker with a cold cache therefore prefills the prefix in
parallel rather than queue behind a warm one, and a warm worker is preferred when its
cache saves more than the wait costs.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from ..policy.cost_model import PrefillProfile
from ..policy.placement import batch_seconds
from ..state.blocks import common_prefix_len

_ZERO = PrefillProfile(0.0, 0.0, 0.0)


def _abc(p: PrefillProfile | None) -> dict | None:
    return None if p is None else {"a": p.a, "b": p.b, "c": p.c}


class CacheAwareRouter:
    """Routes groups of prompts over ``workers``; ``profiles``: worker -> PrefillProfile."""

    def __init__(self, workers: Sequence[str], profiles: dict[str, PrefillProfile], remember: int = 512):
        self.workers = list(workers)  # routing order breaks ties
        self.profiles = dict(profiles)  # worker -> measured prefill profile (None: zero cost)
        self.sent: dict[str, deque] = {w: deque(maxlen=remember) for w in self.workers}  # sequences sent there
        self.queued: dict[str, float] = {w: 0.0 for w in self.workers}  # predicted seconds in flight there
        self._lock = threading.Lock()

    def cached(self, worker: str, tokens: Sequence[int]) -> int:
        """Leading tokens of ``tokens`` the worker's engine is assumed to hold."""
        return max((common_prefix_len(s, tokens) for s in self.sent[worker]), default=0)

    def route(self, prefix: Sequence[int], suffixes: Sequence[Sequence[int]], max_new: int) -> dict[str, tuple]:
        """{worker: (member indices, predicted seconds)} for one group; reserves the time."""
        with self._lock:
            n = len(prefix)
            held = {w: min(self.cached(w, prefix), n) for w in self.workers}
            placed: dict[str, list[int]] = {}
            for i, s in enumerate(suffixes):
                best, best_t = None, None
                for w in self.workers:
                    t = self._finish(w, n, held[w], [len(suffixes[j]) for j in placed.get(w, [])] + [len(s)],
                                     max_new)
                    if best_t is None or t < best_t - 1e-9 or (abs(t - best_t) <= 1e-9 and held[w] > held[best]):
                        best, best_t = w, t
                placed.setdefault(best, []).append(i)
            out = {}
            for w, idxs in placed.items():
                t = self._finish(w, n, held[w], [len(suffixes[j]) for j in idxs], max_new) - self.queued[w]
                self.queued[w] += t
                out[w] = (idxs, t)
                self.sent[w].append(tuple(prefix))
            return out

    def _finish(self, w: str, n: int, held: int, suffix_lens: list[int], max_new: int) -> float:
        prof = self.profiles.get(w) or _ZERO
        return self.queued[w] + prof.seconds(n - held, held) + batch_seconds(prof, n, suffix_lens, max_new)

    def priced_by(self) -> dict[str, dict | None]:
        """{worker: {a, b, c}}: the prefill profiles the router prices with now (None: zero
        cost), recorded with each measured row so that a replay prices as it did."""
        return {w: _abc(self.profiles.get(w)) for w in self.workers}

    def done(self, worker: str, predicted_s: float, sequences: Sequence[Sequence[int]] = ()) -> None:
        """A routed group finished: its time leaves the queue, what it cached is remembered."""
        with self._lock:
            self.queued[worker] = max(0.0, self.queued[worker] - predicted_s)
            for s in sequences:
                self.sent[worker].append(tuple(s))

    def forget(self) -> None:
        """The engines were emptied (a cold start)."""
        with self._lock:
            for w in self.workers:
                self.sent[w].clear()
                self.queued[w] = 0.0
