"""The materialize step (materialize, extend, merge): reuse what is cached, prefill the rest.

1. Look the tokens up in memory (any client's blocks in this namespace), then in the
   persistent store (``store_reader``: loaded when loading beats prefilling).
2. If tokens are left to prefill, place the prefill (``placement.materialize_policy``: where
   the cached prefix is when it is at least half the prompt, else by earliest finish; or
   the worker the caller named) and prefill them on one worker, or split over several
   (``parallel_materialize``). If the request ends inside a cached block, cut that block.
3. Publish the new blocks (written through to the store for shared states) and register
   the state.

A merge that can concatenate (``state.compat.check_concat``) makes no block at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import MergeError
from ..policy.placement import materialize_policy, read_blocks
from ..state import compat
from ..state.blocks import aligned_floor, common_prefix_len, reusable_prefix, split_spans
from ..state.kv_state import new_state_id
from . import tasks
from .handles import DistKVState
from .inputs import PrefixInputs
from .kv_persistence import PersistentTier
from .parallel_materialize import ParallelPrefill
from .planner import Planner, PlanRequest, predict_seconds
from .prefix_cache import PrefixCache
from .publish import BlockSource, NewBlocks, Publisher, blocks_of
from .registry import NewState, StateRegistry
from .store_reader import StoreReader
from .submit import Submitter


@dataclass(slots=True, eq=False)
class Materializer:
    prefixes: PrefixCache  # memory lookups
    tier: PersistentTier  # whether new blocks are written through
    planner: Planner  # where the prefill runs
    submitter: Submitter  # submits the prefill
    publisher: Publisher  # the new blocks
    registry: StateRegistry  # the new state (and a concatenating merge's)
    facts: tasks.ModelFacts  # longest position, whether prefill stays block-aligned
    store_reader: StoreReader = field(init=False)  # the store read path
    parallel: ParallelPrefill = field(init=False)  # whether a prefill is split, and the chunk tasks
    inputs: PrefixInputs = field(init=False)  # the cached prefix a single prefill reads

    def __post_init__(self):
        self.store_reader = StoreReader(self.submitter.client, self.tier, self.planner, self.submitter, self.publisher,
                                        self.prefixes.key_digest, self.facts.bytes_per_token)
        self.parallel = ParallelPrefill(self.planner, self.submitter, self.facts)
        self.inputs = PrefixInputs(self.submitter)

    @property
    def block_size(self) -> int:
        return self.submitter.block_size

    def run(self, tokens: Sequence[int], op: str, parents: Sequence[DistKVState], worker: str | None = None,
            parallel: int | str = 1, **detail) -> DistKVState:
        """The state of ``tokens`` made by ``op`` from ``parents`` (``detail``: its lineage's)."""
        compat.check_positions(0, len(tokens), 0, self.facts.max_positions)
        sid = new_state_id(op)
        held = self.prefixes.find(tokens, view="uncovered")  # a prefill is planned on the view: same round trip
        in_memory = held.tokens
        held = self.store_reader.extend(tokens, held, worker, sid)  # a miss in memory may hit the store
        reused = held.tokens
        if reused < len(tokens):  # a prefill follows: below fp32 it starts on a block boundary
            reused = reusable_prefix(reused, self.block_size, self.facts.aligned_prefill)
        floor = aligned_floor(reused, self.block_size)
        if reused > in_memory:
            detail["tokens_from_store"] = reused - in_memory
        spans: list[tuple[int, int]] = []
        sources: list[BlockSource] = []  # where each new block is cut from (per chunk, when split)
        target = None  # where the new blocks are made (the last chunk's worker, when split)
        if reused < len(tokens):
            # the lookup's view, unless a store load was queued since (the plan must see it)
            view = self.planner.view(held.snapshot if reused <= in_memory else None)
            policy = materialize_policy(view, reused, len(tokens) - reused)
            [p], view = self.planner.place(view, held, PlanRequest([reused], [len(tokens) - reused], 0, policy, worker))
            self.planner.record(p)
            split = self.parallel.plan(view, p.worker, reused, len(tokens), reused, parallel)
            if split is not None:  # every chunk reads the cached prefix where it is (Dask moves it)
                reads = read_blocks(held.match, reused)
                spans, sources = self.parallel.submit(split, tokens, reused, held.futures_of(reads),
                                                      [b.key for b in reads], sid, op)
                detail["parallel"] = split.width
                target = sources[-1].worker
            else:
                inputs, reads = self.inputs.for_placement(held, p, tokens, {}, view)
                req = tasks.PrefillRequest(tuple(tokens), reused, op=op, state_id=sid)
                out = self.submitter.prefill(req, inputs, p.worker, reads, p,
                                             predict_seconds(view, p.worker, reused, [len(tokens) - reused], 0))
                spans = split_spans(floor, len(tokens), self.block_size)
                sources, target = blocks_of(out, len(spans), p.worker), p.worker
        elif floor < reused:  # all cached; the request ends inside a cached block: cut it, no prefill
            tail = held.blocks[-1]
            target = next(iter(tail.where), None)
            spans, sources = [(floor, reused)], [BlockSource(held.futures[tail.key], reused - floor, target, cut=True)]
        writes = self.tier.writes(op)
        [blocks] = self.publisher.publish([NewBlocks(tokens, held.kept(floor), spans, sources, sid)], store=writes)
        if writes:  # a shared state is stored whole, reused blocks too: a gap would cut it short
            self.tier.write_reused(held, floor)
        [state] = self.registry.create([NewState(sid, blocks.refs, blocks.futures, op, parents, target,
                                                 {**detail, "tokens_reused": reused,
                                                  "tokens_computed": len(tokens) - reused})])
        return state

    def merge(self, a: DistKVState, b: DistKVState, how: str) -> DistKVState:
        """``a`` then ``b``'s tokens after their common prefix: ``b``'s blocks reused as they are
        when ``a`` is provably their prefix (concat), else prefilled after ``a`` (text)."""
        if how in ("auto", "concat"):
            try:
                compat.check_concat(a.state, b.state)
                child = b.state.derive("merge", (a.state_id, b.state_id), how="concat")
                return self.registry.adopt([child], b.futures)[0]
            except MergeError:
                if how == "concat":
                    raise
        extra = list(b.tokens[common_prefix_len(a.tokens, b.tokens):])
        if not extra:
            raise MergeError(f"cannot merge {a.state_id} and {b.state_id}", ["b adds nothing after a"])
        return self.run(list(a.tokens) + extra, "merge", (a, b), how="text", reduced_tokens=len(extra))
