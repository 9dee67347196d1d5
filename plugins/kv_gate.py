"""The workflow gate: at most ``scheduler.workflow-gate`` running workflow runs per worker.

A runtime enters before its run submits anything and leaves when the run ends
(``runtime.workflow_gate``); past the limit a run waits in line (``policy.workflow_gate``:
fewest runs inside per tenant first, then arrival order). Every run enters, gated or not,
so a gate the admin sets while the cluster serves counts the runs already inside.

Nothing waits on something dead, and no place is held by something dead: a waiting call
answers within ``wait`` seconds, let in or not, and the runtime asks again; a run inside
renews its place every ``RENEW_S`` while it runs (the runtime does, on a thread of its
own). A waiting run that stops asking for ``STALE_POLLS`` of its waits leaves the line, and
a run inside that misses ``STALE_POLLS`` renewals loses its place (its thread died, or a
leave was lost); a client that leaves (closed, or its process died) takes its runs with it.
The places follow the workers: one joining lets more in at once, one dying lets fewer in
as runs end (no run inside is pushed out). A run the KV budget preempts to break a deadlock
is the one exception: it goes back to the head of its line and the gate backs off
(``policy.workflow_gate.BackOff``), so the runs still inside get the room.

A run is named by its client, namespace and workflow run, so no tenant can leave, renew or
take the place of another's run, and an answer counts only the caller's own runs; the
per-worker limit changes what every tenant waits for, so only the admin sets it
(``kv_gate_configure``). A tenant may have ``MAX_RUNS_PER_TENANT`` runs inside and in line
at once. There is no per-tenant share of the places: a run inside keeps its place while it
renews it, so a tenant that fills every place delays the others until its runs end (the
tenant with the fewest runs inside goes next only as places come free).
"""

from __future__ import annotations

import asyncio
import time

from daskflow_kv import validation
from daskflow_kv.policy.workflow_gate import RENEW_S, BackOff, GateLine, gate_slots, valid_per_worker

from .kv_notes import MAX_TEXT
from .kv_settings import KVSettings
from .tenants import TenantRegistry

RPC_NAMES = ("kv_gate_enter", "kv_gate_leave", "kv_gate_configure")
MAX_WAIT_S = 30.0  # longest a call waits before answering "not yet"
STALE_POLLS = 3  # missed asks (waiting) or renewals (inside) after which a run is dropped
MAX_RUNS_PER_TENANT = 4096  # runs one tenant may have inside and in line at once (the scheduler's memory)


