"""A modeled worker: the runtime's step loop on a virtual clock.

Each step asks ``policy.step_schedule.plan_step`` - the function the worker's step engine
calls - who runs and how many tokens each feeds (decodes one token each, prefills in
chunks, oldest first, up to ``step_tokens``), and lasts what the worker's prefill profile
says for those feeds (``profile.step_seconds``; decode rows as its ``decode`` profile says,
and a decode-only step pays the host's sharing cost when a ``peer`` - another worker on
its host - is mid-step as it starts), or, given measured step costs (``costs``,
``sim.step_cost``), what its whole shape costs: prompt chunks, decode rows, prefixes copied
in at joins and blocks cut at exits, alone or while a peer steps. A request's last prefill chunk yields its
first token; it is done after ``max_new`` tokens (a prefill-only request, ``max_new`` 0,
when its prompt is in). ``queued_s`` is the predicted work sent here and not finished (what
a router queues against); ``busy_s()`` what the scheduler plugin would report for it
(``policy.queue_estimate``: less the time since the first of that work arrived).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..policy.queue_estimate import queued_seconds
from ..policy.step_schedule import Seq, plan_step
from .loop import EventLoop
from .profile import step_seconds


class Request:
    __slots__ = ("rid", "arrived", "to_prefill", "position", "max_new", "generated", "predicted", "on_done",
                 "first_at", "prefilled", "start")

    def __init__(self, rid: int, to_prefill: int, position: int, max_new: int, predicted: float, on_done):
        self.rid = rid  # unique in the simulation
        self.arrived = 0.0  # virtual s it reached the worker
        self.to_prefill = to_prefill  # prompt tokens not fed yet
        self.position = position  # tokens in its cache so far
        self.max_new = max_new  # tokens to decode (0: prefill only)
        self.generated = 0  # tokens decoded so far
        self.predicted = predicted  # s of work the planner expects it to take (busy_s accounting)
        self.on_done = on_done  # callback(request)
        self.first_at = None  # virtual s of its first token
        self.prefilled = to_prefill  # prompt tokens it prefills in all
        self.start = position  # its cached prefix: copied in as it joins, not cut again as it leaves


class QueueBoard:
    """Every modeled worker's queue in arrays, posted by each worker as requests arrive and
    finish, so that a planner ranks hundreds of workers in a few vector operations (``busy``,
    ``rank``); one by one, that was a third of a 512-worker run."""

    __slots__ = ("sent", "first", "load")

    def __init__(self, n: int):
        self.sent = np.zeros(n)  # each worker's ``queued_s``
        self.first = np.full(n, np.nan)  # its ``first_sent`` (NaN: none)
        self.load = np.zeros(n, dtype=np.int64)  # its ``load``

    def busy(self, now: float, planned=0.0):
        """Every worker's ``policy.queue_estimate.queued_seconds``, as one array: the same
        operations in the same order, so the same floats (tested to the bit; the policy
        package stays free of numpy)."""
        sent = np.maximum(0.0, self.sent - (now - self.first))
        return np.where(np.isnan(self.first), 0.0, sent) + planned

    def rank(self, busy, k: int, ids=None, exclude=()) -> list[int]:
        """The ``k`` workers (of ``ids``; default all) with the least ``busy`` seconds, ties by
        load, then index, less ``exclude``: the order of ``heapq.nsmallest`` on those keys."""
        ids = np.arange(len(self.sent)) if ids is None else np.fromiter(ids, dtype=np.int64)
        order = ids[np.lexsort((ids, self.load[ids], busy[ids]))].tolist()
        return [i for i in order if i not in exclude][:k] if exclude else order[:k]


class ModeledWorker:
    __slots__ = ("idx", "name", "prof", "decode", "costs", "peers", "loop", "step_tokens", "max_running", "waiting",
                 "running", "stepping", "queued_s", "steps", "busy_time", "board", "noise", "rng")

    def __init__(self, idx: int, prof, loop: EventLoop, step_tokens: int = 512, max_running: int = 64,
                 decode=None, costs=None, board: QueueBoard | None = None, noise: float = 0.0, rng=None):
        self.idx = idx  # position in the cluster
        self.name = f"w{idx}"  # its address in ClusterView
        self.prof = prof  # PrefillProfile
        self.decode = decode  # DecodeProfile of decode rows (None: one-token prefills)
        self.costs = costs  # (alone, host shared) StepCost of whole steps, measured; None: prof + decode
        self.peers: tuple[ModeledWorker, ...] = ()  # the other workers on its host
        self.loop = loop
        self.step_tokens = step_tokens  # token budget of a step (daskflow-kv.step.step-tokens)
        self.max_running = max_running  # running requests at most (daskflow-kv.step.max-running)
        self.waiting: deque[Request] = deque()  # in arrival order
        self.running: dict[int, Request] = {}  # rid -> request, in join order
        self.stepping = False  # a step is in flight
        self.queued_s = 0.0  # predicted s of work here, not finished
        self.steps = 0  # forward steps run
        self.busy_time = 0.0  # virtual s spent in steps
        self.board = board  # where it posts its queue (None: nowhere)
        # a step's time: its price times a mean-one lognormal draw of this sigma from ``rng``
        # (None: exactly its price), the scatter measured steps show around the same price
        self.noise, self.rng = noise, rng

    def submit(self, req: Request) -> None:
        req.arrived = self.loop.now
        self.waiting.append(req)
        self.queued_s += req.predicted
        self._post()
        if not self.stepping:
            self._step()

    @property
    def first_sent(self) -> float | None:
        """When the oldest unfinished request sent here arrived: requests join in arrival
        order and ``running`` keeps join order, so it is the first running one, else the
        first waiting one."""
        for r in self.running.values():
            return r.arrived
        return self.waiting[0].arrived if self.waiting else None

    def _post(self) -> None:
        b = self.board
        if b is not None:
            first = self.first_sent
            b.sent[self.idx], b.load[self.idx] = self.queued_s, self.load
            b.first[self.idx] = math.nan if first is None else first

    def busy_s(self) -> float:
        """The scheduler plugin's ``busy_s`` for this worker (``queue_estimate.queued_seconds``)."""
        return queued_seconds(self.queued_s, self.first_sent, self.loop.now)

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def _step(self) -> None:
        running = [Seq(r.rid, r.arrived, r.to_prefill, r.position) for r in self.running.values()]
        room = self.max_running - len(running)
        waiting = []
        if room > 0 and self.waiting:  # plan_step takes the oldest: offer only those that can join
            waiting = [Seq(r.rid, r.arrived, r.to_prefill, r.position)
                       for r in (self.waiting[i] for i in range(min(room, len(self.waiting))))]
        plan = plan_step(running, waiting, self.step_tokens, self.max_running)
        for _ in plan.joined:  # joins are the oldest waiting ones, in order
            r = self.waiting.popleft()
            self.running[r.rid] = r
        run = self.running
        shared = any(q.stepping for q in self.peers)
        if self.costs is not None:
            cost = self.costs[1 if shared else 0].seconds(step_shape(run, plan))
        else:
            cost = step_seconds(self.prof, [(n, run[rid].position) for rid, n in plan.feeds], self.decode, shared)
        if self.rng is not None:
            cost *= scatter(self.rng, self.noise)
        self.stepping = True
        self.steps += 1
        self.busy_time += cost
        self.loop.after(cost, self._end, plan.feeds)

    def _end(self, feeds) -> None:
        now, done = self.loop.now, []
        for rid, n in feeds:
            r = self.running[rid]
            if r.to_prefill:
                r.to_prefill -= n
                r.position += n
                if r.to_prefill == 0 and r.max_new:
                    r.generated, r.first_at = 1, now
            else:
                r.generated += 1
                r.position += 1
            if r.to_prefill == 0 and r.generated >= r.max_new:
                done.append(r)
        for r in done:
            del self.running[r.rid]
            self.queued_s = max(0.0, self.queued_s - r.predicted)
        if done:
            self._post()
        self.stepping = False
        for r in done:
            r.on_done(r)
        if not self.stepping and (self.running or self.waiting):
            self._step()


def scatter(rng, sigma: float) -> float:
    """A mean-one lognormal factor of log-sigma ``sigma``: a step's time over its price."""
    return math.exp(sigma * rng.standard_normal() - sigma * sigma / 2)


def step_shape(running: dict[int, Request], plan) -> dict:
    """What a planned step feeds, as ``model.step_shape.StepShape`` records a real one."""
    shape = dict.fromkeys(("prompt_rows", "prompt_tokens", "prompt_attn", "decode_rows", "decode_keys", "finished",
                           "exported_tokens"), 0)
    shape["joined"] = len(plan.joined)
    shape["loaded_tokens"] = sum(running[rid].position for rid in plan.joined)
    for rid, n in plan.feeds:
        r = running[rid]
        if r.to_prefill:
            shape["prompt_rows"] += 1
            shape["prompt_tokens"] += n
            shape["prompt_attn"] += n * (r.position + n / 2)
            done = r.to_prefill == n and r.max_new <= 1
        else:
            shape["decode_rows"] += 1
            shape["decode_keys"] += r.position
            done = r.generated + 1 >= r.max_new
        if done:
            shape["finished"] += 1
            shape["exported_tokens"] += r.position + n - r.start
    return shape
