"""A worker's step loop: every running request advances in one forward per step.

Requests from any workflow or client join and leave the running batch at every step
(iteration-level scheduling, Orca OSDI'22); a long prompt is fed in chunks under a token
budget per step so running decodes keep going (chunked prefill, Sarathi-Serve OSDI'24).
Who feeds what is pure policy (``policy.step_schedule.plan_step``); this module is the
mechanism: one thread per engine runs the loop, callers ``submit`` requests from any
thread and wait on the ``concurrent.futures.Future`` they get (a Dask task secedes from
its worker's thread pool meanwhile, see ``runtime.tasks``).

The loop never runs a model itself: every step goes through one ``StepForward``
(``step_forward``: open a request's K/V, run a step of packed feeds, export, close), chosen
per model, all exact:

* packed (fp32, attention patterns ``batched_cache`` reproduces): every request's rows in
  one forward over a ``StepCache``; attention stays per request (``packed_forward``), run by
  the hand-written Llama-family step where the architecture is one it knows
  (``llama_forward``), by the model's own transformers forward otherwise;
* solo (below fp32, or attention it cannot reproduce): each request runs its own forwards
  through ``ModelRunner`` - the chunks ``ModelRunner.run`` would feed, one per step - so its
  tokens and K/V are bit-identical to a single prefill's. Such requests still share the
  loop (a newcomer's prefill interleaves with running decodes), not a forward.

A request's result is ``ModelRunner.run``'s ``RunOutput``: generated tokens, its new blocks
(from the aligned floor of its prefix), logits if asked, and metrics.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field, replace

import torch

from .. import config
from ..policy.step_schedule import Seq, plan_step
from ..state.blocks import aligned_floor
from .lane_pool import MAX_BYTES
from .runner import ModelRunner, RunMetrics, RunOutput
from .sampling import GREEDY, SamplingParams, choose
from .packed_forward import forward_for
from .step_forward import Feed, StepForward
from .step_shape import StepShape

logger = logging.getLogger("daskflow_kv.step_engine")
RECENT_STEPS = 4096  # step shapes kept (``StepEngine.recent``): a few minutes of a busy loop


@dataclass(slots=True)
class StepRequest:
    """One prefill (and decode) for the step loop: ``ModelRunner.run``'s arguments."""

    prefix_blocks: list  # tensors holding at least ``prefix_len`` tokens, read in place
    prefix_len: int  # leading tokens whose K/V come from the blocks
    new_tokens: list[int]  # the prompt's own tokens, fed after the prefix (non-empty)
    max_new_tokens: int = 0  # 0: prefill only
    sampling: SamplingParams = GREEDY
    stream: int = 0  # seeds sampling: a request draws what a single run with this stream draws
    return_logits: bool = False
    export: bool = True  # cut its new blocks at the end
    op: str = ""  # the operator it serves (materialize, resume, recompute, ...): what its tokens are counted as


@dataclass(slots=True)
class _Live:
    """A request inside the engine."""

    rid: int
    req: StepRequest
    future: Future
    arrived: float  # perf_counter at submit
    group: tuple | None = None  # (group id, size): requests submitted together over one prefix
    kv: object = None  # its K/V: the handle ``StepForward.open`` gave (None until it joins)
    fed: int = 0  # prompt tokens fed
    generated: list[int] = field(default_factory=list)
    logits: list = field(default_factory=list)
    gen: object = None  # torch.Generator of its stream (None: greedy)
    metrics: RunMetrics = field(default_factory=RunMetrics)
    joined: float = 0.0  # perf_counter when it joined the running batch
    cancelled: bool = False

    @property
    def position(self) -> int:
        return self.req.prefix_len + self.fed + max(0, len(self.generated) - 1)

    def done(self, eos: set[int]) -> bool:
        if self.fed < len(self.req.new_tokens):
            return False
        g, limit = self.generated, self.req.max_new_tokens
        return len(g) >= limit or (bool(g) and g[-1] in eos)

    def next_tokens(self, n: int) -> list[int]:
        if self.fed < len(self.req.new_tokens):
            return self.req.new_tokens[self.fed : self.fed + n]
        return [self.generated[-1]]


