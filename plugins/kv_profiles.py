"""What the cost model is fed: prefill timings per worker and link figures per worker pair.

Workers report each prefill's timing (``PREFILL_TOPIC`` in Dask's event log); the last
``prefill-samples`` per worker are fitted into a profile (``policy.cost_model``). Link
bandwidth comes from Dask's own transfer measurements, or from a calibration probe a
namespace ran (``kv_record_bandwidth``), which wins for that namespace's plans only: no
tenant steers another's.
"""

from __future__ import annotations

from collections import deque

from daskflow_kv import dask_internals as di
from daskflow_kv.policy.cost_model import PrefillSample, fit_prefill_profile

Pair = tuple[str, str]  # (src, dst) worker addresses


def pair_name(src: str, dst: str) -> str:
    """How the ``kv_snapshot`` answer's ``bandwidth`` / ``latency`` entries name a pair."""
    return f"{src}->{dst}"


class ProfileBook:
    __slots__ = ("_scheduler", "_max_samples", "_samples", "_fitted", "_probed_bandwidth", "_probed_latency")

    def __init__(self, scheduler, max_samples: int):
        self._scheduler = scheduler  # live workers; Dask's own bandwidth figures
        self._max_samples = max_samples  # prefill timings kept per worker
        self._samples: dict[str, deque[PrefillSample]] = {}  # worker -> its recent prefill timings
        # worker -> its fitted profile, until its next sample: every planning snapshot reads the
        # profiles, and refitting every worker's each time grew the scheduler's cost with workers
        self._fitted: dict[str, dict] = {}
        self._probed_bandwidth: dict[tuple[str, str, str], float] = {}  # (namespace, src, dst) -> bytes/s
        self._probed_latency: dict[tuple[str, str, str], float] = {}  # (namespace, src, dst) -> s per fetch

    # -- what comes in ----------------------------------------------------------------------
    def add_sample(self, worker: str, sample: PrefillSample) -> None:
        self._samples.setdefault(worker, deque(maxlen=self._max_samples)).append(sample)
        self._fitted.pop(worker, None)

    def record_probe(self, namespace: str | None, src: str, dst: str, bandwidth: float,
                     latency: float | None = None) -> None:
        """A calibration probe's figures, used for ``namespace``'s plans (others keep theirs)."""
        self._probed_bandwidth[(namespace, src, dst)] = float(bandwidth)
        if latency is not None:
            self._probed_latency[(namespace, src, dst)] = float(latency)

    def forget_worker(self, worker: str) -> None:
        """``worker`` left: its samples and every probe of a link to or from it go (probes name
        live workers only, so they stay as few as the pairs of workers)."""
        self._samples.pop(worker, None)
        self._fitted.pop(worker, None)
        for probed in (self._probed_bandwidth, self._probed_latency):
            for k in [k for k in probed if worker in k[1:]]:
                del probed[k]

    # -- what the planner reads ---------------------------------------------------------------
    def prefill_profiles(self) -> dict[str, dict]:
        """Fitted prefill profile per live worker: {worker: {"a", "b", "c", "samples"}}."""
        out = {}
        for worker, samples in self._samples.items():
            if samples and worker in self._scheduler.workers:
                if worker not in self._fitted:
                    p = fit_prefill_profile(list(samples))
                    self._fitted[worker] = {"a": p.a, "b": p.b, "c": p.c, "samples": len(samples)}
                out[worker] = dict(self._fitted[worker])  # a copy: the answer is the caller's
        return out

    def _pair_bandwidths(self, namespace: str | None) -> dict[Pair, float]:
        """A calibration probe (a real transfer timed from the receiver's transfer log) wins:
        it is recent. Dask's own per-pair figure fills the other pairs; it averages every
        transfer over 1 MB since the worker started, so it lags when the link changes."""
        out = dict(di.link_bandwidths(self._scheduler))
        out.update({(s, d): bw for (ns, s, d), bw in self._probed_bandwidth.items() if ns == namespace})
        return out

    def bandwidth(self, namespace: str | None = None) -> dict[str, float]:
        """Measured bytes/s per "src->dst" pair, as ``namespace``'s plans see them."""
        return {pair_name(s, d): bw for (s, d), bw in self._pair_bandwidths(namespace).items()}

    def latency(self, namespace: str | None = None) -> dict[str, float]:
        """Probed seconds per fetch per "src->dst" pair, ``namespace``'s probes only."""
        return {pair_name(s, d): lat for (ns, s, d), lat in self._probed_latency.items() if ns == namespace}

    def links(self, namespace: str | None = None) -> list[list]:
        """``[src, dst, bytes_per_s, latency_s or None]`` for every pair with a bandwidth,
        as ``namespace``'s plans see them (sorted by pair)."""
        return [[s, d, bw, self._probed_latency.get((namespace, s, d))]
                for (s, d), bw in sorted(self._pair_bandwidths(namespace).items())]
