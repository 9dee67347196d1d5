"""Whether a KV task may start on its worker under the byte budget. Pure policy.

The budget is a hard limit on the KV a worker holds: before a task that will add KV to a
worker (its output blocks, and the blocks it fetches from other workers) is sent there,
the worker must have room for all of it. Room is made by evicting unpinned blocks first
(``eviction.choose_victims``: the same rules as the budget loop). If the pinned working
set alone leaves no room, the task waits - while other KV tasks run on that worker, and
for a while in any case (a lookup's lease expires, a client's release is on its way) -
and then fails with a message naming the budget, the working set and what the task
needs, rather than exceed the budget or hang.

Plain numbers in, one ``Admission`` out; the scheduler plugin does what it says.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .eviction import BlockUsage, choose_victims

ADMIT, WAIT, FAIL = "admit", "wait", "fail"


@dataclass(frozen=True, slots=True)
class Admission:
    action: str  # admit | wait | fail
    victims: tuple[str, ...] = ()  # blocks to evict before the task is sent (admit)
    reason: str = ""  # why it waits or fails, for the user


def _mib(n: float) -> str:
    """Bytes for a person: 48.2 KiB, 3.0 MiB, 1.5 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def admit(need: int, held: int, reserved: int, budget: int, blocks: Iterable[BlockUsage], now: float,
          busy: bool = False, waited: float = 0.0, patience: float = 0.0, worker: str = "the worker") -> Admission:
    """Decide for a task needing ``need`` more KV bytes on a worker.

    held: KV bytes the worker holds now; reserved: bytes already promised to tasks sent
    there and still running; blocks: what the worker holds, for eviction; busy: other KV
    tasks are running there; waited: seconds the task has been parked; patience: how long
    it may wait when nothing runs there.
    """
    if need > budget:
        return Admission(FAIL, reason=f"this task needs {_mib(need)} of KV on {worker}, more than the whole "
                                      f"budget of {_mib(budget)}; raise daskflow-kv.kv-budget")
    total = held + reserved + need
    if total <= budget:
        return Admission(ADMIT)
    plan = choose_victims(blocks, total, budget, now)
    if not plan.over_budget_pinned:
        return Admission(ADMIT, plan.victims)
    pinned = plan.remaining_bytes - reserved - need
    why = (f"KV budget {_mib(budget)} on {worker}: this task needs {_mib(need)}, {_mib(reserved)} are promised "
           f"to running tasks and {_mib(pinned)} are pinned (live states, leases, running readers); "
           "release states or raise daskflow-kv.kv-budget")
    return Admission(WAIT if (busy or waited < patience) else FAIL, reason=why)