@dataclass(slots=True)
class EngineStats:
    """What the dashboard and /metrics show of one worker's loop."""

    steps: int = 0  # forward steps run
    rows: int = 0  # tokens fed in the last step
    batch: int = 0  # requests that ran in the last step
    step_s: float = 0.0  # seconds the last step took
    waiting: int = 0  # requests waiting to join
    running: int = 0  # requests in the running batch
    completed: int = 0  # requests finished since start
    batch_total: int = 0  # sum of per-step batch sizes (mean batch = batch_total / steps)
    busy_s: float = 0.0  # seconds spent in steps since start (the loop's load, against wall time)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class StepEngine:
    """The step loop of one model in one process. Thread-safe ``submit``; one loop thread."""

    def __init__(self, runner: ModelRunner, step_tokens: int = 512, max_running: int = 64,
                 pool_bytes: int | None = None, forward: str | StepForward | None = None):
        """``forward``: "auto" (the hand-written step where it knows the architecture), "hf"
        (the model's own forward), None (``batching.forward``), or a ``StepForward`` to drive
        (e.g. an emulated engine)."""
        self.runner = runner
        self.step_tokens = int(step_tokens)  # token budget of one step
        self.max_running = int(max_running)  # requests in the running batch at most
        self.pool_bytes = MAX_BYTES if pool_bytes is None else int(pool_bytes)  # the lane pool's bound
        # The forward pass every step goes through (the loop's only way to K/V and logits).
        self.forward = (forward if isinstance(forward, StepForward)
                        else forward_for(runner, self.pool_bytes, forward or config.get("batching.forward")))
        # Why a model runs solo, or None when its requests share packed forwards.
        self.solo_reason = self.forward.solo_reason
        self.stats = EngineStats()
        self._step_t0: float | None = None  # when the step now running began (perf_counter); None between steps
        self._ids = itertools.count()
        self._groups = itertools.count()
        self._cond = threading.Condition()
        self._waiting: deque[_Live] = deque()
        self._running: list[_Live] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self.recent: deque[StepShape] = deque(maxlen=RECENT_STEPS)  # the last steps' shapes and times
        # Prompt tokens fed, by the operator of their request, since start; and of those, the
        # tokens of requests that left without a result (cancelled or failed): work no caller
        # got, which a count of finished tasks never sees.
        self.prompt_fed: Counter[str] = Counter()
        self.prompt_dropped: Counter[str] = Counter()

    # -- the caller's side ----------------------------------------------------------------------
    def submit(self, requests: list[StepRequest], shared_prefix: bool = False) -> list[Future]:
        """Queue ``requests``; one future of ``RunOutput`` each.

        ``shared_prefix``: they continue the same prefix (the forks of one state): packed,
        they hold it once between them.
        """
        for r in requests:
            if not r.new_tokens:
                raise ValueError("a step request needs at least one new token to feed")
            if self.runner.reusable(r.prefix_len) != r.prefix_len:
                raise ValueError(f"a {self.runner.dtype} prefill starts on a block boundary (prefix {r.prefix_len})")
        now = time.perf_counter()
        group = (next(self._groups), len(requests)) if shared_prefix and len(requests) > 1 else None
        live = [_Live(next(self._ids), r, Future(), now, group) for r in requests]
        with self._cond:
            if self._stop:
                raise RuntimeError("the step engine was stopped")
            self._waiting.extend(live)
            self.stats.waiting = len(self._waiting)
            self._ensure_thread()
            self._cond.notify()
        return [x.future for x in live]

    def cancel(self, future: Future) -> None:
        """The request behind ``future`` leaves the batch at the next step."""
        with self._cond:
            for x in [*self._waiting, *self._running]:
                if x.future is future:
                    x.cancelled = True
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="daskflow-kv-step-loop", daemon=True)
            self._thread.start()

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._stop):
                    self._cond.wait()
                if self._stop:
                    self._fail_all(RuntimeError("the step engine was stopped"))
                    return
                self._drop_cancelled()
                plan = plan_step([self._seq(x) for x in self._running], [self._seq(x) for x in self._waiting],
                                 self.step_tokens, self.max_running)
                joining = [x for x in self._waiting if x.rid in set(plan.joined)]
                for x in joining:
                    self._waiting.remove(x)
                self.stats.waiting = len(self._waiting)
            try:
                self._step(joining, plan)
            except Exception as e:  # a bad request must not take the worker's loop down
                self._step_t0 = None
                logger.exception("daskflow-kv step failed")
                for x in [*joining, *self._running]:
                    self._finish(x, error=e)

    def _seq(self, x: _Live) -> Seq:
        return Seq(x.rid, x.arrived, len(x.req.new_tokens) - x.fed, x.position, self.solo_reason is not None,
                   self.forward.align)

    def _drop_cancelled(self) -> None:
        for x in [x for x in self._waiting if x.cancelled]:
            self._waiting.remove(x)
            x.future.set_exception(CancelledError())
        for x in [x for x in self._running if x.cancelled]:
            self._finish(x, error=CancelledError())

    def busy_now(self) -> float:
        """Busy seconds since start, the step now running included as far as it got: a sampler
        that reads ``stats.busy_s`` sees a step's seconds only when it ends, and places them
        up to a sampling interval late (a long step's first intervals look idle)."""
        t0 = self._step_t0
        return self.stats.busy_s + (time.perf_counter() - t0 if t0 is not None else 0.0)

    def _fail_all(self, error: Exception) -> None:
        for x in [*self._waiting, *self._running]:
            self._finish(x, error=error)
        self._waiting.clear()

    def _step(self, joining: list[_Live], plan) -> None:
        t0, started, cpu0 = time.perf_counter(), time.time(), time.thread_time()
        self._step_t0 = t0
        for x in joining:
            self._join(x)
        feeds = {rid: n for rid, n in plan.feeds}
        fed = [x for x in self._running if feeds.get(x.rid)]
        logits: dict[int, torch.Tensor] = {}
        pooled = (0, 0, 0)
        if fed:
            rows = self.forward.run([Feed(x.kv, x.next_tokens(feeds[x.rid]), self._wants_logits(x, feeds[x.rid]))
                                     for x in fed])
            logits = {x.rid: row for x, row in zip(fed, rows)}
            pooled = self.forward.pooled_shape
        wall = time.time()
        shape = self._shape(joining, fed, feeds)
        for x in fed:
            strangers = sum(1 for y in fed if y is not x and (x.group is None or y.group != x.group))
            if strangers and x.fed < len(x.req.new_tokens):
                x.metrics.shared_steps += 1  # its prefill timing is not its own (profiles skip it)
            self._advance(x, feeds[x.rid], logits.get(x.rid), t0, wall)
        done = [x for x in self._running if x.done(self.runner.eos_ids)]
        for x in done:
            self._finish(x)
        st = self.stats
        st.steps += 1
        st.rows, st.batch = sum(feeds[x.rid] for x in fed), len(fed)
        st.batch_total += len(fed)
        st.step_s, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        st.busy_s += st.step_s
        self._step_t0 = None
        st.running = len(self._running)
        bs = self.runner.block_size
        exported = sum(x.position - aligned_floor(x.req.prefix_len, bs) for x in done if x.req.export)
        self.recent.append(replace(shape, finished=len(done), seconds=st.step_s, started=started, cpu=cpu,
                                   pool_rows=pooled[0], pool_slots=pooled[1], pool_width=pooled[2],
                                   exported_tokens=exported))

    @staticmethod
    def _shape(joining: list[_Live], fed: list[_Live], feeds: dict[int, int]) -> StepShape:
        """What this step feeds, taken before it advances anyone."""
        prompt, tokens, attn, rows, keys = 0, 0, 0.0, 0, 0
        for x in fed:
            n, pos = feeds[x.rid], x.position
            if x.fed < len(x.req.new_tokens):
                prompt, tokens, attn = prompt + 1, tokens + n, attn + n * (pos + n / 2)
            else:
                rows, keys = rows + 1, keys + pos
        return StepShape(prompt, tokens, attn, rows, keys, len(joining), sum(x.req.prefix_len for x in joining))

    def _join(self, x: _Live) -> None:
        t0 = time.perf_counter()
        r = x.req
        x.joined = t0
        x.gen = r.sampling.generator(r.stream)
        x.metrics = RunMetrics(tokens_reused=r.prefix_len, tokens_computed=len(r.new_tokens))
        cap = len(r.new_tokens) + max(r.max_new_tokens, 1) - 1
        x.kv = self.forward.open(r.prefix_blocks, r.prefix_len, cap, x.group)
        x.metrics.load_s = time.perf_counter() - t0
        self._running.append(x)

    def _wants_logits(self, x: _Live, n: int) -> bool:
        """Does this step's feed end ``x``'s prompt (or decode a token), with tokens to sample?"""
        return x.req.max_new_tokens > 0 and x.fed + n >= len(x.req.new_tokens)

    def _advance(self, x: _Live, n: int, logits, t0: float, wall: float) -> None:
        prompt = x.fed < len(x.req.new_tokens)
        if prompt:
            x.fed += n
            self.prompt_fed[x.req.op] += n
        if x.fed < len(x.req.new_tokens) or x.req.max_new_tokens == 0:
            return
        r = x.req
        token = choose(logits, r.sampling, x.gen)
        x.generated.append(token)
        if r.return_logits:
            x.logits.append(logits.clone())
        if prompt:  # its first token: the end of its prefill, queueing and shared steps included
            x.metrics.first_token_at = wall
            x.metrics.prefill_s = time.perf_counter() - x.joined - x.metrics.load_s

    def _finish(self, x: _Live, error: BaseException | None = None) -> None:
        if x in self._running:
            self._running.remove(x)
        self.stats.running = len(self._running)
        try:
            if x.future.done():
                return
            if error is not None:
                self.prompt_dropped[x.req.op] += x.fed
                x.future.set_exception(error)
                return
            try:
                x.future.set_result(self._output(x))
                self.stats.completed += 1
            except Exception as e:  # noqa: BLE001 -- export failed: the caller gets why
                x.future.set_exception(e)
        finally:  # after the export read its K/V
            if x.kv is not None:
                self.forward.close(x.kv)
                x.kv = None

    def _output(self, x: _Live) -> RunOutput:
        r, m, rn = x.req, x.metrics, self.runner
        t0 = time.perf_counter()
        m.tokens_generated = len(x.generated)
        if r.max_new_tokens == 0:
            m.prefill_s = t0 - x.joined - m.load_s
            m.first_token_at = time.time()
        else:
            m.decode_s = max(0.0, t0 - x.joined - m.load_s - m.prefill_s)
        fed = r.prefix_len + len(r.new_tokens) + max(0, len(x.generated) - 1)
        blocks = self.forward.export(x.kv, aligned_floor(r.prefix_len, rn.block_size), fed) if r.export else []
        m.export_s = time.perf_counter() - t0
        logits = torch.stack(x.logits) if (r.return_logits and x.logits) else None
        return RunOutput(list(x.generated), fed, blocks, logits, m)
