"""Whether a KV task may start on its worker under the byte budget. Pure policy.

The budget is a hard limit on the KV a worker holds: before a task that will add KV to a
worker (its output blocks, and the blocks it fetches from other workers) is sent there,
the worker must have room for all of it. Room is made by evicting unpinned blocks first
(``eviction.choose_victims``: the same rules as the budget loop). If the pinned working
set alone leaves no room, the task waits in line: overload is queueing, never failure.
It fails - with a message naming the budget, the working set and what the task needs -
only when it can never fit (it needs more than the whole budget). When nothing can free
room any more - no KV task runs anywhere in the cluster and nothing was released for
``patience`` seconds: every pinned block belongs to a state some client keeps while it
waits for a parked task, a deadlock waiting cannot end - the task is ``STUCK``: the
plugin preempts the youngest stuck task (fails it with ``KVPreempted``, as vLLM preempts
its newest request), whose workflow releases its states and retries, so the older ones
go on. Neither exceeding the budget nor hanging.

Tenants with a quota (KV bytes per worker guaranteed to them) are kept apart: a task of
one tenant may evict another tenant's blocks only down to that tenant's quota (the floors
of ``choose_victims``), and may not fill the room another tenant's quota keeps free for it
(the part of the quota it does not hold yet), so one tenant pinning blocks cannot make
another's next prefill fail.

When a worker keeps a spill disk, a waiting task whose room is pinned by blocks that no
running task reads need not wait, nor preempt anyone: those blocks go to the spill disk
(``blocks_to_spill``) - their runs keep them, nothing is recomputed, and a task that reads
one later is admitted with room to read it back. Whose go first (``spill_order``): younger
runs', then the waiting task's own run's (those it does not read), older runs' last - as a
serving engine swaps its newest requests out first. Reading back costs a disk read where
preemption cost a prefill and a wait on the client.

Plain numbers in, one ``Admission`` out; the scheduler plugin does what it says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .eviction import BlockUsage, choose_victims

ADMIT, WAIT, FAIL, STUCK = "admit", "wait", "fail", "stuck"


@dataclass(frozen=True, slots=True)
class Admission:
    action: str  # admit | wait | fail | stuck
    victims: tuple[str, ...] = ()  # blocks to evict before the task is sent (admit)
    reason: str = ""  # why it waits or fails, for the user


def _mib(n: float) -> str:
    """Bytes for a person: 48.2 KiB, 3.0 MiB, 1.5 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True, slots=True)
class Tenancy:
    """Whose task it is and what every tenant is guaranteed on the worker (empty: no quotas)."""

    owner: str | None = None  # the tenant the task's blocks will belong to
    quotas: Mapping[str, int] | None = None  # tenant -> KV bytes per worker guaranteed to it
    held: Mapping[str | None, int] | None = None  # tenant -> KV bytes it holds on the worker now
    reserved: Mapping[str | None, int] | None = None  # tenant -> bytes promised to its running tasks there

    def others(self) -> dict[str, int]:
        """The other tenants' quotas: floors this task's evictions respect."""
        return {o: q for o, q in (self.quotas or {}).items() if o != self.owner and q > 0}

    def unclaimed(self) -> int:
        """Room the other tenants' quotas keep free: the part of each they do not hold yet."""
        held, reserved = self.held or {}, self.reserved or {}
        return sum(max(0, q - held.get(o, 0) - reserved.get(o, 0)) for o, q in self.others().items())


NO_TENANCY = Tenancy()


def admit(need: int, held: int, reserved: int, budget: int, blocks: Iterable[BlockUsage], now: float,
          busy: bool = False, waited: float = 0.0, patience: float = 0.0, worker: str = "the worker",
          tenancy: Tenancy = NO_TENANCY) -> Admission:
    """Decide for a task needing ``need`` more KV bytes on a worker.

    held: KV bytes the worker holds now; reserved: bytes already promised to tasks sent
    there and still running; blocks: what the worker holds, for eviction; busy: KV tasks
    are running somewhere (their ends release states); waited: seconds since the task was
    parked or anything last freed KV, whichever is later; patience: how long it may wait
    with no progress at all; tenancy: whose task it is and the tenants' quotas.
    """
    if need > budget:
        return Admission(FAIL, reason=f"this task needs {_mib(need)} of KV on {worker}, more than the whole "
                                      f"budget of {_mib(budget)}; raise daskflow-kv.kv-budget")
    others = tenancy.others()
    if need > budget - sum(others.values()):
        return Admission(FAIL, reason=f"this task of {tenancy.owner!r} needs {_mib(need)} of KV on {worker}, more "
                                      f"than the budget of {_mib(budget)} leaves beside the other tenants' quotas "
                                      f"({_mib(sum(others.values()))}); raise daskflow-kv.kv-budget")
    room = budget - tenancy.unclaimed()
    total = held + reserved + need
    if total <= room:
        return Admission(ADMIT)
    plan = choose_victims(blocks, total, room, now, floors=others, held=tenancy.held)
    if not plan.over_budget_pinned:
        return Admission(ADMIT, plan.victims)
    pinned = plan.remaining_bytes - reserved - need
    why = (f"KV budget {_mib(budget)} on {worker}: this task needs {_mib(need)}, {_mib(reserved)} are promised "
           f"to running tasks and {_mib(pinned)} are pinned (live states, leases, running readers)"
           + (f" or kept for other tenants' quotas ({_mib(budget - room)} of them unused)" if others else "")
           + "; release states or raise daskflow-kv.kv-budget")
    return Admission(WAIT if (busy or waited < patience) else STUCK, reason=why)


