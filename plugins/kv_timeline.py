"""What the KV page plots live: workflows per minute, TTFT p50/p95, hit rate, and batch size and
KV bytes per worker, over the last minutes.

Two kinds of history, both bounded rings:

* workflows finished, as their runtimes report them (``kv_workflow_done``: agents, wall
  time, each agent's TTFT - the executor's definition, from the workflow's start to the
  agent's first token), tagged with the caller's namespace;
* samples the plugin takes every ``SAMPLE_S`` seconds: KV bytes per worker, each worker's
  step-loop counters (steps, sum of batch sizes) and each namespace's token counters
  (reused, computed).

``series`` turns them into the plots' columns, as a plain function of plain data (tested
without a cluster): at each sample time, the trailing ``window_s`` seconds' workflows per
minute, TTFT percentiles and hit rate (tokens reused / prompt tokens), and per worker the
mean batch since the previous sample and the KV bytes then. A tenant's series count only its
own namespace's workflows and tokens; batch size and KV bytes per worker are cluster
totals, as on the rest of the page.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

SAMPLE_S = 2.0  # seconds between two samples
KEEP_S = 600.0  # seconds of history kept (the plots' x range)
WINDOW_S = 60.0  # trailing window of the rates and percentiles
MAX_WORKFLOWS = 2048  # finished workflows kept per namespace (one tenant cannot push out another's)
MAX_AGENTS = 1024  # agents one report may list


@dataclass(frozen=True, slots=True)
class WorkflowDone:
    at: float  # scheduler's wall clock when the report arrived
    namespace: str | None
    agents: int
    wall_s: float
    ttft_s: tuple[float, ...]  # one per agent


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    kv_bytes: dict[str, int]  # worker -> KV bytes in memory
    steps: dict[str, int]  # worker -> its step loop's steps so far
    batch_total: dict[str, int]  # worker -> sum of its steps' batch sizes so far
    tokens: dict[str | None, tuple[int, int]] = field(default_factory=dict)  # namespace -> (reused, computed)


def _seconds(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v < 1e6):
        raise ValueError(f"{name} must be a finite number of seconds, got {v!r}")
    return float(v)


def workflow_report(agents, wall_s, ttft_s) -> tuple[int, float, tuple[float, ...]]:
    """A runtime's report of one finished workflow, checked (it comes from a client)."""
    if isinstance(agents, bool) or not isinstance(agents, int) or not 0 < agents <= MAX_AGENTS:
        raise ValueError(f"agents must be an integer in 1..{MAX_AGENTS}, got {agents!r}")
    if not isinstance(ttft_s, (list, tuple)) or len(ttft_s) > agents:
        raise ValueError("ttft_s must be a list of at most one TTFT per agent")
    return agents, _seconds("wall_s", wall_s), tuple(_seconds("ttft_s", t) for t in ttft_s)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated ``q`` percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _tokens(sample: Sample, namespace: str | None, everyone: bool) -> tuple[int, int]:
    if everyone:
        return (sum(r for r, _ in sample.tokens.values()), sum(c for _, c in sample.tokens.values()))
    return sample.tokens.get(namespace, (0, 0))


def series(done: list[WorkflowDone], samples: list[Sample], namespace: str | None = None,
           everyone: bool = True, window_s: float = WINDOW_S) -> dict:
    """The plots' columns at each sample time (see the module). ``everyone``: every namespace's
    workflows and tokens (the admin's, an open cluster's, or totals); else ``namespace``'s."""
    mine = sorted((w for w in done if everyone or w.namespace == namespace), key=lambda w: w.at)
    ats = [w.at for w in mine]
    t0 = samples[0].at if samples else 0.0
    out = {"t": [], "workflows_per_min": [], "ttft_p50_s": [], "ttft_p95_s": [], "hit_rate": []}
    workers = sorted({w for s in samples for w in s.kv_bytes})
    per_worker = {w: {"kv_bytes": [], "batch": []} for w in workers}
    back = 0  # index of the first sample inside the trailing window
    for i, s in enumerate(samples):
        start = s.at - window_s
        while samples[back].at < start:
            back += 1
        recent = mine[bisect.bisect_right(ats, start):bisect.bisect_right(ats, s.at)]
        # A young history spans less than the window: rate over what it spans (at least one sample step).
        span = max(min(window_s, s.at - t0), SAMPLE_S)
        ttfts = [t for w in recent for t in w.ttft_s]
        reused_now, computed_now = _tokens(s, namespace, everyone)
        # Counters are totals: the window's tokens are the difference from the last sample before
        # it (the oldest one kept while the history is younger than the window).
        reused_then, computed_then = _tokens(samples[max(back - 1, 0)], namespace, everyone)
        reused, prompt = reused_now - reused_then, (reused_now - reused_then) + (computed_now - computed_then)
        out["t"].append(s.at)
        out["workflows_per_min"].append(len(recent) * 60.0 / span)
        out["ttft_p50_s"].append(percentile(ttfts, 50))
        out["ttft_p95_s"].append(percentile(ttfts, 95))
        out["hit_rate"].append(reused / prompt if prompt > 0 else None)
        prev = samples[i - 1] if i else s  # the first sample has no interval before it
        for w in workers:
            steps = s.steps.get(w, 0) - prev.steps.get(w, 0)
            total = s.batch_total.get(w, 0) - prev.batch_total.get(w, 0)
            per_worker[w]["kv_bytes"].append(s.kv_bytes.get(w))
            # No step in the interval is no batch (0); counters that went back are a restarted loop.
            per_worker[w]["batch"].append(None if not i else (total / steps if steps > 0 and total >= 0 else 0.0))
    out["workers"] = per_worker
    return out


class KVTimeline:
    """The rings ``series`` reads; the plugin records reports and takes samples."""

    __slots__ = ("_done", "_samples", "_last")

    def __init__(self):
        self._done: dict[str | None, deque[WorkflowDone]] = {}  # namespace -> its finished workflows
        self._samples: deque[Sample] = deque(maxlen=int(KEEP_S / SAMPLE_S) + 1)
        self._last = -math.inf  # when the last sample was taken

    def workflow_done(self, at: float, namespace: str | None, agents, wall_s, ttft_s) -> None:
        n, wall, ttfts = workflow_report(agents, wall_s, ttft_s)
        ring = self._done.setdefault(namespace, deque(maxlen=MAX_WORKFLOWS))
        ring.append(WorkflowDone(at, namespace, n, wall, ttfts))

    def recorded(self) -> int:
        """Finished workflows kept, every namespace's."""
        return sum(len(ring) for ring in self._done.values())

    def due(self, now: float) -> bool:
        return now - self._last >= SAMPLE_S

    def sample(self, sample: Sample) -> None:
        self._last = sample.at
        self._samples.append(sample)
        for ring in self._done.values():
            while ring and ring[0].at < sample.at - KEEP_S - WINDOW_S:
                ring.popleft()

    def series(self, namespace: str | None = None, everyone: bool = True) -> dict:
        rings = self._done.values() if everyone else [self._done.get(namespace, ())]
        return series([w for ring in rings for w in ring], list(self._samples), namespace, everyone)
