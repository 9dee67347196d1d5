"""How many workflow runs a cluster lets in at once, and which waiting run goes next. Pure policy.

A serving engine caps what it runs at once (vLLM's ``max_num_seqs``, a gateway's concurrency
limit) and queues the rest: past the point where workers are busy, every run let in adds
its documents to the caches and its steps to the queues of the runs already in, and all of
them finish later. The workflow gate does the same at the level of whole workflows: at most
``per_worker`` running workflow runs per worker, the rest waiting in line. Its latency counts
the wait (a run is timed from its arrival, not from its admission).

Who goes next: the waiting run of the tenant with the fewest runs inside, ties in arrival
order - plain FIFO when one tenant uses the cluster, and one tenant's burst waiting in
line does not keep another's runs behind it as places come free (runs already inside keep
their places until they end: there is no per-tenant share). The simulator
(``sim.systems``) drives the same line with virtual time; the scheduler plugin
(``plugins/kv_gate``) with real waiters.

Under a KV budget the gate also backs off by itself (``BackOff``), as a serving engine
sends a preempted request back to its waiting queue: when the budget preempts a run to
break a deadlock - the runs inside hold more KV than the workers have, each waiting for
room another keeps - that run goes back to the head of its line and the cluster lets in at
most as many runs as are still inside; one more at most every ``CALM_S`` that passes
without a deadlock. A cluster too full for its runs then runs fewer of them, down to one,
instead of preempting the same runs into the same deadlock again and again.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable

from .. import plain_checks

RENEW_S = 10.0  # how often a run inside renews its place; three missed renewals lose it
CALM_S = 10.0  # time without a deadlock after which a backed-off gate lets in one run more


def gate_slots(per_worker: float | None, workers: int) -> int | None:
    """Running workflow runs the cluster admits at once: ``per_worker`` x ``workers``, at least
    one (a cluster between workers still admits one run, which waits for a worker as Dask's
    tasks do); None: no gate."""
    if per_worker is None:
        return None
    return max(1, int(per_worker * max(0, workers)))


def valid_per_worker(value, name: str = "workflow gate (running workflows per worker)") -> float | None:
    """``value`` as running workflows per worker, or None (no limit); a one-line error otherwise."""
    return plain_checks.optional(name, value, plain_checks.number, above=0)


class GateLine:
    """The runs inside and the runs waiting, per tenant, in arrival order.

    ``arrive`` puts a run in line; ``admit(slots)`` lets in who goes next while there is room
    and returns them; ``leave`` takes a run out, inside or still waiting. The caller wakes
    whom ``admit`` returns.
    """

    __slots__ = ("_inside", "_count", "_lines", "_waiting", "_seq")

    def __init__(self):
        self._inside: dict[Hashable, Hashable] = {}  # run -> its tenant
        self._count: Counter = Counter()  # tenant -> runs inside
        self._lines: dict[Hashable, deque] = {}  # tenant -> deque[(arrival number, run)]
        self._waiting: dict[Hashable, tuple[int, Hashable]] = {}  # run -> (arrival number, tenant)
        self._seq = 0

    @property
    def running(self) -> int:
        return len(self._inside)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def is_inside(self, run: Hashable) -> bool:
        return run in self._inside

    def held(self, tenant: Hashable) -> int:
        """``tenant``'s runs inside and waiting."""
        return self._count[tenant] + len(self._lines.get(tenant, ()))

    def arrive(self, run: Hashable, tenant: Hashable = None) -> None:
        """``run`` waits at the back of its tenant's line (once: a run inside or waiting stays put)."""
        if run in self._inside or run in self._waiting:
            return
        self._seq += 1
        self._waiting[run] = (self._seq, tenant)
        self._lines.setdefault(tenant, deque()).append((self._seq, run))

    def admit(self, slots: int | None) -> list:
        """Let runs in while fewer than ``slots`` are inside (None: all); -> those let in, in order."""
        out = []
        while self._lines and (slots is None or len(self._inside) < slots):
            # the tenant with the fewest runs inside, then the earliest arrival
            tenant = min(self._lines, key=lambda t: (self._count[t], self._lines[t][0][0]))
            q = self._lines[tenant]
            _, run = q.popleft()
            del self._waiting[run]
            if not q:
                del self._lines[tenant]
            self._inside[run] = tenant
            self._count[tenant] += 1
            out.append(run)
        return out

    def push_back(self, run: Hashable) -> bool:
        """``run`` leaves its place and waits at the head of the line (it was preempted: it goes
        in again before every run still waiting, all of which came after it). -> whether it
        was inside."""
        if run not in self._inside:
            return False
        tenant = self.leave_place(run)
        first = min((seq for q in self._lines.values() for seq, _ in q), default=self._seq + 1)
        self._waiting[run] = (first - 1, tenant)
        self._lines.setdefault(tenant, deque()).appendleft((first - 1, run))
        return True

    def leave_place(self, run: Hashable) -> Hashable:
        """``run`` (inside) gives up its place. -> its tenant."""
        tenant = self._inside.pop(run)
        self._count[tenant] -= 1
        if not self._count[tenant]:
            del self._count[tenant]
        return tenant

    def leave(self, run: Hashable) -> bool:
        """``run`` is done (or gave up waiting): its place is free. -> whether it was inside."""
        if run in self._inside:
            self.leave_place(run)
            return True
        if run in self._waiting:
            seq, tenant = self._waiting.pop(run)
            q = self._lines[tenant]
            q.remove((seq, run))
            if not q:
                del self._lines[tenant]
        return False


class BackOff:
    """How many runs a gate lets in after KV deadlocks: ``cut`` to the runs still inside when
    one is sent back, ``grow`` by one at most every ``calm_s`` without a cut (a cluster finds
    how many runs its budget holds)."""

    __slots__ = ("cap", "_since")

    def __init__(self):
        self.cap: int | None = None  # runs let in at most (None: no back-off)
        self._since = float("-inf")  # when the cap last changed

    def cut(self, running: int, now: float) -> None:
        self.cap, self._since = max(1, running), now

    def grow(self, now: float, calm_s: float = CALM_S) -> None:
        if self.cap is not None and now - self._since >= calm_s:
            self.cap, self._since = self.cap + 1, now

    def limit(self, slots: int | None) -> int | None:
        """The places there are: the configured ``slots`` (None: no limit) and the cap, the fewer."""
        if self.cap is None:
            return slots
        return self.cap if slots is None else min(slots, self.cap)
