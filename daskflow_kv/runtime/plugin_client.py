"""The KV scheduler plugin's RPCs, typed: one method per call, on behalf of one session.

Every call carries this client's session token (``session.login``; the plugin scopes what
it answers to the session's tenant, see ``plugins/kv_client_api.py``); what a call acquires
is acquired for the client the session was bound to, this one. The answers the
planner reads are converted here, once, into ``policy.cluster_view``'s frozen types: a
lookup answers a ``PrefixMatch``, a snapshot a ``ClusterView``. No other module calls
``client.scheduler.kv_*`` (the login itself is ``session.login``'s).
"""

from __future__ import annotations

import copy
from concurrent.futures import CancelledError
from collections.abc import Iterable, Sequence
import threading
from dataclasses import dataclass, field

from distributed import Client, wait
from distributed.client import FutureCancelledError
from distributed.comm.core import CommClosedError

from ..errors import ClientClosed, SchedulerLost
from ..plugins.kv_notes import MAX_LIST

from ..policy.cluster_view import ClusterView, PrefixMatch
from ..policy.cost_model import PrefillProfile
from .session import KVSession, confirmation, login
from .workflow_run import current_run


LOST_REASON = "scheduler-connection-lost"  # Dask's reason on the futures it cancels when the scheduler is lost


def scheduler_lost(client: Client, cause: str) -> SchedulerLost:
    address = getattr(client.scheduler, "address", None) or "?"
    return SchedulerLost(f"the scheduler at {address} is gone ({cause}); start a new cluster "
                         "(KV in a persistent store is read back, not prefilled)")


def gather(client: Client, futures: list):
    """``client.gather``, raising a copy of a task's error, not the object Dask keeps, and
    with futures Dask cancelled because it lost the scheduler as ``SchedulerLost`` naming it
    (Dask's own error names neither the scheduler nor the cause)."""
    try:
        return client.gather(futures)
    except BaseException as e:
        err = _detached(e, futures)
        try:
            if not (isinstance(e, FutureCancelledError) and e.reason == LOST_REASON):
                raise err from None
            raise scheduler_lost(client, "the client lost its connection; Dask cancelled the work in flight") from err
        finally:
            err = None  # this frame joins err's traceback: err held here would be a cycle


def gather_each(client: Client, futures: list):
    """``gather`` of each of ``futures`` as it finishes, first done first: yields (index,
    result). A caller that acts on each result at once (publishes what it made) does not hold
    the finished ones' outputs while it waits for the slowest."""
    pending = dict(enumerate(futures))
    while pending:
        try:
            done, _ = wait(list(pending.values()), return_when="FIRST_COMPLETED")
        except CancelledError:  # Dask cancelled some (it lost the scheduler): their gather says why, by name
            done = {f for f in pending.values() if f.cancelled()}
        for i in [i for i, f in pending.items() if f in done]:
            yield i, gather(client, [pending.pop(i)])[0]


def _detached(e: BaseException, futures: list) -> BaseException:
    """A copy of ``e`` with its task's traceback, ``e`` left holding no frame of ours.

    Dask keeps a task's error in the future's state, held by the client for as long as a
    future of that key lives, and re-raises that very object: each frame it passes on its
    way up joins its traceback, and each frame's futures then keep the error's state
    alive - a cycle rooted in the client, so not even a full garbage collection frees it.
    A preempted workflow's lookups and inputs stayed wanted for good: in the 256 KiB chaos
    runs the last workflow waited for room that dead frames of two clients pinned
    (docs/reliability.md). The copy carries the frames instead, and goes with them."""
    remote = _task_traceback(e, futures)
    e.__traceback__ = e.__context__ = None
    try:
        err = copy.copy(e)  # the same type, arguments and attributes
    except Exception:  # noqa: BLE001 -- an error whose constructor takes other arguments: raise it as it is
        return e
    return err.with_traceback(remote)


