"""What the KV page plots live: workflows per minute, TTFT p50/p95, hit rate, and batch size and
KV bytes per worker, over the last ``KEEP_S`` seconds.

Workflows finished, as their runtimes report them (``kv_workflow_done``: each agent's TTFT,
the executor's definition - from the workflow's start to the agent's first token), go into
one bounded ring per namespace (the namespace only when tenants are configured; an open
cluster is one trust domain). Every ``SAMPLE_S`` seconds the plugin takes a ``Sample``: KV
bytes per worker, each worker's step-loop counters (steps, sum of batch sizes), each
namespace's token counters (reused, computed) and - computed there, once, so that a page
poll costs no more than reading them - the trailing ``WINDOW_S`` seconds' workflows per
minute and TTFT percentiles of each namespace and of everyone (``window``).

``series`` turns the samples into the plots' columns, a plain function of plain data (tested
without a cluster): per sample, the scope's window, the hit rate of its tokens since the last
sample before the window (tokens reused / prompt tokens), and per worker the mean batch since
the previous sample and the KV bytes then. A tenant's columns are its own namespace's;
batch size and KV bytes per worker are cluster totals, as on the rest of the page;
``timings=False`` (a browser that has not logged in) leaves the TTFTs out.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from daskflow_kv import validation
from daskflow_kv.stats import percentile

SAMPLE_S = 2.0  # seconds between two samples
KEEP_S = 600.0  # seconds of history kept (the plots' x range)
WINDOW_S = 60.0  # trailing window of the rates and percentiles
MAX_TTFTS = 8192  # agents' TTFTs kept per namespace: one tenant's reports cannot push out another's
MAX_AGENTS = 1024  # agents one report may list


@dataclass(frozen=True, slots=True)
class Finished:
    at: float  # scheduler's wall clock when the report arrived
    ttft_s: tuple[float, ...]  # one per agent


@dataclass(frozen=True, slots=True)
class Window:
    """One scope's trailing window at a sample."""

    workflows_per_min: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    kv_bytes: dict[str, int]  # worker -> KV bytes in memory
    steps: dict[str, int]  # worker -> its step loop's steps so far
    batch_total: dict[str, int]  # worker -> sum of its steps' batch sizes so far
    tokens: dict[str | None, tuple[int, int]]  # namespace -> (reused, computed) so far
    everyone: Window = Window()
    by_namespace: dict[str | None, Window] | None = None


def workflow_report(agents, ttft_s) -> tuple[float, ...]:
    """A runtime's report of one finished workflow, checked (it comes from a client)."""
    agents = validation.integer("agents", agents, minimum=1, maximum=MAX_AGENTS)
    if not isinstance(ttft_s, (list, tuple)) or len(ttft_s) > agents:
        raise ValueError("ttft_s must be a list of at most one TTFT per agent")
    return tuple(validation.number("ttft_s", t, minimum=0, maximum=1e6) for t in ttft_s)


def _quantile(xs: list[float], q: float) -> float | None:
    v = percentile(xs, q)
    return None if math.isnan(v) else v


def window(finished: list[Finished], span_s: float) -> Window:
    """Workflows per minute and TTFT percentiles of the workflows ``finished`` in a window of
    ``span_s`` seconds (a young history's window is shorter than ``WINDOW_S``)."""
    ttfts = [t for f in finished for t in f.ttft_s]
    return Window(len(finished) * 60.0 / span_s, _quantile(ttfts, 0.5), _quantile(ttfts, 0.95))


def _tokens(sample: Sample, namespace: str | None, everyone: bool) -> tuple[int, int]:
    if everyone:
        return (sum(r for r, _ in sample.tokens.values()), sum(c for _, c in sample.tokens.values()))
    return sample.tokens.get(namespace, (0, 0))


