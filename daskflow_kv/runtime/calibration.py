"""Probes that give the cost model measurements before any workflow has run.

Links: real payloads of two sizes made on one worker (on the runtime's device: a GPU
cluster measures device-to-device moves) and read by a task on another; the figures are
the receiver's own transfer records (Dask's ``transfer_incoming_log``), not a timer around
the call, and a line through them gives the pair's latency and bandwidth. Prefill: real
prefills of lengths spread up to the longest the caller will predict (``probe_tokens``),
on every worker at once, each reporting its timing to the scheduler plugin like any other
prefill; the profile is fitted over the whole spread, so it does not extrapolate. Store:
one probe object written and read back (``PersistentTier.calibrate``).

``Calibrator`` is the runtime's part that runs them and records the links with the plugin.

A probe is strictly placed on its worker, so a probe whose worker dies would wait in
``no-worker`` for good: every wait here is bounded (``daskflow-kv.calibration.timeout``)
and ends early when a worker it needs leaves the cluster. A lost probe is cancelled and
skipped: that pair (or worker) is simply not measured this time.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

import logging

from distributed import Client, wait

from .. import config, validation
from ..dask_internals import incoming_transfers, worker_addresses
from ..policy.cost_model import LinkProfile, calibration_lengths, fit_link
from . import tasks
from .kv_persistence import PersistentTier
from .plugin_client import PluginClient, gather


logger = logging.getLogger("daskflow_kv.calibration")
POLL_S = 0.25  # how often a wait checks that the probe's workers are still there


class ProbeLost(RuntimeError):
    """A probe did not finish: its worker left the cluster, or it ran past the timeout."""


def settle(client, futures, workers, timeout: float | None = None) -> None:
    """Wait for ``futures`` (probes placed on ``workers``); ``ProbeLost`` when one of those
    workers leaves or ``timeout`` (default ``daskflow-kv.calibration.timeout``) passes. The
    futures are cancelled then, so no probe is left waiting for a dead worker."""
    timeout = config.get_seconds("calibration.timeout") if timeout is None else timeout
    futures = list(futures)
    deadline = time.time() + timeout
    while True:
        try:
            wait(futures, timeout=POLL_S)
            return
        except TimeoutError:  # distributed.wait raises it when the time is up
            left = [f for f in futures if not f.done()]
        gone = set(workers) - set(worker_addresses(client))
        if gone or time.time() > deadline:
            client.cancel(list(left))
            why = f"worker {sorted(gone)[0]} left the cluster" if gone else f"no answer within {timeout:g} s"
            raise ProbeLost(f"calibration probe lost: {why}")


def _transfer_record(dask_worker, key):
    for entry in reversed(incoming_transfers(dask_worker)):
        if key in entry["keys"]:
            return {"total": entry["total"], "duration": entry["duration"], "who": entry["who"]}
    return None


def timed_transfer(client, src: str, dst: str, nbytes: int, device: str = "cpu") -> tuple[int, float]:
    """(bytes, seconds) of one real move of ``nbytes`` from src to dst, from dst's own record."""
    payload = client.submit(tasks.probe_bytes, nbytes, device, workers=[src], pure=False)
    settle(client, [payload], [src])
    reader = client.submit(tasks.touch, payload, workers=[dst], allow_other_workers=False, pure=False)
    settle(client, [reader], [src, dst])
    gather(client, [reader])
    rec = client.run(_transfer_record, key=payload.key, workers=[dst])[dst]
    del payload, reader
    if rec is None:
        raise RuntimeError(f"no transfer of the probe was recorded on {dst}")
    return rec["total"], max(rec["duration"], 1e-6)


def measure_bandwidth(client, src: str, dst: str, nbytes: int, device: str = "cpu") -> float:
    total, seconds = timed_transfer(client, src, dst, nbytes, device)
    return total / seconds


