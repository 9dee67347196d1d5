"""What a compute task placed by the plan reads: the cached blocks, or a replica rebuilt where it runs.

``reuse`` and ``transfer`` read the matched blocks (Dask moves each block once per worker);
``recompute`` rebuilds the prefix on the destination, once per destination and prefix,
starting from the leading blocks the destination already holds (partial recompute), into
private blocks Dask frees once their readers are done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distributed import Future

from ..keys import REPLICA
from ..policy.cluster_view import ClusterView
from ..policy.placement import Placement, read_blocks
from ..state.blocks import aligned_floor, split_spans
from ..state.kv_state import new_state_id
from . import tasks
from .planner import predict_seconds
from .prefix_cache import HeldPrefix
from .submit import Submitter

Replicas = dict[tuple[int, str | None], tuple[Future, ...]]  # (id of the HeldPrefix, worker) -> its rebuilt blocks


@dataclass(slots=True, eq=False)
class PrefixInputs:
    submitter: Submitter  # submits the rebuilds

    def for_placement(self, held: HeldPrefix, p: Placement, tokens: Sequence[int], replicas: Replicas,
                      view: ClusterView | None = None) -> tuple[list[Future], list[str]]:
        """(prefix block futures, keys read from the cache) for a consumer placed by ``p``;
        a rebuild is made once per (prefix, worker) in ``replicas``."""
        if p.action == "recompute":
            slot = (id(held), p.worker)
            if slot not in replicas:
                need = max(p.recompute_tokens, p.reused)
                replicas[slot] = self.replica(tokens[:need], p.worker, held, p.held_tokens, view)
            return list(replicas[slot]), []
        reads = read_blocks(held.match, p.reused)
        return held.futures_of(reads), [b.key for b in reads]

    def replica(self, tokens: Sequence[int], worker: str | None, held: HeldPrefix, held_tokens: int = 0,
                view: ClusterView | None = None) -> tuple[Future, ...]:
        """``tokens`` rebuilt on ``worker`` from the ``held_tokens`` leading tokens it already
        holds (block-aligned): its own blocks are read in place, only the rest is prefilled."""
        sid = new_state_id("recompute")
        own = held.futures_of(b for b in held.blocks if b.end <= held_tokens)
        predicted = predict_seconds(view, worker, held_tokens, [len(tokens) - held_tokens], 0) if view is not None else None
        req = tasks.PrefillRequest(tuple(tokens), held_tokens, op="recompute", state_id=sid)
        out = self.submitter.prefill(req, own, worker, predicted_s=predicted)
        bs = self.submitter.block_size
        n = len(split_spans(aligned_floor(held_tokens, bs), len(tokens), bs))
        return tuple(own) + tuple(self.submitter.near(worker, tasks.take_block, out, i,
                                                      key=self.submitter.key(REPLICA, sid, i))
                                  for i in range(n))
