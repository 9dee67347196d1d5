"""The systems simulated over modeled workers: daskflow-kv, ``local`` and text replay.

Each is a scheduler over the same ``ModeledWorker``s and runs a workflow level by level (the
executor's order): a level's agents that share leading segments form a prefix group.

``TextSystem``  text replay: every agent prefills its whole prompt on the least busy worker.
``LocalSystem`` the bench's ``local`` baseline: per-worker LRU prefix caches
                (``blocks.LRUCache``, as ``bench.local_engine``) behind a cache-aware router.
                The router is modeled here (``bench.router.CacheAwareRouter`` lives in the
                bench and compares token lists): the same finish estimate - queue + missing
                prefix prefill + ``policy.placement.batch_seconds`` - over block keys.
``DaskflowSystem`` daskflow-kv: the shared tier (a block directory any worker can fetch
                from), materialize placed by ``plan_placements`` under ``materialize_policy``, branches by
                ``plan_placements`` (earliest finish; transfer vs recompute from
                ``cost_model.decide``), and under a budget every task admitted by
                ``policy.admission.admit`` (evicting ``choose_victims``' blocks, or waiting).

Above ``full_pool`` workers a router or planner considers the workers holding the prefix
(daskflow-kv: its ``pool`` least busy holders) plus the ``pool`` least busy ones (the runtime
scores every worker; pruning keeps the simulation fast at 512 workers and changes nothing
at 2 or 8).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..policy.admission import ADMIT, FAIL, admit
from ..policy.cluster_view import CachedBlock, ClusterView, PrefixMatch, WorkerLoad
from ..policy.placement import batch_seconds, held_prefix, materialize_policy, plan_placements
from ..policy.workflow_gate import GateLine, gate_slots
from .blocks import LRUCache, Directory, Held, Ledger, chain, common_prefix
from .loop import EventLoop
from .worker import ModeledWorker, QueueBoard, Request


def prefix_groups(calls) -> list[tuple[int, list]]:
    """(prefix tokens, members) per group of a level's calls sharing their first segment."""
    by_first: dict[str, list] = {}
    for c in calls:
        by_first.setdefault(c.segments[0][0], []).append(c)
    return [(common_prefix([c.segments for c in m]), m) for m in by_first.values()]


class _Flow:
    """A running workflow."""

    __slots__ = ("wf", "levels", "level", "pending", "started", "done_at", "failed")

    def __init__(self, wf):
        self.wf = wf
        self.levels = wf.levels()
        self.level = -1  # the level running
        self.pending = 0  # its calls not finished
        self.started = math.nan  # virtual s it passed the gate (its arrival when there is none)
        self.done_at = math.nan  # virtual s it finished
        self.failed = None  # why it failed, if it did


