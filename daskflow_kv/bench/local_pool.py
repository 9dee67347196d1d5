"""The ``local`` baseline's hard KV pool: what one vLLM or SGLang instance keeps per worker.

A serving engine has a fixed KV pool. A request is admitted when the blocks it will write
fit beside everything the pool holds - running requests' blocks and the prefix cache
together - after the least recently used cached prefixes nobody runs on are evicted; until
then it waits in line, first come first served (no later request takes the room the first
in line waits for). Here a group of branches over one prefix is one request, and it
reserves at admission all it can write: the part of the prefix the cache lacks and every
branch's suffix and answer (``group_need``). Reserved up front, a running group never
outgrows its room, so no running group is ever preempted (vLLM reserves per step and
preempts the newest request when a step cannot grow; TGI reserves up front, as here). The
same rule as daskflow-kv's budget, which also admits a task by the bytes its output can
hold at most. A group that needs more than the whole pool fails at once with
``KVBudgetError``.

The pool's bytes: ``engine.store.nbytes`` (cached and running groups' published blocks)
plus what running groups reserved and have not published yet (``published`` moves a
group's bytes from the one to the other as it goes). Together they never pass the budget.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

from ..errors import KVBudgetError
from ..state.blocks import aligned_floor

# Room frees through ``finish`` and ``clear``, which wake the line; a second look now and then
# is the backstop for bytes freed any other way (a hold dropped elsewhere), so none waits forever.
_LOOK_AGAIN_S = 1.0


def group_need(prefix_len: int, cached: int, suffix_lens: Sequence[int], max_new: int, block_size: int,
               bytes_per_token: int) -> int:
    """KV bytes a group can add to the pool at most: its prefix from the aligned floor of what
    is cached, and per branch everything past the prefix's aligned floor (the branch's copy
    of the prefix's partial last block, its suffix and its answer). Pure."""
    prefix = prefix_len - aligned_floor(min(cached, prefix_len), block_size)
    tail = prefix_len - aligned_floor(prefix_len, block_size)
    return bytes_per_token * (prefix + sum(tail + s + max_new for s in suffix_lens))


class KVPool:
    """One worker engine's pool: admission by free bytes, LRU eviction of unreferenced cache."""

    def __init__(self, engine, budget: int):
        self.engine = engine  # its store holds the blocks; ``release`` frees what no live state shares
        self.budget = int(budget)  # bytes the pool holds at most
        self.kept: OrderedDict = OrderedDict()  # state id -> KVState cached for reuse, least recently used first
        self.reserved = 0  # bytes promised to running groups, not yet published
        self.evicted_states = 0  # cached states dropped for room since start
        self.evicted_bytes = 0  # bytes those drops freed
        self._cond = threading.Condition()
        self._tickets = itertools.count()
        self._line: deque[int] = deque()  # tickets of groups waiting for room, first come first
        self._running: dict[int, tuple] = {}  # ticket -> (reserved bytes, held prefix keys)

    @property
    def waiting(self) -> int:
        return len(self._line)

    def gauges(self) -> tuple[int, int, int]:
        """(bytes in the store, bytes reserved, groups waiting)."""
        return self.engine.store.nbytes, self.reserved, len(self._line)

    def admit(self, prefix: Sequence[int], suffix_lens: Sequence[int], max_new: int, bytes_per_token: int) -> int:
        """Wait until the group fits, then reserve its room. -> a ticket for ``finish``."""
        eng = self.engine
        with self._cond:
            ticket = next(self._tickets)
            self._line.append(ticket)
            try:
                while True:
                    cached, held = eng.hold_prefix(prefix)  # counted on: not evicted while it waits to run
                    need = group_need(len(prefix), cached, suffix_lens, max_new, eng.block_size, bytes_per_token)
                    if need > self.budget:
                        eng.drop_hold(held)
                        raise KVBudgetError(f"a local group needs {need} KV bytes, more than the whole pool of "
                                            f"{self.budget}")
                    if self._line[0] == ticket and self._make_room(need):
                        self.reserved += need
                        self._running[ticket] = (need, held)
                        return ticket
                    before = eng.store.nbytes
                    eng.drop_hold(held)
                    # A cached prefix our own hold pinned (the evictions above released its
                    # states) is freed by the drop: look again, no finish is coming to wake us.
                    if eng.store.nbytes < before:
                        continue
                    self._cond.wait(timeout=_LOOK_AGAIN_S)
            finally:
                self._line.remove(ticket)
                self._cond.notify_all()  # the next in line looks again

    def _make_room(self, need: int) -> bool:
        """Evict least recently used cached states until ``need`` fits; False if it cannot yet."""
        store = self.engine.store
        for sid in list(self.kept):
            if store.nbytes + self.reserved + need <= self.budget:
                break
            self._evict(sid)
        return store.nbytes + self.reserved + need <= self.budget

    def _evict(self, sid) -> None:
        st = self.kept.pop(sid)
        self.evicted_states += 1
        self.evicted_bytes += self.engine.release(st)

    def published(self, ticket: int, nbytes: int) -> None:
        """A running group put ``nbytes`` of what it reserved into the store: they count there now."""
        with self._cond:
            need, held = self._running[ticket]
            done = min(need, max(0, int(nbytes)))
            self._running[ticket] = (need - done, held)
            self.reserved -= done

    def finish(self, ticket: int, *states) -> None:
        """The group ended (``states``: what it made, cached for reuse; none if it failed):
        its reservation ends, its states join the cache, the pool is trimmed to the budget."""
        with self._cond:
            need, held = self._running.pop(ticket)
            self.reserved -= need
            self.engine.drop_hold(held)
            for st in states:
                self.kept[st.state_id] = st
                self.kept.move_to_end(st.state_id)
            store = self.engine.store
            for sid in list(self.kept):  # published blocks replaced the reservation: trim any excess
                if store.nbytes + self.reserved <= self.budget:
                    break
                self._evict(sid)
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            while self.kept:
                self.engine.release(self.kept.popitem()[1])
            self._cond.notify_all()
