"""KVRuntime's side of the persistent tier: what to write through, and the read path.

Writes (``daskflow-kv.store.write``): ``materialize-only`` (default) writes the blocks of
states made by materialize / extend / merge - the shared contexts other agents, workflows
and later clusters read - including reused blocks not stored yet, so a stored context has
no gaps; ``all`` also writes every resumed branch's own blocks; ``off`` writes nothing (the
store is still read). A block is written by the worker that holds it, in the background
(``store_io``): no prefill waits for storage.

Reads: a lookup that misses in memory asks the store for the rest of the request's own
chain keys (computed here, with the tenant's secret: nothing is looked up by token ids).
If the store holds a run of them, ``policy.store_read.decide_store_read`` prices loading
those bytes (measured store bandwidth) against prefilling their tokens (measured prefill
profile); when loading wins, one task reads them on the worker that will run the request,
and each verified block is published under its key, exactly like a prefilled one. A block
that fails verification ends the run there; the rest is prefilled (and written again).

A mixin of ``KVRuntime``: it uses the runtime's client, keys, view and ``_publish``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import dask
from distributed import fire_and_forget

from .. import config, validation
from ..keys import PERSIST, STORE_LOAD, task_key
from ..policy.cost_model import NeedsCalibration
from ..policy.placement import holder_of
from ..policy.store_read import (
    StoreDecision,
    StoreSample,
    decide_store_read,
    explain_store,
    fit_store_profile,
)
from ..state.blocks import chain_keys
from ..store.kv_store import open_store
from ..store import worker_io as store_io
from . import tasks

WRITE_OPS = ("materialize", "extend", "merge")  # states whose blocks "materialize-only" writes


class PersistentTier:
    def _init_store(self, kv_store, kv_store_write) -> None:
        url = validation.setting("store.url", kv_store, "kv_store", validation.optional, validation.store_url)
        self.store = open_store(url) if url else None
        self.store_write = validation.setting("store.write", kv_store_write, "kv_store_write", validation.choice,
                                              validation.STORE_WRITES)
        self.store_samples: deque[StoreSample] = deque(maxlen=64)  # load timings measured on workers
        self.store_decisions: deque[StoreDecision] = deque(maxlen=1024)
        self._stored: set[str] = set()  # keys this runtime knows the store has (or will have)

    # -- writes -----------------------------------------------------------------------------
    def _writes(self, op: str) -> bool:
        if self.store is None or self.store_write == "off":
            return False
        return self.store_write == "all" or op in WRITE_OPS

    def _write_request(self, key: str, start: int, end: int) -> store_io.WriteRequest:
        self._stored.add(key)
        return store_io.WriteRequest(self.store.url, key, start, end, self.fingerprint.digest)

    def _write_reused(self, match, upto: int) -> None:
        """Write the reused blocks (ending by ``upto``) of a new shared state that the store may
        lack, each where it is held: one small low-priority task per worker, which only queues
        the writes there."""
        by_worker: dict[str | None, list[dict]] = {}
        for b in match.blocks:
            if b["end"] <= upto and b["key"] not in self._stored:
                by_worker.setdefault(next(iter(b.get("where") or ()), None), []).append(b)
        for worker, rows in by_worker.items():
            reqs = [self._write_request(b["key"], b["start"], b["end"]) for b in rows]
            fut = self.client.submit(store_io.persist_blocks, reqs, *[match.futures[b["key"]] for b in rows],
                                     key=task_key(PERSIST), workers=[worker] if worker else None,
                                     allow_other_workers=True, priority=-10, pure=False)
            fire_and_forget(fut)

    def flush_store(self, timeout: float | None = None) -> int:
        """Wait until every worker has written what it queued; how many writes are still pending.

        A block is queued when its task runs: wait for the states first (``wait``)."""
        if self.store is None:
            return 0
        timeout = config.get_seconds("store.flush-timeout") if timeout is None else timeout
        return sum(self.client.run(store_io.drain, timeout).values())

    # -- reads ------------------------------------------------------------------------------
    def store_profile(self):
        """Load speed as measured on workers (None before any load or probe)."""
        return fit_store_profile(list(self.store_samples)) if self.store_samples else None

    def calibrate_store(self, probe_bytes: int | str | None = None) -> dict:
        """Write and read back one probe object from a worker; feeds ``store_profile``."""
        nbytes = validation.setting("store.probe-bytes", probe_bytes, "probe_bytes", validation.byte_size)
        workers = sorted(self.client.scheduler_info(n_workers=-1)["workers"])
        samples = self.client.submit(store_io.probe, self.store.url, nbytes, workers=workers[:1],
                                     pure=False).result()
        self.store_samples.extend(StoreSample(n, s) for n, s in samples)
        p = self.store_profile()
        return {"bandwidth": p.bandwidth, "latency": p.latency, "samples": len(self.store_samples)}

    def _from_store(self, tokens, match, worker: str | None, sid: str):
        """``match`` extended with blocks loaded from the store, when loading them wins."""
        if self.store is None:
            return match
        chain = chain_keys(self.key_digest, tokens, self.block_size)  # the last one may be partial
        mem = 0  # leading blocks memory matched by their own chain key
        while mem < min(len(match.blocks), len(chain)) and match.blocks[mem]["key"] == chain[mem][0]:
            mem += 1
        rest = chain[mem:]
        n = self.store.leading(k for k, _, _ in rest)
        if n == 0 or rest[n - 1][2] <= match.tokens:
            return match
        self._stored.update(k for k, _, _ in rest[:n])
        end = rest[n - 1][2]
        view = self.view()
        target = worker or holder_of(match.blocks[:mem]) or _least_loaded(view.workers)
        nbytes = (end - rest[0][1]) * self.facts.bytes_per_token
        decision = self._price_store(view, target, nbytes, end - match.tokens, match.tokens)
        if decision.action != "load":
            return match
        loaded = self._load(rest[:n], target, tokens, match, mem, sid, decision)
        if not loaded or loaded[-1]["end"] <= match.tokens:
            return match  # corrupt from the start: memory's match is as good
        futures = {b["key"]: match.futures[b["key"]] for b in match.blocks[:mem]}
        futures.update((b["key"], b.pop("future")) for b in loaded)
        return replace(match, tokens=loaded[-1]["end"], blocks=list(match.blocks[:mem]) + loaded, futures=futures)

    def _price_store(self, view, target, nbytes, missing, prefix) -> StoreDecision:
        try:
            d = decide_store_read(nbytes, missing, prefix, target, self.store_profile(), view.profile(target))
        except NeedsCalibration:
            if self.store_profile() is None:
                self.calibrate_store()
            if view.profile(target) is None:
                self.calibrate()
                view = self.view()
            d = decide_store_read(nbytes, missing, prefix, target, self.store_profile(), view.profile(target))
        self.store_decisions.append(d)
        return d

    def _load(self, spans, target, tokens, match, mem: int, sid: str, decision: StoreDecision) -> list[dict]:
        """Read ``spans`` (chain order) on ``target`` and publish the verified leading run.

        Returns match-style rows (with a "future" each) for the blocks now under their keys.
        """
        keys = [k for k, _, _ in spans]
        note = {"role": "compute", "session": self.session.token, "op": "store-load", "state_id": sid,
                "target": target, "reads": [], "decision": decision.as_dict(), "first": True,
                "kv_out": decision.nbytes}
        with dask.annotate(kv=note):
            out = self.client.submit(store_io.load_blocks, self.store.url, keys,
                                     key=task_key(STORE_LOAD, sid),
                                     workers=[target] if target else None, pure=False)
        summary = self.client.submit(store_io.load_summary, out, workers=[target] if target else None,
                                     allow_other_workers=True, pure=False).result()
        if summary["blocks"]:
            self.store_samples.append(StoreSample(summary["nbytes"], summary["seconds"]))
        if summary["stopped"] == "corrupt":
            self._stored.discard(keys[summary["blocks"]])  # rewritten when recomputed
        n = summary["blocks"]
        if n == 0:
            return []
        where = summary["worker"]
        kept = match.kept(mem * self.block_size)
        refs, futures = self._publish(lambda i: (tasks.take_block, out, i), tokens, kept,
                                      [(s, e) for _, s, e in spans[:n]], sid, where, source="store")
        return [{"key": r.key, "start": r.start, "end": r.end, "nbytes": r.nbytes, "who_has": [], "where": [where],
                 "state": "memory", "future": f} for r, f in zip(refs[len(kept):], futures[len(kept):])]

    def explain_store(self) -> str:
        return "\n".join(explain_store(d) for d in self.store_decisions)


def _least_loaded(workers: dict[str, dict]) -> str | None:
    return min(workers, key=lambda w: (workers[w].get("processing", 0), w)) if workers else None