def measure_link(client, src: str, dst: str, nbytes: int, device: str = "cpu") -> LinkProfile:
    """Latency and bandwidth of src -> dst from moves of ``nbytes`` and of 1/16 of it."""
    small = max(256 << 10, nbytes // 16)
    return fit_link([timed_transfer(client, src, dst, n, device) for n in (small, nbytes, small)])


def _on_each(client, fn, args: tuple, workers: list[str], what: str) -> dict:
    """``fn(*args)`` on every one of ``workers`` at once, waited for without waiting on a dead
    worker (``settle``): {worker: its future}, the lost ones left out (and logged)."""
    futures = {w: client.submit(fn, *args, workers=[w], allow_other_workers=False, pure=False) for w in workers}
    done = {}
    for w, f in futures.items():
        try:
            settle(client, [f], [w])
        except ProbeLost as e:
            logger.warning("%s: %s: %s", w, what, e)
            continue
        done[w] = f
    return done


def warm_up(client, spec: tasks.ModelSpec, facts: tasks.ModelFacts, workers: list[str], n: int) -> None:
    """An untimed ``n``-token prefill on every worker first (``tasks.warm_up``): the first
    forward's one-time costs would otherwise be fitted as every prefill's fixed cost. A
    worker that is lost here is found and reported by the timed probes."""
    rng = random.Random(1)
    tokens = tuple(rng.randrange(3, facts.vocab_size) for _ in range(min(n, facts.max_positions - 1)))
    _on_each(client, tasks.warm_up, (spec, tokens), workers, "warm-up")


def measure_prefill(client, spec: tasks.ModelSpec, facts: tasks.ModelFacts, workers: list[str], sizes,
                    repeats: int = 1) -> list[str]:
    """Prefill each length ``repeats`` times on every worker, in rounds of all the lengths, all
    workers at once but one length at a time (each reports its timing). -> the workers whose
    probes were lost (not measured).

    Rounds, not one length ``repeats`` times in a row: a slow spell of a busy host then lands
    on different lengths, and the fit (on relative error) leans on each length's fast
    samples; a single probe per length let one slow spell become the profile (a fixed cost of
    0.30 s against 0.05 s fitted on a whole run's prefills, measured).

    One at a time per worker: probes submitted together join one running batch on the
    worker's step loop, and a prefill that shared its steps has no timing of its own (the
    profile skips it): the calibration then waited out its deadline for timings that never came.
    """
    rng = random.Random(0)
    lost: list[str] = []
    warm_up(client, spec, facts, workers, min(sizes))
    for n in [n for _ in range(repeats) for n in sizes]:
        n = min(n, facts.max_positions - 1)
        tokens = tuple(rng.randrange(3, facts.vocab_size) for _ in range(n))
        req = tasks.PrefillRequest(tokens, 0, op="calibrate")
        live = [w for w in workers if w not in lost]
        done = _on_each(client, tasks.prefill, (spec, req), live, "prefill probe")
        lost += [w for w in live if w not in done]
        gather(client, list(done.values()))  # a failed probe says so here
    return lost


def probes_arrived(profiles: dict, before: dict, workers, probes: int) -> bool:
    """Every probe's timing has reached each worker's profile (its sample count grew by
    ``probes``, or to the window the plugin keeps). Why not just "a profile exists": the
    first timing to arrive made one, and the calibration reported (and a bench JSON kept, and
    the simulation fitted) a one-sample rate while the other lengths were still on their way."""
    window = int(config.get("scheduler.prefill-samples"))
    return all(w in profiles and profiles[w].get("samples", 0) >= min(before.get(w, 0) + probes, window)
               for w in workers)


@dataclass(slots=True, eq=False)
class Calibrator:
    client: Client  # runs the probes
    plugin: PluginClient  # records the links; reports the fitted prefill profiles
    spec: tasks.ModelSpec  # the model prefilled (and its device: a GPU cluster measures device moves)
    facts: tasks.ModelFacts  # its vocabulary and longest position
    tier: PersistentTier  # the persistent store, probed too when there is one

    def record_link(self, src: str, dst: str, probe_bytes: int) -> LinkProfile:
        """Measure src -> dst and give the figures to the plugin (this namespace's plans use them)."""
        link = measure_link(self.client, src, dst, probe_bytes, self.spec.device)
        self.plugin.record_bandwidth(src, dst, link.bandwidth, link.latency)
        return link

    def calibrate(self, probe_bytes: int | str | None = None, probe_tokens: int | None = None,
                  probe_repeats: int | None = None) -> dict:
        """Measure every worker pair's bandwidth, every worker's prefill speed and the store's."""
        probe_bytes = validation.setting("calibration.probe-bytes", probe_bytes, "probe_bytes", validation.byte_size)
        probe_tokens = validation.setting("calibration.probe-tokens", probe_tokens, "probe_tokens",
                                          validation.integer, minimum=8)  # it also prefills probe_tokens // 8
        repeats = validation.setting("calibration.probe-repeats", probe_repeats, "probe_repeats",
                                     validation.integer, minimum=1)
        workers = worker_addresses(self.client)
        bandwidth, latency = {}, {}
        for src, dst in itertools.permutations(workers, 2):
            try:
                link = self.record_link(src, dst, probe_bytes)
            except ProbeLost as e:  # that pair stays unmeasured; its planner falls back on Dask's figure
                logger.warning("%s -> %s: %s", src, dst, e)
                continue
            bandwidth[f"{src}->{dst}"], latency[f"{src}->{dst}"] = link.bandwidth, link.latency
        sizes = calibration_lengths(probe_tokens)
        before = {w: p.get("samples", 0) for w, p in self.plugin.prefill_profiles().items()}
        lost = measure_prefill(self.client, self.spec, self.facts, workers, sizes, repeats)
        deadline = time.time() + 10  # worker events reach the scheduler asynchronously
        profiles = self.plugin.prefill_profiles()
        while not probes_arrived(profiles, before, [w for w in workers if w not in lost], len(sizes) * repeats) \
                and time.time() < deadline:
            time.sleep(0.05)
            profiles = self.plugin.prefill_profiles()
        out = {"bandwidth": bandwidth, "latency": latency, "prefill_profiles": profiles}
        if self.tier.store is not None:
            out["store"] = self.tier.calibrate()
        return out
