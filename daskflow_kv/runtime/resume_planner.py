"""Where each resumed branch runs, and which branches share one batched task.

Branches over the same blocks share one lookup, so each destination worker gets one
decision and Dask moves (or the plan rebuilds) each block once per worker. The states are
planned one after another on one view: each plan sees the work the previous ones queued
(``ClusterView.with_queue``). Branches that then read the same prefix (same lookup, same
reused tokens, same inputs) on the same worker share one ``prefill_batch``; a lone branch
keeps the plain prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..policy.cluster_view import ClusterView
from ..policy.placement import Placement
from ..state.blocks import reusable_prefix
from . import tasks
from .handles import DistKVState
from .planner import Planner, PlanRequest
from .prefix_cache import HeldPrefix, PrefixCache


@dataclass(frozen=True, slots=True)
class Branch:
    held: HeldPrefix  # the cached prefix of its state (the same object for every branch of that state)
    placement: Placement  # where it runs and how its prefix gets there


@dataclass(slots=True, eq=False)
class ResumePlanner:
    prefixes: PrefixCache  # one lookup per state
    planner: Planner  # views, placements, calibration
    facts: tasks.ModelFacts  # whether prefill stays block-aligned

    def place(self, states: Sequence[DistKVState], prompts: Sequence[Sequence[int]], max_new_tokens: int,
              policy: str, workers: Sequence[str] | None) -> tuple[list[Branch], ClusterView]:
        """One branch per (state, prompt), in order; -> (branches, the view with their work queued)."""
        groups: dict[tuple, list[int]] = {}
        for i, state in enumerate(states):
            groups.setdefault(state.state.block_keys, []).append(i)
        view = None  # the first lookup brings it (one round trip, not two)
        branches: list[Branch | None] = [None] * len(states)
        for idxs in groups.values():
            held = self.prefixes.find(states[idxs[0]].tokens, view=view is None)
            if view is None:
                view = self.planner.view(held.snapshot)
            # decode needs >= 1 fed token; below fp32 a prefill starts on a block boundary
            reused = [reusable_prefix(min(held.tokens, len(prompts[i]) - 1), self.prefixes.block_size,
                                      self.facts.aligned_prefill) for i in idxs]
            new = [len(prompts[i]) - r for i, r in zip(idxs, reused)]
            placements, view = self.planner.place(view, held, PlanRequest(reused, new, max_new_tokens, policy,
                                                                          None, workers))
            for i, p in zip(idxs, placements):
                branches[i] = Branch(held, p)
            for p in placements:  # the next group's plan sees this one's work queued
                view = view.with_queue(p.worker, p.finish_s)
        for b in branches:
            self.planner.record(b.placement)
        return branches, view if view is not None else self.planner.view()


def batch_groups(branches: Sequence[Branch], batch: bool) -> list[list[int]]:
    """Indices of the branches that run as one task: one ``prefill_batch`` when several
    (``batch``), a ``prefill`` each when alone or when not batching."""
    groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(branches):
        p = b.placement
        slot = (id(b.held), p.reused, p.worker, p.action) if batch and p.worker else ("single", i)
        groups.setdefault(slot, []).append(i)
    return list(groups.values())


def split_by_bytes(groups: list[list[int]], nbytes: Callable[[int], int], most: int | None) -> list[list[int]]:
    """Cut each batch so its KV output stays within ``most`` bytes (None: no limit). Under a
    per-worker budget a batch larger than the room one task may take could never be admitted,
    or would hold the budget for every other workflow while it runs; a branch alone is never cut."""
    if most is None:
        return groups
    out = []
    for idxs in groups:
        part, size = [], 0
        for i in idxs:
            if part and size + nbytes(i) > most:
                out.append(part)
                part, size = [], 0
            part.append(i)
            size += nbytes(i)
        out.append(part)
    return out
