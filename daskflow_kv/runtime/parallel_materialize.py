"""Client side of parallel materialize: choose the workers, submit one chunk task per worker.

``plan`` asks ``policy.parallel_prefill`` for W and the chunk spans, from the view the
single-prefill plan was made with (fitted profiles, measured links, which workers are
idle). ``submit`` sends the W chunk tasks - each strictly on its worker, all admitted
together under a KV budget (a *gang*, see ``plugins.kv_budget``), so none sits on its
worker's only thread waiting for a peer the budget parked - and says, per new block, which
task's output it is cut from and on which worker (a ``BlockSource``). The publish step then
gives every block the same content-addressed key a single prefill would.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from distributed import Future

from .. import config, validation
from ..keys import PREFILL
from ..plugins.handoff import Patience
from ..policy.cluster_view import ClusterView
from ..policy.cost_model import LinkProfile, PrefillProfile
from ..policy.parallel_prefill import ParallelPlan, choose_parallelism
from ..state.blocks import aligned_floor, split_spans
from . import tasks
from .chunk_task import ChunkRequest, prefill_chunk
from .planner import Planner
from .publish import BlockSource, blocks_of
from .submit import ComputeTask, Submitter


def width(parallel) -> str | int:
    """``parallel`` as "auto" or a worker count; None takes ``daskflow-kv.parallel.materialize``."""
    return validation.setting("parallel.materialize", parallel, "parallel", validation.parallelism)


def _slowest_link(view: ClusterView, workers: Sequence[str]) -> LinkProfile | None:
    links = [view.link(a, b) for a in workers for b in workers if a < b]
    if not links or any(link is None for link in links):
        return None
    return min(links, key=lambda link: link.bandwidth)


def patience() -> Patience:
    return Patience(config.get_seconds("parallel.start-timeout"), config.get_seconds("parallel.stall-timeout"),
                    config.get_seconds("parallel.probe-interval"), config.get_seconds("parallel.send-timeout"))


@dataclass(slots=True, eq=False)
class ParallelPrefill:
    planner: Planner  # views and calibration for a forced width
    submitter: Submitter  # submits the chunk tasks
    facts: tasks.ModelFacts  # K/V bytes per token, layers, whether prefill must stay block-aligned
    plans: deque[ParallelPlan] = field(default_factory=lambda: deque(maxlen=256))  # every choice, oldest first

    @property
    def block_size(self) -> int:
        return self.submitter.block_size

    def plan(self, view: ClusterView, target: str | None, start: int, end: int, reused: int,
             parallel) -> ParallelPlan | None:
        """The plan for prefilling [start, end) on ``target`` and helpers; None: one worker.

        "auto" considers idle workers only and needs measurements (it never calibrates:
        without a profile it cannot predict a gain, so it stays on one worker). A forced W
        takes any live workers and calibrates if it must, to balance the chunks.
        """
        w = width(parallel)
        if w == 1 or target is None or target not in view.workers:
            return None
        if self.facts.aligned_prefill:
            # Below fp32 only text mode's own chunk shapes are bit-exact (ModelRunner._prefill); a
            # relayed chunk is fed whole. Such models prefill on one worker, whatever was asked.
            return None
        others = [x for x in sorted(view.workers) if x != target]
        if w == "auto":
            others = [x for x in others if not view.workers[x].processing]
        else:
            others = others[: w - 1]
        if not others:
            return None
        pool = [target, *others]
        profiles = {x: view.profile(x) for x in pool}
        link = _slowest_link(view, pool)
        if any(p is None for p in profiles.values()) or link is None:
            if w == "auto":
                return None
            view = self.planner.calibrated_view()
            profiles = {x: view.profile(x) for x in pool}
            link = _slowest_link(view, pool)
            if any(p is None for p in profiles.values()):
                return None
        # Workers of one cluster are alike: their fits differ mostly by noise, and a chunk slowed by
        # a busy neighbour must not shrink that worker's next chunk. Balance on their mean.
        mean = PrefillProfile(*(sum(getattr(p, f) for p in profiles.values()) / len(profiles) for f in "abc"))
        profiles = dict.fromkeys(pool, mean)
        bpt = self.facts.bytes_per_token
        p = choose_parallelism(start, end, target, others, profiles, link, bpt, self.facts.num_layers,
                               self.block_size, config.get("parallel.min-gain"), None if w == "auto" else w,
                               reused * bpt)
        self.plans.append(p)
        return p if p.width > 1 else None

    def submit(self, p: ParallelPlan, tokens: Sequence[int], reused: int, inputs: Sequence[Future],
               reads: Sequence[str], sid: str, op: str) -> tuple[list[tuple[int, int]], list[BlockSource]]:
        """The chunk tasks of ``p``; -> (the new blocks' spans, where each is cut from)."""
        group = f"{sid}-{secrets.token_hex(6)}"
        end = p.spans[-1][1]
        spans, sources = [], []
        for i, (worker, (s, e)) in enumerate(zip(p.workers, p.spans)):
            req = ChunkRequest(tuple(tokens[:end]), reused, p.spans, p.workers, i, group, patience(), op, sid)
            first = aligned_floor(s, self.block_size)
            out = self.submitter.compute(ComputeTask(
                prefill_chunk, req, inputs, self.submitter.key(PREFILL, op, f"{sid}-c{i}"), op, sid, worker, reads,
                kv_out=(e - first) * self.facts.bytes_per_token,
                extra={"gang": group, "gang_size": p.width, "chunk": i}))
            chunk_spans = split_spans(first, e, self.block_size)
            spans += chunk_spans
            sources += blocks_of(out, len(chunk_spans), worker)
        return spans, sources
