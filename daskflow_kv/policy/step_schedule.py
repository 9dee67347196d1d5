"""Who runs in a worker's next forward step, and how many tokens each feeds. Pure policy.

A worker's step loop (``model.step_engine``) runs one forward per step over every running
request: iteration-level scheduling as in Orca (OSDI'22), with chunked prefill as in
Sarathi-Serve (OSDI'24). Each step:

1. Waiting requests join in arrival order while fewer than ``max_running`` run (their KV
   was admitted under the budget before their task reached the worker).
2. Every decoding request feeds one token: decodes are never stalled by a newcomer.
3. What is left of ``step_tokens`` goes to prefilling requests, oldest first, each a chunk
   of its remaining prompt. The oldest prefilling request always feeds something, so a
   prompt longer than the budget still makes progress. A request whose prefill must end
   on absolute block boundaries (below fp32, see ``ModelRunner._prefill``) gets exactly the
   chunk a single prefill would feed next, or waits for the next step.

Requests that cannot share a forward exactly (``solo``) are planned the same way but run in
their own rows. Plain data in (``Seq``), one ``StepPlan`` out; unit-tested with a fake clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Seq:
    """A request as the step policy sees it."""

    rid: int  # request id, unique in its engine
    arrived: float  # when it was submitted (any clock; only the order matters)
    to_prefill: int  # prompt tokens not fed yet (0: decoding)
    position: int  # tokens in its cache so far (where its next chunk starts)
    solo: bool = False  # runs in its own rows: it cannot share a forward exactly
    align: int = 0  # > 0: a prefill chunk ends on a multiple of this absolute position

    @property
    def decoding(self) -> bool:
        return self.to_prefill == 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: who joins, and (request id, tokens fed) for every request that runs."""

    joined: tuple[int, ...]  # waiting requests admitted to the running set now, in order
    feeds: tuple[tuple[int, int], ...]  # (rid, tokens) in the order rows are packed

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.feeds)

    def fed(self, rid: int) -> int:
        return next((n for r, n in self.feeds if r == rid), 0)


def chunk(seq: Seq, room: int, finish_slack: int = 0) -> int:
    """Tokens ``seq`` feeds in a step with ``room`` tokens left (0: it waits); a prompt that
    would be left with at most ``finish_slack`` tokens (of a non-empty chunk) is fed whole."""
    if seq.decoding:
        return 1
    if seq.align:
        # The chunk a single prefill feeds next: up to the next block boundary. Below fp32 a
        # shorter chunk would round differently from text mode (ModelRunner._prefill).
        piece = min(seq.to_prefill, (seq.position // seq.align + 1) * seq.align - seq.position)
        return piece if piece <= room else 0
    if room > 0 and seq.to_prefill - room <= finish_slack:
        return seq.to_prefill
    return min(seq.to_prefill, room)


def plan_step(running: Sequence[Seq], waiting: Sequence[Seq], step_tokens: int, max_running: int,
              finish_slack: int | None = None) -> StepPlan:
    """The next step for ``running`` requests plus those of ``waiting`` that may join.

    ``step_tokens``: the step's token budget (decode rows count one each);
    ``max_running``: how many requests may hold a place in the running set at once;
    ``finish_slack``: how far past the budget a prompt's last chunk may go (default
    ``step_tokens // 8``).
    """
    if step_tokens < 1 or max_running < 1:
        raise ValueError(f"step_tokens and max_running must be >= 1, got {step_tokens}, {max_running}")
    joined = sorted(waiting, key=lambda s: (s.arrived, s.rid))[: max(0, max_running - len(running))]
    active = sorted([*running, *joined], key=lambda s: (s.arrived, s.rid))
    feeds: list[tuple[int, int]] = [(s.rid, 1) for s in active if s.decoding]
    room = step_tokens - len(feeds)
    slack = step_tokens // 8 if finish_slack is None else finish_slack
    first = True
    for s in active:
        if s.decoding:
            continue
        n = chunk(s, max(0, room), slack)
        if n == 0 and first:  # the oldest prompt always advances, even past the budget
            n = chunk(s, s.to_prefill)
        first = False
        if n:
            feeds.append((s.rid, n))
            room -= n
    return StepPlan(tuple(s.rid for s in joined), tuple(feeds))