class System:
    name = "?"

    def __init__(self, profile, n_workers: int, budget: int | None = None, step_tokens: int = 512,
                 max_running: int = 64, pool: int = 8, full_pool: int = 16, gate: float | None = None):
        self.profile = profile  # SimProfile
        self.loop = EventLoop()
        self.board = QueueBoard(n_workers)
        self.workers = [ModeledWorker(i, profile.worker_prefill(i), self.loop, step_tokens, max_running, profile.decode,
                                      profile.step_costs, self.board, profile.step_noise,
                                      np.random.default_rng([profile.noise_seed, i]) if profile.step_noise else None)
                        for i in range(n_workers)]
        per_host = max(1, profile.workers_per_host)
        for w in self.workers:  # hosts of ``workers_per_host`` consecutive workers, as measured
            h = w.idx // per_host * per_host
            w.peers = tuple(q for q in self.workers[h:h + per_host] if q is not w)
        self.budget = budget  # KV bytes per worker (None: unbounded)
        self.bpt = profile.bytes_per_token
        self.pool = pool  # least busy workers a placement considers beyond the prefix's holders
        self.full_pool = full_pool  # up to this many workers, every worker is considered
        self.flows: list[_Flow] = []
        self.prefilled = 0  # prompt tokens prefilled
        self.transfers = 0
        self.bytes_transferred = 0
        self.evictions = 0
        self._rid = 0
        # The runtime's workflow gate (``policy.workflow_gate``): at most ``gate`` running
        # workflows per worker, the rest waiting in line (None: every one starts when it arrives).
        self.slots = gate_slots(gate, n_workers)
        self.line = GateLine()

    # -- driving -------------------------------------------------------------------------
    def run(self, workflows) -> list[_Flow]:
        for wf in workflows:
            f = _Flow(wf)
            self.flows.append(f)
            self.loop.at(wf.at, self._arrive, f)
        self.loop.run()
        return self.flows

    def _arrive(self, f: _Flow) -> None:
        self.line.arrive(f)  # its latency counts any wait here: it runs from its arrival
        self._start(self.line.admit(self.slots))

    def _start(self, admitted: list[_Flow]) -> None:
        for f in admitted:
            f.started = self.loop.now
            self._next_level(f)

    def _next_level(self, f: _Flow) -> None:
        f.level += 1
        if f.level >= len(f.levels) or f.failed:
            f.done_at = self.loop.now
            if not f.failed:  # a failed one left when it failed
                self._leave(f)
            return
        calls = f.levels[f.level]
        f.pending = len(calls)
        self.run_level(f, calls)

    def _leave(self, f: _Flow) -> None:
        """``f`` is done or failed: its place goes to the next workflow waiting at the gate."""
        self.line.leave(f)
        self._start(self.line.admit(self.slots))

    def _call_done(self, f: _Flow) -> None:
        f.pending -= 1
        if f.pending == 0:
            self._next_level(f)

    def _request(self, w: ModeledWorker, to_prefill: int, position: int, max_new: int, predicted: float, on_done,
                 delay: float | None = None) -> Request:
        self._rid += 1
        r = Request(self._rid, to_prefill, position, max_new, predicted, on_done)
        self.prefilled += to_prefill
        self.loop.after(self.profile.task_overhead_s if delay is None else delay, w.submit, r)
        return r

    def _busy(self, w: ModeledWorker) -> float:
        """Predicted seconds queued on ``w``, as the system's router or planner sees them."""
        return w.queued_s

    def _busy_all(self):
        """``_busy`` of every worker, as an array (``QueueBoard.rank`` orders by it)."""
        return self.board.sent

    def least_busy(self, k: int, exclude=()) -> list[ModeledWorker]:
        """The ``k`` least busy workers (ties: fewer requests, then index), less ``exclude``."""
        if len(self.workers) <= k:
            return [w for w in self.workers if w.idx not in exclude]
        return [self.workers[i] for i in self.board.rank(self._busy_all(), k, exclude=exclude)]

    def run_level(self, f: _Flow, calls) -> None:
        raise NotImplementedError

    def peak_kv(self) -> list[int]:
        return [0] * len(self.workers)


class TextSystem(System):
    """Text replay: no reuse; each agent's whole prompt on the least busy worker."""

    name = "text"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        # predicted s sent to each worker and not finished, counted when sent: a worker's own
        # queue counts a request only once it arrives (a hop later), so a level's agents all
        # went to one worker, where the measured text replay spreads them over both
        self.sent = [0.0] * len(self.workers)

    def run_level(self, f, calls) -> None:
        for c in calls:
            w = min(self.workers, key=lambda w: (self.sent[w.idx], w.load, w.idx))
            n = c.prompt_tokens
            pred = w.prof.seconds(n) + max(0, c.max_new - 1) * w.prof.seconds(1, n)
            self.sent[w.idx] += pred
            self._request(w, n, 0, c.max_new, pred, lambda r, f=f, w=w, pred=pred: self._text_done(f, w, pred))

    def _text_done(self, f, w, pred) -> None:
        self.sent[w.idx] = max(0.0, self.sent[w.idx] - pred)
        self._call_done(f)


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


class _Producer:
    """The materialize that first made some blocks: what Dask runs again to get one back."""

    __slots__ = ("worker", "blocks", "reads", "shape")

    def __init__(self, worker: int, blocks: tuple, reads: tuple, shape: tuple):
        self.worker = worker  # where it ran (its task's worker restriction)
        self.blocks = blocks  # (key, start, end) of every block it made
        self.reads = reads  # the cached blocks it read
        self.shape = shape  # (tokens prefilled, prefix position, 0)