def series(samples: list[Sample], namespace: str | None = None, everyone: bool = True, timings: bool = True,
           window_s: float = WINDOW_S) -> dict:
    """The plots' columns at each sample time (see the module). ``everyone``: every namespace's
    workflows and tokens (the admin's, an open cluster's, totals); else ``namespace``'s."""
    out = {"t": [], "workflows_per_min": [], "ttft_p50_s": [], "ttft_p95_s": [], "hit_rate": []}
    workers = sorted({w for s in samples for w in s.kv_bytes})
    per_worker = {w: {"kv_bytes": [], "batch": []} for w in workers}
    back = 0  # index of the first sample inside the trailing window
    for i, s in enumerate(samples):
        while samples[back].at < s.at - window_s:
            back += 1
        w = s.everyone if everyone else (s.by_namespace or {}).get(namespace, Window())
        # Counters are totals: the window's tokens are the difference from the last sample
        # before it (the oldest one kept while the history is younger than the window).
        reused_now, computed_now = _tokens(s, namespace, everyone)
        reused_then, computed_then = _tokens(samples[max(back - 1, 0)], namespace, everyone)
        reused, prompt = reused_now - reused_then, (reused_now - reused_then) + (computed_now - computed_then)
        out["t"].append(s.at)
        out["workflows_per_min"].append(w.workflows_per_min)
        out["ttft_p50_s"].append(w.ttft_p50_s if timings else None)
        out["ttft_p95_s"].append(w.ttft_p95_s if timings else None)
        out["hit_rate"].append(reused / prompt if prompt > 0 else None)
        prev = samples[i - 1] if i else s  # the first sample has no interval before it
        for addr in workers:
            steps = s.steps.get(addr, 0) - prev.steps.get(addr, 0)
            total = s.batch_total.get(addr, 0) - prev.batch_total.get(addr, 0)
            per_worker[addr]["kv_bytes"].append(s.kv_bytes.get(addr))
            # No step in the interval is no batch (0); counters that went back are a restarted loop.
            per_worker[addr]["batch"].append(None if not i else (total / steps if steps > 0 and total >= 0 else 0.0))
    out["workers"] = per_worker
    return out


class KVTimeline:
    """The rings ``series`` reads; the plugin records reports and takes samples."""

    __slots__ = ("_done", "_ttfts", "_samples", "_started", "_received")

    def __init__(self):
        self._done: dict[str | None, deque[Finished]] = {}  # namespace -> its finished workflows, oldest first
        self._ttfts: dict[str | None, int] = {}  # namespace -> TTFTs its ring holds
        self._samples: deque[Sample] = deque()  # the last KEEP_S seconds, oldest first
        self._started: float | None = None  # the first sample's time: how long the history is
        self._received = 0  # reports accepted since the plugin started

    def workflow_done(self, at: float, namespace: str | None, agents, ttft_s) -> None:
        ttfts = workflow_report(agents, ttft_s)
        self._received += 1
        ring = self._done.setdefault(namespace, deque())
        ring.append(Finished(at, ttfts))
        self._ttfts[namespace] = self._ttfts.get(namespace, 0) + len(ttfts)
        while self._ttfts[namespace] > MAX_TTFTS:
            self._ttfts[namespace] -= len(ring.popleft().ttft_s)

    def received(self) -> int:
        """Workflows reported since the plugin started."""
        return self._received

    def held(self) -> int:
        """Finished workflows kept for the windows to come, every namespace's."""
        return sum(len(ring) for ring in self._done.values())

    def due(self, now: float) -> bool:
        return not self._samples or now - self._samples[-1].at >= SAMPLE_S

    def sample(self, at: float, kv_bytes: dict[str, int], steps: dict[str, int], batch_total: dict[str, int],
               tokens: dict[str | None, tuple[int, int]]) -> None:
        if self._started is None:
            self._started = at
        span = max(min(WINDOW_S, at - self._started), SAMPLE_S)
        recent: dict[str | None, list[Finished]] = {}
        for ns in list(self._done):
            ring = self._done[ns]
            while ring and ring[0].at <= at - WINDOW_S:  # only windows from now on read them
                self._ttfts[ns] -= len(ring.popleft().ttft_s)
            if not ring:
                del self._done[ns], self._ttfts[ns]
                continue
            recent[ns] = [f for f in ring if f.at <= at]
        self._samples.append(Sample(at, kv_bytes, steps, batch_total, tokens,
                                    window([f for fs in recent.values() for f in fs], span),
                                    {ns: window(fs, span) for ns, fs in recent.items()}))
        while self._samples[0].at < at - KEEP_S:
            self._samples.popleft()

    def series(self, namespace: str | None = None, everyone: bool = True, timings: bool = True) -> dict:
        return series(list(self._samples), namespace, everyone, timings)
