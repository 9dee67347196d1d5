"""The store read path of a materialize: a prefix found in no worker's memory, loaded instead of prefilled.

A lookup that misses in memory asks the store for the rest of the request's own chain keys
(computed here, with the tenant's secret: nothing is looked up by token ids). If the store
holds a run of them, ``policy.store_read.decide_store_read`` prices loading those bytes
(measured store bandwidth) against prefilling their tokens (measured prefill profile); when
loading wins, one task reads them on the worker that will run the request, and each
verified block is published under its key, exactly like a prefilled one. A block that fails
verification ends the run there; the rest is prefilled (and written again).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distributed import Client

from ..keys import content_key
from ..policy.cluster_view import CachedBlock, ClusterView, WorkerLoad
from ..policy.cost_model import NeedsCalibration
from ..policy.placement import holder_of
from ..policy.store_read import StoreDecision, decide_store_read
from ..state.blocks import chain_keys
from ..store import worker_io as store_io
from .kv_persistence import PersistentTier
from .planner import Planner
from .plugin_client import gather
from .prefix_cache import HeldPrefix
from .publish import NewBlocks, Publisher, blocks_of
from .submit import Submitter


@dataclass(slots=True, eq=False)
class StoreReader:
    client: Client  # asks for each load's summary
    tier: PersistentTier  # the store, its measured speed and what it holds
    planner: Planner  # cluster views, and calibration when a price lacks a measurement
    submitter: Submitter  # submits the load task
    publisher: Publisher  # puts each loaded block under its key
    key_digest: str  # seeds this tenant's chain keys
    bytes_per_token: int  # K/V bytes one token takes

    @property
    def block_size(self) -> int:
        return self.submitter.block_size

    def extend(self, tokens: Sequence[int], held: HeldPrefix, worker: str | None, sid: str) -> HeldPrefix:
        """``held`` extended with blocks loaded from the store, when loading them wins."""
        store = self.tier.store
        if store is None:
            return held
        chain = chain_keys(self.key_digest, tokens, self.block_size,  # the last one may be partial
                           namespace=self.submitter.namespace)
        mem = 0  # leading blocks memory matched by their own chain key
        while mem < min(len(held.blocks), len(chain)) and content_key(held.blocks[mem].key) == chain[mem][0]:
            mem += 1
        rest = chain[mem:]
        n = store.leading(k for k, _, _ in rest)
        if n == 0 or rest[n - 1][2] <= held.tokens:
            return held
        self.tier.mark_stored(k for k, _, _ in rest[:n])
        end = rest[n - 1][2]
        view = self.planner.view(held.snapshot)  # the one that came with the lookup
        target = worker or holder_of(held.blocks[:mem], view.busy) or _least_loaded(view.workers)
        nbytes = (end - rest[0][1]) * self.bytes_per_token
        decision = self._price(view, target, nbytes, end - held.tokens, held.tokens)
        if decision.action != "load":
            return held
        loaded = self._load(rest[:n], target, tokens, held, mem, sid, decision)
        if not loaded or loaded[-1][0].end <= held.tokens:
            return held  # corrupt from the start: memory's match is as good
        return held.extended(mem, loaded)

    def _price(self, view: ClusterView, target, nbytes: int, missing: int, prefix: int) -> StoreDecision:
        try:
            d = decide_store_read(nbytes, missing, prefix, target, self.tier.profile(), view.profile(target))
        except NeedsCalibration:
            if self.tier.profile() is None:
                self.tier.calibrate()
            if view.profile(target) is None:  # estimated if calibration could not measure it
                view = self.planner.calibrated_view().with_fallbacks(self.planner.remembered)
            d = decide_store_read(nbytes, missing, prefix, target, self.tier.profile(), view.profile(target))
        self.tier.record_decision(d)
        return d

    def _load(self, spans, target, tokens, held: HeldPrefix, mem: int, sid: str, decision: StoreDecision) -> list:
        """Read ``spans`` (chain order) on ``target`` and publish the verified leading run:
        (block, future) for each block now under its key."""
        keys = [k for k, _, _ in spans]
        out = self.submitter.load_from_store(self.tier.store.url, self.tier.tenant, keys, sid, target,
                                             decision.as_dict(), decision.nbytes)
        summarized = self.client.submit(store_io.load_summary, out, workers=[target] if target else None,
                                        allow_other_workers=True, pure=False)
        [summary] = gather(self.client, [summarized])  # a preempted load leaves no lease of this frame pinned
        if summary["blocks"]:
            self.tier.record_load(summary["nbytes"], summary["seconds"])
        if summary["stopped"] == "corrupt":
            self.tier.mark_missing(keys[summary["blocks"]])
        n = summary["blocks"]
        if n == 0:
            return []
        where = summary["worker"]
        kept = held.kept(mem * self.block_size)
        [state] = self.publisher.publish([NewBlocks(tokens, kept, [(s, e) for _, s, e in spans[:n]],
                                                    blocks_of(out, n, where), sid)], source="store")
        return [(CachedBlock(r.key, r.start, r.end, r.nbytes, (), (where,)), f)
                for r, f in zip(state.refs[len(kept):], state.futures[len(kept):])]


def _least_loaded(workers: Mapping[str, WorkerLoad]) -> str | None:
    return min(workers, key=lambda w: (workers[w].processing, w)) if workers else None