class _Ready:
    """Something that will be true at some virtual time (a prefix on a worker): callbacks."""

    __slots__ = ("done", "waiters")

    def __init__(self, done: bool = False):
        self.done = done
        self.waiters: list = []

    def then(self, fn) -> None:
        if self.done:
            fn()
        else:
            self.waiters.append(fn)

    def fire(self) -> None:
        self.done = True
        for fn in self.waiters:
            fn()
        self.waiters = []


def _all(readies: list[_Ready]) -> _Ready | None:
    """A ``_Ready`` that fires once every one of ``readies`` has; None for none."""
    if not readies:
        return None
    out = _Ready()
    left = [sum(1 for r in readies if not r.done)]

    def one():
        left[0] -= 1
        if left[0] == 0:
            out.fire()

    if left[0] == 0:
        out.fire()
    for r in readies:
        if not r.done:
            r.then(one)
    return out


class _Uniform(dict):
    """Every (src, dst) pair at one value: a plain mapping for ``ClusterView``'s links."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def get(self, key, default=None):
        return self.value


class DaskflowSystem(System):
    """daskflow-kv: shared tier, transfer vs recompute, budget admission and eviction."""

    name = "daskflow-kv"

    def __init__(self, *a, policy: str = "auto", count_planned: bool = True, lineage: bool = False, **kw):
        super().__init__(*a, **kw)
        self.policy = policy  # plan_placements' policy for branches: auto | transfer | recompute | pin
        # False (the runtime since 2026-12-07): a lookup stops at an evicted block, and the
        # planner prefills what is missing under a fresh key (``keys.rebuilt_key``). True: the
        # rule before, when a lookup still found a block Dask kept as lineage and reading it made
        # Dask run its producer - the whole materialize that made it - again on that worker,
        # unplanned (measured: the prefill events of an ungated row, ``bench.prefill_ledger``).
        self.lineage = {} if lineage else None  # block key -> _Producer of its first run
        self.reruns = 0  # producers run again
        # The runtime's busy_s (plugins/kv_queue) counts a task from its plan on, also while it
        # waits for its inputs; False counts it only once sent, the rule before 2026-12-01.
        self.count_planned = count_planned
        self.planned = [0.0] * len(self.workers)  # predicted s of tasks planned here, not sent yet
        self.dir = Directory()
        # block key -> (worker making it, fired once made): lookups see blocks still being
        # made, as the plugin's do, so a second workflow over a document waits for the first's
        # prefill (or fetches it) instead of prefilling it again
        self.pending: dict[str, tuple[int, _Ready]] = {}
        self.ledgers = [Ledger() for _ in self.workers]
        self.parked: list[deque] = [deque() for _ in self.workers]  # tasks waiting for budget room
        self.admitted = [0] * len(self.workers)  # admitted tasks not finished, per worker
        self.failed = 0
        self.decisions: dict[str, int] = {}
        prof = self.profile
        if len(self.workers) <= 2 and prof.links:
            names = [w.name for w in self.workers]
            self._bw = {(names[i], names[j]): lp.bandwidth for (i, j), lp in prof.links.items() if j < len(names)}
            self._lat = {(names[i], names[j]): lp.latency for (i, j), lp in prof.links.items() if j < len(names)}
        else:
            self._bw, self._lat = _Uniform(prof.link.bandwidth), _Uniform(prof.link.latency)

    def peak_kv(self) -> list[int]:
        return [lg.peak for lg in self.ledgers]

    # -- the view the planner sees -------------------------------------------------------
    def _view(self, pool) -> ClusterView:
        workers = {w.name: WorkerLoad(1, w.load, self.ledgers[w.idx].held, self._busy(w)) for w in pool}
        return ClusterView(workers, self._bw, {w.name: w.prof for w in pool}, latency=self._lat,
                           kv_budget_bytes=self.budget)

    def _busy(self, w) -> float:
        """The plugin's ``busy_s``: sent work less its progress (``w.busy_s()``), plus planned."""
        return w.busy_s() + (self.planned[w.idx] if self.count_planned else 0.0)

    def _busy_all(self):
        return self.board.busy(self.loop.now, np.asarray(self.planned) if self.count_planned else 0.0)

    def _match(self, blocks, f=None) -> PrefixMatch:
        """What the plugin's lookup answers for ``blocks``; with ``f`` (the workflow acquiring
        them), a block found only in lineage is acquired: its producer runs again."""
        out, n = [], 0
        prune, chosen = len(self.workers) > self.full_pool, []
        for k, s, e in blocks:
            hs = self.dir.holders(k)
            if prune and len(hs) > self.pool:
                # a hot prefix held by hundreds of workers: the planner sees its ``pool`` least
                # busy holders (the same ones block after block while they hold it), as it sees
                # the ``pool`` least busy workers beyond them; ranking every holder for every
                # branch was most of a 512-worker run
                sel = [i for i in chosen if i in hs]
                if len(sel) < self.pool:
                    chosen = sel = self.board.rank(self._busy_all(), self.pool, hs)
                hs = sel
            if hs:
                names = tuple(self.workers[i].name for i in sorted(hs))
                out.append(CachedBlock(k, s, e, (e - s) * self.bpt, names, names))
            elif k in self.pending:  # being made: no holder yet, ``where`` its planned worker
                out.append(CachedBlock(k, s, e, (e - s) * self.bpt, (), (self.workers[self.pending[k][0]].name,)))
            elif f is not None and self.lineage and k in self.lineage:
                w = self._rerun(f, self.lineage[k])
                out.append(CachedBlock(k, s, e, (e - s) * self.bpt, (), (self.workers[w].name,)))
            else:
                break
            n = e
        return PrefixMatch(n, tuple(out))

    def _rerun(self, f, p: _Producer) -> int:
        """Dask runs producer ``p`` again on its worker (its task's restriction), making the blocks
        of it no worker holds; -> that worker. A read of ``p`` that no worker holds either is
        Dask's to get back first: its own producer runs again (a cascade), and ``p`` waits."""
        w = self.workers[p.worker]
        gone = tuple(b for b in p.blocks if not self.dir.holders(b[0]) and b[0] not in self.pending)
        ready = _Ready()
        for k, _, _ in gone:
            self.pending[k] = (w.idx, ready)
        self.reruns += 1
        inputs = []
        for k, _, _ in p.reads:
            if self.dir.holders(k):
                continue
            if k not in self.pending and k in self.lineage:
                self._rerun(f, self.lineage[k])
            if k in self.pending:
                inputs.append(self.pending[k][1])
        to_prefill, position, _ = p.shape
        pred = w.prof.seconds(to_prefill, position)

        def run():
            self._task(f, w, gone, p.reads, p.shape, pred, ready.fire)

        after = _all(inputs)
        if after is None:
            run()
        else:
            after.then(run)
        return w.idx

    def _in_flight(self, blocks, upto: int) -> _Ready | None:
        """Fires once every block below ``upto`` that is still being made exists; None: none is."""
        return _all([self.pending[k][1] for k, s, _ in blocks if s < upto and k in self.pending])

    def _pool(self, match, extra=()) -> list[ModeledWorker]:
        if len(self.workers) <= self.full_pool:
            return self.workers
        hold = {int(w[1:]) for b in match.blocks[:1] + match.blocks[-1:] for w in b.where} | set(extra)
        return [self.workers[i] for i in sorted(hold)] + self.least_busy(self.pool, hold)

    # -- a level ---------------------------------------------------------------------------
    def run_level(self, f, calls) -> None:
        for plen, members in prefix_groups(calls):
            self._group(f, plen, members)

    def _group(self, f, plen, members) -> None:
        blocks = chain(members[0].segments, plen)
        match = self._match(blocks, f)
        pool = self._pool(match)
        view = self._view(pool)
        cached = match.tokens
        # materialize: placed as the runtime places it (pin on the cached part, or earliest finish)
        [p] = plan_placements(view, match, [cached], 1, policy=materialize_policy(view, cached, plen - cached),
                              new_tokens=[max(1, plen - cached)], max_new_tokens=0)
        t = self.workers[int(p.worker[1:])]
        made = self._deliver(f, t, blocks, match, cached, p.decision)  # the cached part, onto t
        mat = _Ready(plen <= cached and made.done)
        if plen > cached:
            new = blocks[len(match.blocks):]
            made_by = _Producer(t.idx, tuple(new), tuple(blocks[:len(match.blocks)]), (plen - cached, cached, 0))
            for k, _, _ in new:
                self.pending.setdefault(k, (t.idx, mat))
                if self.lineage is not None:
                    self.lineage.setdefault(k, made_by)  # a key keeps its first run spec, as in Dask
            pred = t.prof.seconds(plen - cached, cached)
            self.planned[t.idx] += pred
            # ``pred`` bound now: the name is reused for the branches below, and a materialize
            # waiting for its cached part (made by another workflow) runs after they are planned
            made.then(lambda pred=pred: self._task(f, t, made_by.blocks, made_by.reads, made_by.shape, pred,
                                                   mat.fire, planned=pred))
            view = view.with_queue(t.name, self._busy(t) if self.count_planned else t.busy_s() + pred)
        elif not mat.done:
            made.then(mat.fire)
        # the branches: every block is (or will be) on t
        rows = []
        for i, (k, s, e) in enumerate(blocks):
            if i < len(match.blocks):
                b = match.blocks[i]
                rows.append(CachedBlock(k, s, e, b.nbytes, b.who_has, tuple(sorted(set(b.where) | {t.name}))))
            else:  # being made by the materialize on t
                rows.append(CachedBlock(k, s, e, (e - s) * self.bpt, (), (t.name,)))
        full = PrefixMatch(plen, tuple(rows))
        if len(self.workers) > self.full_pool and t not in pool:
            pool = pool + [t]
            view = self._view(pool).with_queue(t.name, view.busy(t.name))
        suffixes = [c.prompt_tokens - plen for c in members]
        max_new = max(c.max_new for c in members)
        places = plan_placements(view, full, [plen] * len(members), len(members), policy=self.policy,
                                 new_tokens=suffixes, max_new_tokens=max_new)
        ready: dict[str, _Ready] = {}
        by_worker: dict[str, list] = {}
        for pl, c in zip(places, members):
            by_worker.setdefault(pl.worker, []).append(c)
        for name, cs in by_worker.items():
            w = self.workers[int(name[1:])]
            d = next(pl.decision for pl in places if pl.worker == name)
            self.decisions[d.action if d else "none"] = self.decisions.get(d.action if d else "none", 0) + 1
            if w is t:
                r = mat
            else:
                r = self._deliver(f, w, blocks, full, plen, d, src_ready=mat)
            pred = batch_seconds(w.prof, plen, [c.prompt_tokens - plen for c in cs], max_new) / len(cs)
            self.planned[w.idx] += pred * len(cs)
            for c in cs:
                r.then(lambda w=w, c=c, pred=pred: self._task(
                    f, w, (self._own_block(f, c, blocks),), blocks,
                    (c.prompt_tokens - plen, plen, c.max_new), pred, lambda: self._call_done(f), planned=pred))

    def _own_block(self, f, c, blocks):
        """The blocks a branch adds: its own prompt tokens and its output, one modeled block."""
        start = blocks[-1][2] if blocks else 0
        return (f"own:{f.wf.index}:{c.name}", start, c.prompt_tokens + c.max_new)

    def _deliver(self, f, w, blocks, match, reused, d, src_ready: _Ready | None = None) -> _Ready:
        """The first ``reused`` tokens' blocks onto ``w`` as decision ``d`` says."""
        have = held_prefix(match, reused, w.name) if reused else 0
        missing = [b for b in blocks if b[2] <= reused and b[1] >= have and w.idx not in self.dir.holders(b[0])]
        wait = self._in_flight(blocks, reused)
        if d is None or d.action == "reuse" or not missing:
            return wait or _Ready(True)  # everything it reads is on w already, or will be when made
        if wait is not None and d.action == "transfer":
            src_ready = _all([r for r in (src_ready, wait) if r is not None])
        out = _Ready()
        reads = [b for b in blocks if b[2] <= have]
        if d.action == "transfer":
            src = self.workers[int(d.src[1:])]

            def fetch():
                secs = self.profile.pair(src.idx, w.idx).seconds(d.nbytes)
                self.transfers += 1
                self.bytes_transferred += d.nbytes
                self._admit(f, w, missing, reads, lambda need: self.loop.after(secs, done, need))

            def done(need):
                self._made(w, missing, reads, need)
                out.fire()

            (src_ready or _Ready(True)).then(fetch)
        else:  # recompute on w from what it holds
            n = reused - have
            self._task(f, w, missing, reads, (n, have, 0), w.prof.seconds(n, have), out.fire)
        return out

    # -- tasks under the budget --------------------------------------------------------------
    def _task(self, f, w, new_blocks, reads, shape, pred, then, planned: float = 0.0) -> None:
        """A prefill/resume task on ``w`` making ``new_blocks`` and reading ``reads``: admitted,
        run in the step loop, its blocks added when it ends. ``planned``: the seconds its plan
        counted on ``w`` (from now on its queue counts it)."""
        to_prefill, position, max_new = shape
        self.planned[w.idx] -= planned

        def go(need):
            def end(_r):
                self._made(w, new_blocks, reads, need)
                then()

            self._request(w, to_prefill, position, max_new, pred, end)

        self._admit(f, w, new_blocks, reads, go)

    def _admit(self, f, w, new_blocks, reads, go, pinned: bool = False) -> None:
        """``policy.admission.admit`` for a task adding ``new_blocks`` to ``w``: evict its
        victims and go, or wait in line (its reads stay pinned: a waiting task's inputs are,
        eviction rule 1) until a task on ``w`` ends. A task that could never fit fails its
        workflow, as the runtime fails it."""
        lg = self.ledgers[w.idx]
        need = sum((e - s) * self.bpt for k, s, e in new_blocks if k not in lg.blocks)
        if not pinned:
            for k, _, _ in reads:
                b = lg.blocks.get(k)
                if b is not None:
                    b.pins += 1
        if self.budget is not None:
            a = admit(need, lg.held, lg.reserved, self.budget, lg.usage(), self.loop.now, busy=True, worker=w.name)
            if a.action != ADMIT:
                if a.action == FAIL or self.admitted[w.idx] == 0:  # nothing running here can free room
                    if not f.failed:  # its other calls never finish: it leaves now
                        f.failed = a.reason
                        self._leave(f)
                    self.failed += 1
                    for k, _, _ in new_blocks:  # never made here: whoever waits for them goes on
                        if self.pending.get(k, (None,))[0] == w.idx:
                            self.pending.pop(k)[1].fire()
                    return
                self.parked[w.idx].append((f, new_blocks, reads, go))
                return
            for k in a.victims:
                self._evict(w, k)
        lg.reserved += need
        lg.note_peak()
        self.admitted[w.idx] += 1
        go(need)

    def _made(self, w, new_blocks, reads, need) -> None:
        lg, now = self.ledgers[w.idx], self.loop.now
        lg.reserved -= need
        for k, _, _ in new_blocks:
            if self.pending.get(k, (None,))[0] == w.idx:
                del self.pending[k]
        parent = reads[-1][0] if reads else None
        for k, s, e in new_blocks:
            if k not in lg.blocks:
                lg.blocks[k] = Held(k, (e - s) * self.bpt, parent, s, now)
                lg.held += (e - s) * self.bpt
                self.dir.add(k, w.idx)
            parent = k
        for k, _, _ in reads:
            b = lg.blocks.get(k)
            if b is not None:
                b.pins = max(0, b.pins - 1)
                b.reuse_count += 1
                b.last_access = now
        lg.note_peak()
        self.admitted[w.idx] -= 1
        self._unpark(w)

    def _evict(self, w, key) -> None:
        lg = self.ledgers[w.idx]
        b = lg.blocks.pop(key)
        lg.held -= b.nbytes
        self.dir.drop(key, w.idx)
        self.evictions += 1

    def _unpark(self, w) -> None:
        q = self.parked[w.idx]
        for _ in range(len(q)):  # retry in order; one that still cannot fit parks again, behind
            f, new_blocks, reads, go = q.popleft()
            self._admit(f, w, new_blocks, reads, go, pinned=True)
