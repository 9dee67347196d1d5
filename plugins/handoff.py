"""The worker-to-worker channel of parallel materialize: each layer's K/V, from task to task.

The W cooperating tasks of one parallel prefill (``chunk_task``) run at once, one per
worker. A task sends its chunk's K/V of every layer straight to the workers of the later
chunks - an RPC to their ``kv_handoff`` handler, run on its own worker's event loop while
the task computes on - and takes the earlier chunks' K/V from its worker's ``Mailbox``.
Only in-flight K/V travels here; the blocks a chunk produces are task results Dask owns.

A task never waits blindly: while it lacks a layer it asks the peer's worker how that
chunk is doing (``kv_handoff_status``). A worker whose port refuses connections is gone;
a peer that gave up, never started within ``start_timeout``, stalled for ``stall_timeout``
or finished ``send_timeout`` ago will not send what is missing: the caller gets
``PeerLost`` and prefills alone (see ``chunk_task``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from .. import dask_internals as di

logger = logging.getLogger("daskflow_kv.handoff")

RUNNING, DONE, ALONE, FAILED, UNKNOWN = "running", "done", "alone", "failed", "unknown"
SLOW = "slow"  # the peer's worker is up but did not answer in time (seen by the asking side only)
_REMEMBERED = 4096  # chunk states and closed groups a worker keeps answering about
_ORPHAN_S = 900.0  # K/V parked this long for a task that never came is dropped


class PeerLost(Exception):
    """An earlier chunk's K/V will not arrive: its worker died, or its task gave up."""


@dataclass(frozen=True, slots=True)
class Patience:
    start_timeout: float  # s a peer's task may take to start (it may queue behind another)
    stall_timeout: float  # s a running peer may go without sending the next layer
    probe_interval: float  # s between status checks while waiting
    send_timeout: float = 30.0  # s a hand-off may take; a reader that does not get it copes alone


class Mailbox:
    """One per worker process: parked K/V by (group, layer, chunk), and local chunks' states."""

    def __init__(self):
        self._cond = threading.Condition()
        self._parts: dict[tuple[str, int, int], tuple] = {}  # (group, layer, from chunk) -> (k, v)
        self._born: dict[str, float] = {}  # group -> when its first part arrived
        self._states: OrderedDict[tuple[str, int], str] = OrderedDict()  # (group, chunk) -> state
        self._closed: OrderedDict[str, None] = OrderedDict()  # groups whose local task finished

    def put(self, group: str, chunk: int, layer: int, k, v, sent: float = 0.0) -> None:
        now = time.monotonic()
        with self._cond:
            if group in self._closed:
                return  # the reader finished (or gave up) before this arrived
            self._born.setdefault(group, now)
            self._parts[(group, layer, chunk)] = (k, v, time.time() - sent if sent else 0.0)
            for g, t in list(self._born.items()):
                if now - t > _ORPHAN_S:
                    self._drop(g)
            self._cond.notify_all()

    def take(self, group: str, layer: int, chunk: int, timeout: float):
        """(keys, values, seconds in transit), or None after ``timeout`` seconds without it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (group, layer, chunk) not in self._parts:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._parts.pop((group, layer, chunk))

    def begin(self, group: str, chunk: int) -> bool:
        """Mark a chunk running here; False if this worker ran it before (Dask runs it again)."""
        with self._cond:
            if (group, chunk) in self._states:
                return False
            self._remember(group, chunk, RUNNING)
            return True

    def finish(self, group: str, chunk: int, state: str) -> None:
        with self._cond:
            self._remember(group, chunk, state)
            self._closed[group] = None
            while len(self._closed) > _REMEMBERED:
                self._closed.popitem(last=False)
            self._drop(group)

    def state(self, group: str, chunk: int) -> str:
        with self._cond:
            return self._states.get((group, chunk), UNKNOWN)

    def parked(self) -> int:
        with self._cond:
            return len(self._parts)

    def _remember(self, group: str, chunk: int, state: str) -> None:
        self._states[(group, chunk)] = state
        self._states.move_to_end((group, chunk))
        while len(self._states) > _REMEMBERED:
            self._states.popitem(last=False)

    def _drop(self, group: str) -> None:
        self._born.pop(group, None)
        for key in [k for k in self._parts if k[0] == group]:
            del self._parts[key]


MAILBOX = Mailbox()


# -- the worker's handlers (event loop) ----------------------------------------------------------
def handle_handoff(group: str, chunk: int, layer: int, k, v, sent: float = 0.0) -> str:
    MAILBOX.put(group, chunk, layer, k, v, sent)
    return "OK"


def handle_status(group: str, chunk: int) -> str:
    return MAILBOX.state(group, chunk)


HANDLERS = {"kv_handoff": handle_handoff, "kv_handoff_status": handle_status}


class HandoffPlugin(WorkerPlugin):
    """Installs the channel's handlers on every worker (present and future)."""

    name = "daskflow-kv-handoff"
    idempotent = True

    def setup(self, worker) -> None:
        di.add_worker_handlers(worker, HANDLERS)


