"""The resume step: run placed branches, then publish and register their continuations.

Each group of branches (``resume_planner.batch_groups``) becomes one compute task on its
worker - a ``prefill`` for a lone branch, a ``prefill_batch`` for several - reading its
prefix as the plan decided (``inputs``), plus one small task that hands back the results.
As each group's results come in, its continuations' blocks go through one acquire and its
states through one register (per-branch calls cost two scheduler round trips each, a third
of a k=16 resume's wall, measured; per group, a finished group's output is cut into
blocks the KV budget can spill while a slower group still runs or waits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

from distributed import Future

from ..keys import PREFILL, RESULT
from ..model.sampling import SamplingParams
from ..model.text_codec import TextCodec
from ..policy.cluster_view import ClusterView
from ..state.blocks import aligned_floor, split_spans
from ..state.kv_state import new_state_id
from . import tasks
from .handles import DistGeneration, DistKVState
from .inputs import PrefixInputs, Replicas
from .kv_persistence import PersistentTier
from .planner import Planner, predict_seconds
from .plugin_client import gather_each
from .prefix_cache import PrefixCache
from .publish import NewBlocks, Publisher, blocks_of
from .registry import NewState, StateRegistry
from .resume_planner import Branch, ResumePlanner, batch_groups, split_by_bytes
from .submit import Submitter


@dataclass(slots=True, eq=False)
class Resumer:
    prefixes: InitVar[PrefixCache]  # one lookup per resumed state
    planner: InitVar[Planner]  # placements
    submitter: Submitter  # submits the tasks
    publisher: Publisher  # the continuations' blocks
    registry: StateRegistry  # the continuations
    tier: PersistentTier  # whether resumed blocks are written through
    codec: TextCodec  # decodes the generated text
    facts: tasks.ModelFacts  # whether batched resume reproduces this model's attention
    branches: ResumePlanner = field(init=False)  # places the branches
    inputs: PrefixInputs = field(init=False)  # what each task reads

    def __post_init__(self, prefixes: PrefixCache, planner: Planner):
        self.branches = ResumePlanner(prefixes, planner, self.facts)
        self.inputs = PrefixInputs(self.submitter)

    def run(self, states: Sequence[DistKVState], prompts: Sequence[list[int]], max_new_tokens: int,
            sampling: SamplingParams, policy: str, workers: Sequence[str] | None, return_logits: bool,
            batch: bool) -> list[DistGeneration]:
        """One generation per (state, prompt = state tokens + suffix), validated by the caller."""
        branches, view = self.branches.place(states, prompts, max_new_tokens, policy, workers)
        sids = [new_state_id("resume") for _ in branches]
        reqs = [tasks.PrefillRequest(tuple(prompts[i]), b.placement.reused, max_new_tokens, sampling, i,
                                     return_logits, "resume", sids[i]) for i, b in enumerate(branches)]
        # A model whose attention batched resume cannot reproduce resumes branch by branch,
        # decided here, before anything is submitted.
        groups = batch_groups(branches, batch and self.facts.batch_unsupported is None)
        budget = view.kv_budget_bytes  # one batch takes at most half a worker's budget
        groups = split_by_bytes(groups, lambda i: self.submitter.out_bytes(reqs[i]), budget // 2 if budget else None)
        outputs: list[Future | None] = [None] * len(branches)
        wanted: list[tuple[list[int], Future]] = []  # (branches, future of their small results)
        replicas: Replicas = {}
        for idxs in groups:
            wanted.append((idxs, self._submit(idxs, branches, reqs, outputs, replicas, view, max_new_tokens)))
        replicas.clear()  # the consumers depend on the replica blocks now; Dask frees them after
        gens: list = [None] * len(branches)
        # Each group's continuations are published as soon as its results are in: until its
        # blocks are cut, its output is KV no budget can spill or evict, and a group parked
        # for room on the same worker would wait for it (the outputs of groups already done,
        # held while the slowest finished, deadlocked a tight budget until a preemption).
        for g, got in gather_each(self.submitter.client, [f for _, f in wanted]):
            idxs = wanted[g][0]
            results = dict(zip(idxs, got if isinstance(got, list) else [got]))
            for i, gen in zip(idxs, self._continue(states, prompts, branches, outputs, results, sids, idxs)):
                gens[i] = gen
            for i in idxs:
                outputs[i] = None  # the block tasks read it now: Dask frees it after them
        return gens

    def _submit(self, idxs: list[int], branches: list[Branch], reqs: list[tasks.PrefillRequest],
                outputs: list, replicas: Replicas, view: ClusterView, max_new_tokens: int) -> Future:
        """The task of one group (its outputs set in ``outputs``); -> the future of its small results."""
        held, p = branches[idxs[0]].held, branches[idxs[0]].placement
        inputs, reads = self.inputs.for_placement(held, p, reqs[idxs[0]].tokens, replicas, view)
        predicted = predict_seconds(view, p.worker, p.reused, [len(reqs[i].tokens) - p.reused for i in idxs],
                                    max_new_tokens)
        near = self.submitter.near
        if len(idxs) == 1:
            [i] = idxs
            outputs[i] = self.submitter.prefill(reqs[i], inputs, p.worker, reads, p, predicted)
            return near(p.worker, tasks.take_result, outputs[i], key=self.submitter.key(RESULT, reqs[i].state_id))
        first = next((branches[i].placement for i in idxs if branches[i].placement.first), p)  # pays the decision
        batch_id = reqs[idxs[0]].state_id
        breq = tasks.BatchPrefillRequest(tuple(reqs[i] for i in idxs), p.reused, "resume", f"batch-{batch_id}")
        out = self.submitter.prefill_batch(breq, inputs, p.worker, reads, first, predicted)
        for j, i in enumerate(idxs):  # the branch outputs hold the batch; Dask frees it once they are computed
            outputs[i] = near(p.worker, tasks.take_branch, out, j,
                              key=self.submitter.key(PREFILL, "branch", reqs[i].state_id))
        # One small-results task per batch, not one per branch (each is a scheduler round trip).
        return near(p.worker, tasks.take_batch_results, out, key=self.submitter.key(RESULT, "batch", batch_id))

    def _continue(self, states, prompts, branches, outputs, results: dict, sids, idxs) -> list[DistGeneration]:
        """The continuation state (prompt and generation, all but the last token fed) and the
        generation of each branch of ``idxs`` (one group's: ``results`` by branch)."""
        states, prompts, branches, outputs, sids = ([x[i] for i in idxs] for x in (states, prompts, branches, outputs,
                                                                                   sids))
        results = [results[i] for i in idxs]
        news = []
        for prompt, out, res, b, sid in zip(prompts, outputs, results, branches, sids):
            fed = list(prompt) + list(res.generated[:-1])  # the last sampled token was never fed
            floor = aligned_floor(b.placement.reused, self.submitter.block_size)
            spans = split_spans(floor, len(fed), self.submitter.block_size)
            news.append(NewBlocks(fed, b.held.kept(floor), spans, blocks_of(out, len(spans), res.worker), sid))
        published = self.publisher.publish(news, store=self.tier.writes("resume"))
        conts = self.registry.create([
            NewState(sid, blocks.refs, blocks.futures, "resume", (state,), res.worker,
                     {"placement": b.placement.action, "tokens_reused": b.placement.reused,
                      "tokens_computed": len(prompt) - b.placement.reused})
            for state, prompt, res, b, sid, blocks in zip(states, prompts, results, branches, sids, published)
        ])
        gens = []
        for res, b, cont in zip(results, branches, conts):
            # The prefix rebuilt on a "recompute" destination is charged to its first branch.
            metrics = {**res.metrics, "tokens_recomputed": b.placement.rebuilt_tokens}
            gens.append(DistGeneration(res.generated, self.codec.decode(res.generated), metrics, res.worker,
                                       b.placement, cont, res.logits))
        return gens
