"""Dask's own history of task groups, kept bounded on a scheduler that serves a KV stream.

A KV stream empties and re-creates its task groups with nearly every workflow; Dask keeps each
dead group in the span (and ``Computation``) that saw it and opens a new default span whenever
the last one is done, for the scheduler's life (dask/distributed#7977): on a long-running
scheduler, memory that grows with the workflows served (the soak's +24 %). Every
``INTERVAL_S`` this forgets the dead groups, and a default span once it has been dead for
``SPAN_DEAD_S`` and every worker has since sent a heartbeat (one collected before would name
it, and a heartbeat naming an unknown span closes its worker). A span that lives on (the one
holding cached blocks) also appends one metadata entry per graph submitted, the same
``{"type": "Future"}`` each time: repeats are dropped. What touches Dask's internals
is in ``daskflow_kv.dask_internals``.
"""

from __future__ import annotations

from daskflow_kv import dask_internals as di

INTERVAL_S = 10.0  # how often the history is pruned (a pass is linear in what it holds)
SPAN_DEAD_S = 30.0  # a dead span stays at least this long
HEARTBEAT_MARGIN_S = 10.0  # ... and until every worker's latest heartbeat arrived this long after it died


def spans_to_drop(dead_since: dict[str, float], now: float, oldest_heartbeat: float) -> list[str]:
    """Dead spans no worker can name any more. Pure."""
    return [k for k, t in dead_since.items()
            if now - t >= SPAN_DEAD_S and oldest_heartbeat >= t + HEARTBEAT_MARGIN_S]


class SpanHistory:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.dead_since: dict[str, float] = {}  # default span id -> when it was first seen dead
        self.next_at = 0.0

    def prune(self, now: float) -> None:
        if now < self.next_at:
            return
        self.next_at = now + INTERVAL_S
        s = self.scheduler
        di.prune_dead_groups(s)
        di.compact_span_metadata(s)
        spans = {sp.id: sp for sp in di.default_spans(s)[:-1]}  # the newest may get the next task
        self.dead_since = {k: self.dead_since.get(k, now) for k, sp in spans.items() if di.span_is_dead(s, sp)}
        expired = spans_to_drop(self.dead_since, now, di.oldest_heartbeat(s))
        if expired:
            di.drop_spans(s, [spans[k] for k in expired])
            for k in expired:
                del self.dead_since[k]
