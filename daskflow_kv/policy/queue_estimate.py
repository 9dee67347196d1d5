"""How many seconds of KV work a worker still has queued: the ``busy_s`` placement reads.

One rule for the scheduler plugin (``plugins/kv_queue``, on real task transitions) and the
simulator (``sim.worker``, on modeled requests), so that a simulated plan sees the queue a
real one would. A worker works through what was sent to it at about one predicted second
per second from the moment the first of those tasks reached it (its plans' predictions are
fitted to it); what is planned there and not sent yet - waiting for inputs, parked for
admission - counts whole. Pure: numbers in, seconds out.
"""

from __future__ import annotations


def queued_seconds(sent_s: float, first_sent_at: float | None, now: float, planned_s: float = 0.0) -> float:
    """Seconds still queued: ``sent_s`` (predicted seconds of the unfinished tasks sent there,
    the earliest at ``first_sent_at``; None: none) less the time since, never below 0, plus
    ``planned_s`` not sent yet."""
    if first_sent_at is None:
        return planned_s
    return max(0.0, sent_s - (now - first_sent_at)) + planned_s

