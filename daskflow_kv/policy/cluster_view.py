"""What the planner sees of the cluster: the plugin's answers as frozen dataclasses. Pure.

The scheduler plugin answers RPCs with plain dicts (its wire format). They are converted
once, where the answer arrives (``runtime.plugin_client``), into the types here, as vLLM
v1's ``KVCacheBlocks`` sits between its scheduler and its KV-cache manager: the policy
functions never read a dict key.

* ``PrefixMatch``: a lookup - how many leading tokens are cached, in which ``CachedBlock``s;
  a block's ``where`` lists the workers that hold it or, while it is still being computed,
  the worker it is planned on.
* ``ClusterView``: a snapshot - a ``WorkerLoad`` per worker, link bandwidth and latency
  keyed by ``(src, dst)``, fitted prefill profiles. A plan that queues work on a worker
  gets a new view (``with_queue``); no view is changed in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .cost_model import LinkProfile, PrefillProfile

IDLE_S = 0.05  # queued seconds under which a worker counts as idle (predictions are this noisy)


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """One block of a cached prefix, as the plugin's lookup placed it."""

    key: str  # its content address, a Dask key
    start: int  # first token position it covers
    end: int  # one past the last token position it covers
    nbytes: int  # its K/V bytes
    who_has: tuple[str, ...] = ()  # workers holding it now
    where: tuple[str, ...] = ()  # its holders or, while it is being computed, the worker it is planned on

    @classmethod
    def from_answer(cls, row: Mapping) -> CachedBlock:
        """A row of ``kv_lookup``'s answer; a row without ``where`` is where its holders are."""
        who = tuple(row.get("who_has") or ())
        where = tuple(row["where"] or ()) if "where" in row else who
        return cls(str(row["key"]), int(row["start"]), int(row["end"]), int(row["nbytes"]), who, where)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a request: how many leading tokens its blocks cover."""

    tokens: int  # leading tokens the blocks cover
    blocks: tuple[CachedBlock, ...] = ()  # in token order

    @classmethod
    def from_answer(cls, ans: Mapping) -> PrefixMatch:
        """``kv_lookup``'s answer: ``{"tokens": int, "blocks": [row, ...]}``."""
        return cls(int(ans["tokens"]), tuple(CachedBlock.from_answer(b) for b in ans["blocks"]))


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker has to do, from the plugin's snapshot."""

    nthreads: int = 1  # task threads
    processing: int = 0  # tasks assigned to it and not finished
    kv_bytes: int = 0  # KV block bytes it holds
    busy_s: float = 0.0  # predicted seconds of KV work queued there

    @classmethod
    def from_answer(cls, row: Mapping) -> WorkerLoad:
        return cls(int(row.get("nthreads", 1)), int(row.get("processing", 0)), int(row.get("kv_bytes", 0)),
                   float(row.get("busy_s", 0.0)))


