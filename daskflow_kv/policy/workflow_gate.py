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
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable

from .. import validation

RENEW_S = 10.0  # how often a run inside renews its place; three missed renewals lose it


def gate_slots(per_worker: float | None, workers: int) -> int | None:
    """Running workflow runs the cluster admits at once: ``per_worker`` x ``workers``, at least
    one (a cluster between workers still admits one run, which waits for a worker as Dask's
    tasks do); None: no gate."""
    if per_worker is None:
        return None
    return max(1, int(per_worker * max(0, workers)))


def valid_per_worker(value, name: str = "workflow gate (running workflows per worker)") -> float | None:
    """``value`` as running workflows per worker, or None (no limit); a one-line error otherwise."""
    return validation.optional(name, value, validation.number, above=0)


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

    def leave(self, run: Hashable) -> bool:
        """``run`` is done (or gave up waiting): its place is free. -> whether it was inside."""
        if run in self._inside:
            tenant = self._inside.pop(run)
            self._count[tenant] -= 1
            if not self._count[tenant]:
                del self._count[tenant]
            return True
        if run in self._waiting:
            seq, tenant = self._waiting.pop(run)
            q = self._lines[tenant]
            q.remove((seq, run))
            if not q:
                del self._lines[tenant]
        return False