# -- a task's end of the channel (worker thread) ----------------------------------------------------
class Channel:
    """What one cooperating task uses: ``send`` its layers on, ``recv`` earlier chunks' layers."""

    def __init__(self, worker, group: str, index: int, peers: tuple[str, ...], patience: Patience):
        self.worker = worker
        self.group = group
        self.index = index  # this task's chunk
        self.peers = peers  # the worker address of every chunk
        self.patience = patience
        self.bytes_sent = 0  # K/V bytes handed to later chunks
        self.transit: list[float] = []  # s each received layer spent between its sender and here
        self.failures: list[str] = []  # hand-offs a later chunk did not take (why), for the task's report
        self._began = time.monotonic()

    def _call(self, address: str, op: str, timeout: float, **kwargs):
        # bounded: Dask retries a refused connection for its whole connect timeout (30 s)
        coro = asyncio.wait_for(di.call_worker(self.worker, address, op, **kwargs), timeout)
        return asyncio.run_coroutine_threadsafe(coro, di.worker_loop(self.worker))

    def send(self, layer: int, k, v) -> None:
        """This chunk's layer to every later chunk's worker; returns at once (delivery goes on
        in the worker's event loop; a reader that does not take it copes alone)."""
        later = self.peers[self.index + 1:]
        if not later:
            return
        k, v = k.contiguous(), v.contiguous()  # attention may hand over views; they are not changed after
        for address in dict.fromkeys(later):
            fut = self._call(address, "kv_handoff", self.patience.send_timeout, group=self.group, chunk=self.index,
                             layer=layer, k=to_serialize(k), v=to_serialize(v), sent=time.time())
            fut.add_done_callback(self._delivered)
        self.bytes_sent += len(later) * (k.nbytes + v.nbytes)

    def _delivered(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            exc = fut.exception()
            self.failures.append(f"{type(exc).__name__}: {exc}")
            logger.info("K/V hand-off of %s to a later chunk failed: %s", self.group, exc)

    def recv(self, layer: int) -> list:
        return [self._take(layer, j) for j in range(self.index)]

    def _take(self, layer: int, j: int):
        p = self.patience
        quiet_since, done_since = time.monotonic(), None
        while True:
            part = MAILBOX.take(self.group, layer, j, p.probe_interval)
            if part is not None:
                self.transit.append(part[2])  # wall clocks of two workers: a diagnostic, not a timer
                return part[:2]
            state = self._peer_state(j)
            now = time.monotonic()
            if state == DONE:  # its last layers may still be on their way here
                done_since = done_since or now
                if now - done_since > p.send_timeout:
                    raise PeerLost(f"chunk {j} on {self.peers[j]} is done but layer {layer} never came")
            elif state in (ALONE, FAILED):
                raise PeerLost(f"chunk {j} on {self.peers[j]} is {state}: it sends nothing more")
            elif state == UNKNOWN and now - self._began > p.start_timeout:
                raise PeerLost(f"chunk {j} did not start on {self.peers[j]} within {p.start_timeout:.0f}s")
            elif state in (RUNNING, SLOW) and now - quiet_since > p.stall_timeout:
                raise PeerLost(f"chunk {j} on {self.peers[j]} sent no layer {layer} for {now - quiet_since:.0f}s")

    def _peer_state(self, j: int) -> str:
        """The peer chunk's state as its worker says; SLOW if the worker is up but does not say."""
        address = self.peers[j]
        try:
            return self._call(address, "kv_handoff_status", self.patience.probe_interval * 4 + 1.0, group=self.group,
                              chunk=j).result()
        except Exception as exc:  # noqa: BLE001 -- refused, reset or timed out
            if listening(address) is False:
                raise PeerLost(f"chunk {j}'s worker {address} is gone ({type(exc).__name__})") from None
            return SLOW  # a busy event loop (a model loading, a loaded machine): count it as a stall


def listening(address: str) -> bool | None:
    """Whether anything accepts TCP connections at a tcp:// or tls:// worker address (None: other
    protocols). The kernel accepts for a live process however busy; a dead one's port refuses."""
    scheme, _, rest = address.partition("://")
    if scheme not in ("tcp", "tls"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
        return True
    except (OSError, ValueError):
        return False