def runs_to_preempt(pins: Iterable[tuple[int, frozenset | None]], younger: list, lacking: int) -> list:
    """Which workflow runs to preempt so that a waiting task finds the ``lacking`` bytes it
    needs: the fewest, taken in order from ``younger`` (the candidates, youngest first).

    pins: each pinned block as (bytes, the runs keeping it; None when something no
    preemption frees keeps it too). A block is freed once every run keeping it is preempted.
    -> the runs, or [] when even all of them would not free enough.
    """
    if lacking <= 0:
        return []
    pins = [(n, runs) for n, runs in pins if runs]
    chosen: list = []
    for run in younger:
        chosen.append(run)
        gone = set(chosen)
        if sum(n for n, runs in pins if runs <= gone) >= lacking:
            # Drop those whose release turned out not to matter (younger runs tried first).
            for r in list(chosen[:-1]):
                rest = gone - {r}
                if sum(n for n, runs in pins if runs <= rest) >= lacking:
                    chosen.remove(r)
                    gone = rest
            return chosen
    return []


class Room(NamedTuple):
    """One worker a stuck task could run on, seen from the task."""

    worker: str
    lacking: int  # bytes it lacks there once every unpinned block is evicted (<= 0: it fits now)
    pins: list  # that worker's pinned blocks, as ``runs_to_preempt`` takes them


def make_room(rooms: Sequence[Room], younger: list) -> tuple[str, list] | None:
    """Where the oldest task of a stuck line should run, and which workflow runs to preempt
    there: a worker where it fits now, preempting none (moving it costs a transfer of its
    inputs, a preemption a redo); else its planned worker (``rooms[0]``) if preempting some
    of ``younger`` (youngest first) frees its room there; else the worker where that takes
    the fewest runs. None when no worker's room can be freed by preempting younger runs:
    its own run's states, or older runs', hold it everywhere.
    """
    fits = next((r.worker for r in rooms if r.lacking <= 0), None)
    if fits is not None:
        return fits, []
    best = None
    for i, r in enumerate(rooms):
        runs = runs_to_preempt(r.pins, younger, r.lacking)
        if runs and i == 0:
            return r.worker, runs
        if runs and (best is None or len(runs) < len(best[1])):
            best = (r.worker, runs)
    return best


def blocks_to_spill(pins: Iterable[tuple[str, int, frozenset | None]], younger: list, lacking: int,
                    keep: frozenset = frozenset()) -> list[str]:
    """Pinned blocks to move to the spill disk so that a waiting task finds the ``lacking``
    bytes it needs: those of the fewest runs of ``younger`` (youngest first) whose blocks,
    spilled, free that much (``runs_to_preempt``). ``pins``: (key, bytes in memory, the runs
    keeping it; None when something no run accounts for keeps it, such as a running task
    reading it). ``keep``: blocks the waiting task reads itself. -> keys, or [] when even all
    of ``younger`` would not free enough."""
    pins = [(k, n, runs) for k, n, runs in pins if runs and n > 0 and k not in keep]
    runs = runs_to_preempt([(n, r) for _, n, r in pins], younger, lacking)
    gone = set(runs)
    return [k for k, _, r in pins if r <= gone] if runs else []


def spill_order(ranks: Mapping, head_run, head_rank: float) -> list:
    """The runs whose idle blocks a waiting task (of ``head_run``, placed in line at
    ``head_rank``) may have spilled, in the order they go: younger runs youngest first, then
    its own run, then older runs, the oldest last. ``ranks``: run -> when it was first seen
    (None: no task of it is in line or was lately - an idle run, taken first of all)."""
    at = {r: (float("inf") if t is None else t) for r, t in ranks.items()}
    younger = sorted((r for r, t in at.items() if t > head_rank and r != head_run), key=lambda r: (at[r], str(r)),
                     reverse=True)
    older = sorted((r for r, t in at.items() if t <= head_rank and r != head_run), key=at.get, reverse=True)
    return younger + ([head_run] if head_run in at else []) + older
