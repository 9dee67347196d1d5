"""daskflow-kv over modeled workers: the shared tier (a block directory any worker can fetch
from), placements by the runtime's own ``plan_placements``, and under a budget every task
admitted by ``policy.admission.admit`` (evicting ``choose_victims``' blocks, or waiting)."""

from __future__ import annotations

from collections import deque

import numpy as np

from ...policy.admission import ADMIT, FAIL, admit
from ...policy.cluster_view import CachedBlock, ClusterView, PrefixMatch, WorkerLoad
from ...policy.placement import batch_seconds, held_prefix, materialize_policy, plan_placements
from ..blocks import Directory, Held, Ledger, chain
from ..worker import ModeledWorker
from .base import System, prefix_groups


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