def median_profile(profiles) -> PrefillProfile | None:
    """The middle of ``profiles`` ordered by their coefficients; None when there are none."""
    ordered = sorted(profiles, key=lambda q: (q.a, q.b, q.c))
    return ordered[len(ordered) // 2] if ordered else None


def _pairs(d: Mapping | None) -> dict[tuple[str, str], float]:
    """``{"src->dst": value}`` keyed by (src, dst)."""
    out = {}
    for pair, value in (d or {}).items():
        src, dst = pair.split("->")
        out[(src, dst)] = float(value)
    return out


@dataclass(frozen=True, slots=True)
class ClusterView:
    workers: Mapping[str, WorkerLoad]  # address -> its load
    bandwidth: Mapping[tuple[str, str], float]  # (src, dst) -> measured bytes/s
    prefill: Mapping[str, PrefillProfile]  # worker -> fitted profile
    memory_weight: float = 0.0  # lambda, s per byte left on a destination
    bandwidth_override: float | None = None  # what-if: every pair at this bandwidth
    prefill_override: PrefillProfile | None = None  # what-if: every worker with this profile
    latency: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (src, dst) -> fitted s per fetch
    kv_budget_bytes: int | None = None  # KV bytes each worker may hold (None: no budget)
    default_bandwidth: float | None = None  # Dask's own bytes/s guess for a pair nobody measured
    estimate_gaps: bool = False  # unmeasured links and profiles are estimated (``with_fallbacks``)
    remembered_prefill: PrefillProfile | None = None  # a profile measured on workers that have all left since

    @classmethod
    def from_snapshot(cls, snap: Mapping, bandwidth_override=None, prefill_override=None) -> ClusterView:
        """``kv_snapshot``'s answer. Links come as ``"links"``: ``[src, dst, bytes/s, latency s or
        None]`` rows."""
        if "links" in snap:
            links = [(str(s), str(d), bw, lat) for s, d, bw, lat in snap["links"]]
            bandwidth = {(s, d): float(bw) for s, d, bw, _ in links if bw is not None}
            latency = {(s, d): float(lat) for s, d, _, lat in links if lat is not None}
        else:  # fallback for a plugin without "links": drop once both sides have it
            bandwidth, latency = _pairs(snap["bandwidth"]), _pairs(snap.get("latency"))
        profiles = {w: PrefillProfile(p["a"], p["b"], p["c"]) for w, p in snap["prefill_profiles"].items()}
        workers = {w: WorkerLoad.from_answer(row) for w, row in snap["workers"].items()}
        return cls(workers, bandwidth, profiles, snap.get("memory_weight") or 0.0, bandwidth_override,
                   prefill_override, latency, snap.get("kv_budget_bytes"), snap.get("default_bandwidth"))

    def link(self, src: str, dst: str) -> LinkProfile | None:
        lat = self.latency.get((src, dst)) or self.latency.get((dst, src))
        if self.bandwidth_override is not None:
            return LinkProfile(self.bandwidth_override) if lat is None else LinkProfile(self.bandwidth_override, lat)
        bw = self.bandwidth.get((src, dst)) or self.bandwidth.get((dst, src))
        if not bw and self.estimate_gaps and src != dst:
            bw = self.default_bandwidth
        if not bw:
            return None
        return LinkProfile(bw) if lat is None else LinkProfile(bw, lat)

    def profile(self, worker: str) -> PrefillProfile | None:
        p = self.prefill_override or self.prefill.get(worker)
        if p is None and self.estimate_gaps:
            p = median_profile(self.prefill.values()) or self.remembered_prefill
        return p

    def busy(self, worker: str | None) -> float:
        """Seconds of KV work queued on ``worker`` (what its running tasks still need)."""
        load = self.workers.get(worker) if worker else None
        return load.busy_s if load is not None else 0.0

    def loaded(self, pool) -> bool:
        """Every worker of ``pool`` has KV work: spare compute is gone (``decide``'s ``loaded``).

        A worker is idle only with under ``IDLE_S`` of predicted work queued *and* no task
        running. Why both: predictions run short under load (a stream's steps cost 1.2-1.6x
        a lone engine's), so a worker still stepping through its batch looked idle, and a
        prefix queued on another worker was rebuilt there (exp 7 Zipf: 26-44 % of
        daskflow-kv's prefill was rebuilt copies, in one run 1,259 of 1,803 tokens this way)."""
        pool = [w for w in pool if w in self.workers]
        return bool(pool) and all(self.busy(w) > IDLE_S or self.workers[w].processing > 0 for w in pool)

    def with_fallbacks(self, remembered: PrefillProfile | None = None) -> ClusterView:
        """This view with its gaps estimated, for a worker that joined (or a nanny restarted)
        after the last calibration and before the next one could measure it: a worker with no
        prefill profile gets the median of the measured workers' (the same hardware is
        assumed) or, when every measured worker has left (all restarted under memory
        pressure), ``remembered``, a median seen before; a pair nobody measured moves at
        ``default_bandwidth`` (Dask's own guess). A plan on it is an estimate; calibration
        replaces it."""
        return replace(self, estimate_gaps=True, remembered_prefill=remembered or self.remembered_prefill)

    def with_queue(self, worker: str | None, busy_s: float) -> ClusterView:
        """This view with ``worker`` busy for at least ``busy_s`` (work a plan just queued there)."""
        load = self.workers.get(worker) if worker else None
        if load is None:
            return self
        return replace(self, workers={**self.workers, worker: replace(load, busy_s=max(load.busy_s, busy_s))})


__all__ = ["CachedBlock", "ClusterView", "PrefixMatch", "WorkerLoad", "median_profile"]
