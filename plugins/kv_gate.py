"""The workflow gate: at most ``scheduler.workflow-gate`` running workflow runs per worker.

A runtime enters before its run submits anything and leaves when the run ends
(``runtime.workflow_gate``); past the limit a run waits in line (``policy.workflow_gate``:
fewest runs inside per tenant first, then arrival order). Every run enters, gated or not,
so a gate the admin sets while the cluster serves counts the runs already inside.

Nothing waits on something dead: a waiting call answers within ``wait`` seconds, let in or
not, and the runtime asks again; a run that stopped asking (its thread is gone, its client
alive) leaves the line after ``STALE_POLLS`` missed answers; a client that leaves (closed,
or its process died) takes its runs out of the line and frees their places. The places
follow the workers: one joining lets more in at once, one dying lets fewer in as runs end
(no run inside is pushed out).

A run is named by its client, namespace and workflow run, so no tenant can leave, or take
the place of, another's run; the per-worker limit changes what every tenant waits for, so
only the admin sets it (``kv_gate_configure``). A tenant may have ``MAX_RUNS_PER_TENANT`` runs
inside and in line at once. A run inside keeps its place until it ends or its client leaves:
there is no per-tenant share of the places (the tenant with the fewest inside goes next,
which is fair only as places come free).
"""

from __future__ import annotations

import asyncio
import time

from daskflow_kv.policy.workflow_gate import GateLine, gate_slots, valid_per_worker

from .kv_notes import MAX_TEXT
from .kv_settings import KVSettings
from .tenants import AccessDenied, TenantRegistry

RPC_NAMES = ("kv_gate_enter", "kv_gate_leave", "kv_gate_configure")
MAX_WAIT_S = 30.0  # longest a call waits before answering "not yet"
STALE_POLLS = 3  # a waiting run that has not asked again for this many of its waits leaves the line
MAX_RUNS_PER_TENANT = 4096  # runs one tenant may have inside and in line at once (the scheduler's memory)


class WorkflowGate:
    __slots__ = ("_scheduler", "_settings", "_tenants", "_line", "_woken", "_asked", "_entered")

    def __init__(self, scheduler, settings: KVSettings, tenants: TenantRegistry):
        self._scheduler = scheduler  # how many workers there are
        self._settings = settings  # workflow_gate: running runs per worker (None: no limit)
        self._tenants = tenants  # who is calling
        self._line = GateLine()
        self._woken: dict[tuple, asyncio.Event] = {}  # waiting run -> set when it is let in
        self._asked: dict[tuple, float] = {}  # waiting run -> (monotonic) by when it must ask again
        self._entered: dict[tuple, float] = {}  # run inside -> when it was let in (wall clock)

    def handlers(self) -> dict:
        return {name: getattr(self, "handle_" + name.removeprefix("kv_gate_")) for name in RPC_NAMES}

    def slots(self) -> int | None:
        return gate_slots(self._settings.workflow_gate, len(self._scheduler.workers))

    def _run(self, session: str | None, flow) -> tuple:
        s = self._tenants.session(session)
        if not isinstance(flow, str) or not 0 < len(flow) <= MAX_TEXT:
            raise ValueError(f"flow must be a non-empty string of at most {MAX_TEXT} characters")
        return (s.client, s.namespace, flow)

    async def handle_enter(self, session: str, flow: str, wait: float = 5.0) -> dict:
        """Put the caller's run ``flow`` in line (once) and wait up to ``wait`` s to be let in.
        -> admitted, and while not: runs ahead of it, runs inside, places."""
        run = self._run(session, flow)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_S:
            raise ValueError(f"wait must be between 0 and {MAX_WAIT_S:g} seconds, got {wait!r}")
        if not self._line.is_inside(run):
            if run not in self._asked and self.count(run[1]) >= MAX_RUNS_PER_TENANT:
                raise ValueError(f"namespace {run[1]!r} has {MAX_RUNS_PER_TENANT} workflow runs in the gate "
                                 "already; end some first")
            self._line.arrive(run, run[1])
            self._asked[run] = time.monotonic() + STALE_POLLS * max(wait, 1.0)
            self.admit()
        if not self._line.is_inside(run) and wait > 0:
            woken = self._woken.setdefault(run, asyncio.Event())
            try:
                await asyncio.wait_for(woken.wait(), wait)
            except asyncio.TimeoutError:
                pass
        inside = self._line.is_inside(run)
        return {"admitted": inside, "ahead": self._line.position(run), "running": self._line.running,
                "slots": self.slots()}

    def handle_leave(self, session: str, flow: str) -> bool:
        """The caller's run ``flow`` ended, or gave up waiting: its place goes to the next in line.
        -> whether it was inside."""
        run = self._run(session, flow)
        was_inside = self._forget(run)
        self.admit()
        return was_inside

    def handle_configure(self, session: str, per_worker=None) -> dict:
        """Admin: the limit, running workflow runs per worker (None: none); applies at once."""
        s = self._tenants.session(session)
        if not s.is_admin:
            raise AccessDenied("the workflow gate changes how long every tenant's workflows wait: it needs the "
                               f"admin role (namespace {s.namespace!r} has the user role)")
        self._settings.workflow_gate = valid_per_worker(per_worker)
        self.admit()
        return self.view()

    def _forget(self, run: tuple) -> bool:
        self._woken.pop(run, None)
        self._asked.pop(run, None)
        self._entered.pop(run, None)
        return self._line.leave(run)

    def admit(self) -> None:
        """Let in whom the line says while there are places (after any change: a run arrived or
        left, a worker came or went, the admin changed the limit), and wake them."""
        now = time.monotonic()
        for run in [r for r, by in self._asked.items() if by < now]:  # stopped asking: not waited for
            self._forget(run)
        for run in self._line.admit(self.slots()):
            self._asked.pop(run, None)
            self._entered[run] = time.time()
            woken = self._woken.pop(run, None)
            if woken is not None:
                woken.set()

    def remove_client(self, client: str) -> None:
        """A client left: its runs, inside or waiting, leave with it."""
        for run in [r for r in (*self._entered, *self._asked) if r[0] == client]:
            self._forget(run)
        self.admit()

    def count(self, namespace: str) -> int:
        """Runs of ``namespace`` inside and waiting."""
        return sum(r[1] == namespace for r in self._entered) + sum(r[1] == namespace for r in self._asked)

    def view(self, namespace: str | None = None) -> dict:
        """Runs inside and waiting (of ``namespace``; None: all), and the places, for counters and pages."""
        inside = [r for r in self._entered if namespace is None or r[1] == namespace]
        waiting = [r for r in self._asked if namespace is None or r[1] == namespace]
        return {"workflow_gate_per_worker": self._settings.workflow_gate, "slots": self.slots(),
                "running": len(inside), "waiting": len(waiting)}