def _task_traceback(e: BaseException, futures: list):
    """The failed task's own frames, as Dask rebuilt them from the worker (they hold nothing
    of ours), or None when ``e`` is no task's error."""
    try:
        return next((f.traceback() for f in futures if getattr(f, "status", None) == "error" and f.exception() is e),
                    None)
    except Exception:  # noqa: BLE001 -- a client closing meanwhile: the copy goes without them
        return None


def _run_kw() -> dict:
    """The workflow run a lookup serves: the plugin notes who holds what it hands out."""
    run = current_run()
    return {} if run is None else {"flow": run}


@dataclass(slots=True, eq=False)
class PluginClient:
    client: Client  # the Dask client whose scheduler runs the KV plugin
    session: KVSession  # this runtime's login; its token goes on every call
    # States whose registration rides on this session's next call (``register_states(later=True)``:
    # forks, whose blocks the scheduler knows already); any thread's next call carries them.
    pending: list[dict] = field(default_factory=list)
    pending_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def login(cls, client: Client, namespace: str | None = None, secret: str | None = None) -> PluginClient:
        return cls(client, login(client, namespace, secret))

    def call(self, name: str, **kwargs):
        """One ``kv_*`` RPC for this session; every method below goes through here. A scheduler
        that is gone is ``SchedulerLost``, naming it, not a bare comm error: at once when the
        client already lost its connection (Dask cancelled every future then, so this runtime's
        states are gone with it), else once Dask gives up connecting."""
        if self.client.status == "connecting":
            raise scheduler_lost(self.client, "the client lost its connection and is reconnecting")
        if self.client.scheduler is None or self.client.status == "closed":
            # A thread still working after its runtime's client was closed (Dask unset the comm).
            raise ClientClosed(f"cannot call {name}: this runtime's Dask client is {self.client.status}")
        with self.pending_lock:
            pending, self.pending = self.pending, []
        if pending:  # registered before anything this call does, in the same message where it can
            if name == "kv_release_states":
                kwargs["metas"] = pending
            elif name == "kv_register_states" and len(pending) + len(kwargs["metas"]) <= MAX_LIST:
                kwargs["metas"] = pending + list(kwargs["metas"])
            else:
                self._send("kv_register_states", {"metas": pending})
                pending = []
        try:
            return self._send(name, kwargs)
        except (PermissionError, ValueError):
            # The plugin refused the call before registering anything (a release of a state not
            # the caller's, say): the forks it carried are registered on their own all the same.
            if pending:
                try:
                    self._send("kv_register_states", {"metas": pending})
                except (PermissionError, ValueError):
                    pass  # they were the refused part: the call's own error says why
            raise

    def _send(self, name: str, kwargs: dict):
        try:
            return self.client.sync(getattr(self.client.scheduler, name), session=self.session.token, **kwargs)
        except (CommClosedError, OSError) as e:
            if isinstance(e, PermissionError):  # the plugin refused (AccessDenied): an answer, not a loss
                raise
            raise scheduler_lost(self.client, f"{type(e).__name__}: {e}") from e

    # -- blocks --------------------------------------------------------------------------------
    def lookup(self, root: str, keys: Sequence[str], tokens: Sequence[int], block_size: int,
               view: bool | str = False) -> tuple[PrefixMatch, dict | None]:
        """The longest cached prefix of ``tokens`` (asked by its own chain ``keys``); the plugin
        acquires its blocks for this client before it answers. ``view``: the planner's snapshot
        comes in the same answer (``kv_snapshot``'s, raw: ``Planner.view`` reads it), else None;
        ``"uncovered"``: only when the blocks leave tokens to prefill."""
        ans = self.call("kv_lookup", root=root, keys=list(keys), tokens=list(tokens), block_size=block_size,
                        **_run_kw(), **({"view": view} if view else {}))
        return PrefixMatch.from_answer(ans), ans.get("snapshot")

    def acquire(self, keys: Iterable[str]) -> dict[str, str]:
        """Content addresses the scheduler knows in this namespace -> the Dask key now acquired
        for this client, or "" for one it keeps only released (make it under a fresh key)."""
        keys = list(keys)
        return dict(self.call("kv_acquire", keys=keys, **_run_kw())) if keys else {}

    def register_states(self, metas: list[dict], later: bool = False) -> None:
        """Catalog new states (the plugin answers once it knows all their blocks). ``later``:
        states that add no block (forks): registered with this session's next call, before
        whatever that call does - a fork and its parent's release are one round trip, and no
        call sees the catalog without them. (A refusal of theirs is that next call's error.)"""
        if not later:
            self.call("kv_register_states", metas=metas)
            return
        with self.pending_lock:
            self.pending.extend(metas)
            full = len(self.pending) >= MAX_LIST
        if full:  # bounded: one message carries at most MAX_LIST states
            self.call("kv_register_states", metas=[])

    def release_states(self, state_ids: Sequence[str], reuse_expected: bool = False) -> None:
        self.call("kv_release_states", state_ids=list(state_ids), reuse_expected=reuse_expected)

    def admin_call(self, name: str, **kwargs):
        """An admin's call: confirmed by a challenge sent back on this client's own stream first."""
        try:
            confirm = confirmation(self.client)
        except Exception:  # noqa: BLE001 -- a closed client, a lost scheduler: the call says which, as any other
            confirm = None
        return self.call(name, confirm=confirm, **kwargs)

    def drop(self) -> int:
        """Admin: the cache lets go of every block and this client of every key (before a cluster closes)."""
        return self.admin_call("kv_drop")

    # -- what the planner sees ---------------------------------------------------------------------
    def snapshot(self, bandwidth_override: float | None = None, prefill_override: PrefillProfile | None = None,
                 answer: dict | None = None) -> ClusterView:
        """The planner's view: ``answer`` (a snapshot that came with a lookup), else a ``kv_snapshot`` call."""
        return ClusterView.from_snapshot(self.call("kv_snapshot") if answer is None else answer, bandwidth_override,
                                         prefill_override)

    def prefill_profiles(self) -> dict[str, dict]:
        """The fitted prefill profile of every worker that reported a prefill, as the plugin sends them."""
        return self.call("kv_snapshot")["prefill_profiles"]

    def record_bandwidth(self, src: str, dst: str, bandwidth: float, latency: float | None = None) -> None:
        """A calibration probe's figures for src -> dst (this namespace's plans use them)."""
        self.call("kv_record_bandwidth", src=src, dst=dst, bandwidth=bandwidth, latency=latency)

    def configure(self, kv_budget_bytes: int | None = None, memory_weight: float | None = None,
                  unset_budget: bool = False) -> None:
        self.admin_call("kv_configure", kv_budget_bytes=kv_budget_bytes, memory_weight=memory_weight,
                  unset_budget=unset_budget)

    def workflow_done(self, agents: int, ttft_s: Sequence[float]) -> None:
        """A finished workflow, for the KV page's live plots (this namespace's)."""
        self.call("kv_workflow_done", agents=agents, ttft_s=list(ttft_s))

    def run_done(self, flow: str) -> None:
        """A workflow run of this session ended: it holds nothing any more (see ``kv_budget``)."""
        self.call("kv_run_done", flow=flow)

    # -- the workflow gate (plugins/kv_gate.py) ------------------------------------------------------
    def gate_enter(self, flow: str, wait: float, renew: bool = False) -> dict:
        """Run ``flow`` of this session waits in the gate's line, at most ``wait`` s per call
        (``renew``: it is inside; only renew its place)."""
        return self.call("kv_gate_enter", flow=flow, wait=wait, renew=renew)

    def gate_leave(self, flow: str) -> bool:
        return self.call("kv_gate_leave", flow=flow)

    def gate_configure(self, per_worker: float | None) -> dict:
        """Admin: running workflow runs per worker at most (None: no limit)."""
        return self.admin_call("kv_gate_configure", per_worker=per_worker)

    # -- introspection -------------------------------------------------------------------------------
    def counters(self) -> dict:
        return self.call("kv_counters")

    def catalog(self) -> list[dict]:
        """Catalog rows, one per (state, block), of this session's namespace (admin: all)."""
        return self.call("kv_catalog")