class WorkflowGate:
    __slots__ = ("_scheduler", "_settings", "_tenants", "_line", "_woken", "_ask_by", "_renew_by", "_backoff")

    def __init__(self, scheduler, settings: KVSettings, tenants: TenantRegistry):
        self._scheduler = scheduler  # how many workers there are
        self._settings = settings  # workflow_gate: running runs per worker (None: no limit)
        self._tenants = tenants  # who is calling
        self._line = GateLine()
        self._woken: dict[tuple, asyncio.Event] = {}  # waiting run -> set when it is let in
        self._ask_by: dict[tuple, float] = {}  # waiting run -> (monotonic) by when it must ask again
        self._renew_by: dict[tuple, float] = {}  # run inside -> (monotonic) by when it must renew
        self._backoff = BackOff()  # fewer places after KV deadlocks

    def waiting_runs(self) -> int:
        """Runs waiting in line now (every tenant's: a count, for the operator's gauges)."""
        return self._line.waiting

    def handlers(self) -> dict:
        return {name: getattr(self, "handle_" + name.removeprefix("kv_gate_")) for name in RPC_NAMES}

    def slots(self) -> int | None:
        return self._backoff.limit(gate_slots(self._settings.workflow_gate, len(self._scheduler.workers)))

    def send_back(self, namespace: str | None, flow: str) -> bool:
        """The KV budget preempted run ``flow`` of ``namespace`` to break a deadlock: it waits at
        the head of its line (it asks again as it retries), and the gate lets in no more runs
        than are still inside until a calm spell has passed. -> whether it was inside."""
        now = time.monotonic()
        sent = False
        for run in [r for r in self._renew_by if r[1] == namespace and r[2] == flow]:
            if self._line.push_back(run):
                del self._renew_by[run]
                self._ask_by[run] = now + STALE_POLLS * MAX_WAIT_S
                sent = True
        if sent:
            self._backoff.cut(self._line.running, now)
            self.admit()  # none left inside: the run goes in again at once (one run alone always may)
        return sent

    def _run(self, session: str | None, flow) -> tuple:
        s = self._tenants.session(session)
        if not isinstance(flow, str) or not 0 < len(flow) <= MAX_TEXT:
            raise ValueError(f"flow must be a non-empty string of at most {MAX_TEXT} characters")
        return (s.client, s.namespace, flow)

    async def handle_enter(self, session: str, flow: str, wait: float = 5.0, renew: bool = False) -> dict:
        """Put the caller's run ``flow`` in line (once) and wait up to ``wait`` s to be let in;
        for a run already inside, renew its place (``renew``: only that - a run that lost its
        place is not put in line again). -> whether it is inside."""
        run = self._run(session, flow)
        wait = validation.number("wait (seconds)", wait, minimum=0, maximum=MAX_WAIT_S)
        now = time.monotonic()
        if self._line.is_inside(run):
            self._renew_by[run] = now + STALE_POLLS * RENEW_S
            return {"admitted": True}
        if renew:
            return {"admitted": False}
        if run not in self._ask_by:
            if self._line.held(run[1]) >= MAX_RUNS_PER_TENANT:
                raise ValueError(f"namespace {run[1]!r} has {MAX_RUNS_PER_TENANT} workflow runs in the gate "
                                 "already; end some first")
            self._line.arrive(run, run[1])
        # the later of the deadlines of concurrent asks: a quick ask must not drop a long one
        self._ask_by[run] = max(self._ask_by.get(run, 0.0), now + STALE_POLLS * max(wait, 1.0))
        self.admit()
        if not self._line.is_inside(run) and wait > 0:
            woken = self._woken.setdefault(run, asyncio.Event())
            try:
                await asyncio.wait_for(woken.wait(), wait)
            except asyncio.TimeoutError:
                pass
        return {"admitted": self._line.is_inside(run)}

    def handle_leave(self, session: str, flow: str) -> bool:
        """The caller's run ``flow`` ended, or gave up waiting: its place goes to the next in line.
        -> whether it was inside."""
        was_inside = self._forget(self._run(session, flow))
        if was_inside:
            self._backoff.grow(time.monotonic())
        self.admit()
        return was_inside

    async def handle_configure(self, session: str, per_worker=None, confirm: str | None = None) -> dict:
        """Admin: the limit, running workflow runs per worker (None: none); applies at once.
        ``confirm``: a challenge sent back on the admin's own stream (``tenants.admin``)."""
        await self._tenants.admin(session, confirm, "the workflow gate (how long every tenant's workflows wait)")
        self._settings.workflow_gate = valid_per_worker(per_worker)
        self.admit()
        return self.view()

    def _forget(self, run: tuple) -> bool:
        self._woken.pop(run, None)
        self._ask_by.pop(run, None)
        self._renew_by.pop(run, None)
        return self._line.leave(run)

    def admit(self) -> None:
        """Let in whom the line says while there are places (after any change: a run arrived or
        left, a worker came or went, the admin changed the limit), and wake them."""
        now = time.monotonic()
        for run in self._line.admit(self.slots()):
            self._ask_by.pop(run, None)
            self._renew_by[run] = now + STALE_POLLS * RENEW_S
            woken = self._woken.pop(run, None)
            if woken is not None:
                woken.set()

    def drop_stale(self) -> None:
        """Runs that stopped asking (waiting) or renewing (inside) leave; their places go on.
        From the plugin's periodic check, so a call's cost does not grow with the line."""
        now = time.monotonic()
        stale = [r for r, by in self._ask_by.items() if by < now] + [r for r, by in self._renew_by.items() if by < now]
        for run in stale:
            self._forget(run)
        if stale:
            self.admit()

    def remove_client(self, client: str) -> None:
        """A client left: its runs, inside or waiting, leave with it."""
        for run in [r for r in (*self._renew_by, *self._ask_by) if r[0] == client]:
            self._forget(run)
        self.admit()

    def view(self) -> dict:
        """The limit, the places and how many runs are inside and waiting: the operator's figures
        (the admin's answer, /metrics); a tenant's own answers never count other tenants' runs."""
        return {"workflow_gate_per_worker": self._settings.workflow_gate, "slots": self.slots(),
                "backed_off_to": self._backoff.cap, "running": self._line.running, "waiting": self._line.waiting}
