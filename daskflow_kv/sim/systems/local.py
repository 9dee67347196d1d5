"""The bench's ``local`` baseline over modeled workers: per-worker LRU prefix caches
(``blocks.LRUCache``, as ``bench.local_engine``) behind a cache-aware router, modeled here on
``bench.router.CacheAwareRouter``'s finish estimate over block keys."""

from __future__ import annotations

from collections import deque

from ...policy.placement import batch_seconds
from ..blocks import LRUCache, chain
from .base import System, prefix_groups


class LocalSystem(System):
    """Per-worker LRU prefix caches behind a cache-aware router (``affinity=False``: a
    router that ignores caches and balances load only)."""

    name = "local"
    REMEMBER = 512  # sequences the router remembers per worker (CacheAwareRouter's default)

    def __init__(self, *a, affinity: bool = True, **kw):
        super().__init__(*a, **kw)
        self.affinity = affinity
        retain = self.budget if self.budget is not None else 2 << 30  # local_engine.DEFAULT_RETAIN
        self.caches = [LRUCache(retain) for _ in self.workers]
        self.sent = [deque() for _ in self.workers]  # chains the router sent there (its radix tree, approximated)
        self.seen: dict[str, dict[int, int]] = {}  # block key -> {worker: remembered chains holding it}
        self.rqueued = [0.0] * len(self.workers)  # the router's own queue estimate per worker
        self.priced = [self.profile.worker_router(w.idx) for w in self.workers]  # what the router prices with
        self._sid = 0

    def _remember(self, w: int, blocks) -> None:
        keys = tuple(k for k, _, _ in blocks)
        self.sent[w].append(keys)
        for k in keys:
            d = self.seen.setdefault(k, {})
            d[w] = d.get(w, 0) + 1
        if len(self.sent[w]) > self.REMEMBER:
            for k in self.sent[w].popleft():
                d = self.seen[k]
                d[w] -= 1
                if not d[w]:
                    del d[w]

    def _router_held(self, w: int, blocks) -> int:
        n = 0
        for k, _, end in blocks:
            if w not in self.seen.get(k, ()):
                break
            n = end
        return n

    def run_level(self, f, calls) -> None:
        for plen, members in prefix_groups(calls):
            self._route(f, plen, members)

    def _route(self, f, plen, members) -> None:
        seg = members[0].segments
        blocks = chain(seg, plen)
        suffixes = [c.prompt_tokens - plen for c in members]
        max_new = max(c.max_new for c in members)
        if len(self.workers) <= self.full_pool:
            cands = self.workers
        else:
            holders = set(self.seen.get(blocks[0][0], ())) if blocks else set()
            cands = [self.workers[i] for i in sorted(holders)] + self.least_busy(self.pool, holders)
        held = {w.idx: (min(self._router_held(w.idx, blocks), plen) if self.affinity else 0) for w in cands}
        placed: dict[int, list[int]] = {}
        for i, s in enumerate(suffixes):
            best = best_t = None
            for w in cands:
                t = self._finish(w, plen, held[w.idx], [suffixes[j] for j in placed.get(w.idx, [])] + [s], max_new)
                if best_t is None or t < best_t - 1e-9 or (abs(t - best_t) <= 1e-9 and held[w.idx] > held[best.idx]):
                    best, best_t = w, t
            placed.setdefault(best.idx, []).append(i)
        for wi, idxs in placed.items():
            w = self.workers[wi]
            t = self._finish(w, plen, held[wi], [suffixes[j] for j in idxs], max_new) - self.rqueued[wi]
            self.rqueued[wi] += t
            self._remember(wi, blocks)
            self._run_group(f, w, plen, blocks, [members[j] for j in idxs], t)

    def _finish(self, w, n, held, suffix_lens, max_new) -> float:
        prof = self.priced[w.idx]
        return self.rqueued[w.idx] + prof.seconds(n - held, held) + batch_seconds(prof, n, suffix_lens, max_new)

    def _run_group(self, f, w, plen, blocks, members, predicted) -> None:
        """``local_engine.run_group``: the prefix from this engine's cache, prefilling what it
        lacks, then the members as one batch; the prefix is reusable here from the moment it
        is materialized, and kept (with the branches) when all are done."""
        cache = self.caches[w.idx]
        state = {"left": len(members)}
        self._sid += 1
        prefix_sid, rows = f"p{self._sid}", tuple((k, (e - s) * self.bpt) for k, s, e in blocks)

        def branch_done(r, c):
            state["left"] -= 1
            if state["left"] == 0:  # run_group returns: the engine keeps the prefix and the branches
                self.rqueued[w.idx] = max(0.0, self.rqueued[w.idx] - predicted)
                cache.keep(prefix_sid, rows)  # most recently used again
                for m in members:
                    self._sid += 1
                    cache.keep(f"s{self._sid}", ((f"s{self._sid}", (m.prompt_tokens - plen + m.max_new) * self.bpt),))
                    self._remember(w.idx, blocks)
            self._call_done(f)

        def start_branches(_=None):
            # The engine's store holds a materialized prefix from then on: another group on
            # this worker reuses it while these branches still decode (``Engine._prefill``).
            cache.keep(prefix_sid, rows)
            share = predicted / max(1, len(members))
            for m in members:
                self._request(w, m.prompt_tokens - plen, plen, m.max_new, share,
                              lambda r, m=m: branch_done(r, m), delay=0.0)

        def begin():  # the task reached its worker: the engine looks its prefix up now
            have = min(cache.cached(blocks), plen)
            if plen > have:  # the engine's materialize: prefill what its cache lacks
                self._request(w, plen - have, have, 0, 0.0, start_branches, delay=0.0)
            else:
                start_branches()

        self.loop.after(self.profile.task_overhead_s, begin)
