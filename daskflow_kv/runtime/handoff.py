"""The worker-to-worker channel of parallel materialize: each layer's K/V, from task to task.

The W cooperating tasks of one parallel prefill (``chunk_task``) run at once, one per
worker. A task sends its chunk's K/V of every layer straight to the workers of the later
chunks - an RPC to their ``kv_handoff`` handler, run on its own worker's event loop while
the task computes on - and takes the earlier chunks' K/V from its worker's ``Mailbox``.
Only in-flight K/V travels here; the blocks a chunk produces are task results Dask owns.

A task never waits blindly: while it lacks a layer it asks the peer's worker how that
chunk is doing (``kv_handoff_status``). A worker that does not answer is gone, and a peer
that finished, gave up or never started within ``start_timeout`` will not send what is
missing: the caller gets ``PeerLost`` and prefills alone (see ``chunk_task``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from .. import dask_internals as di

logger = logging.getLogger("daskflow_kv.handoff")

RUNNING, DONE, ALONE, FAILED, UNKNOWN = "running", "done", "alone", "failed", "unknown"
_REMEMBERED = 4096  # chunk states and closed groups a worker keeps answering about
_ORPHAN_S = 900.0  # K/V parked this long for a task that never came is dropped


class PeerLost(Exception):
    """An earlier chunk's K/V will not arrive: its worker died, or its task gave up."""


@dataclass(frozen=True, slots=True)
class Patience:
    start_timeout: float  # s a peer's task may take to start (it may queue behind another)
    stall_timeout: float  # s a running peer may go without sending the next layer
    probe_interval: float  # s between status checks while waiting
    send_timeout: float = 5.0  # s a hand-off may take; a reader that does not take it copes alone


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
        self.sent: list = []  # concurrent futures of the RPCs in flight
        self.bytes_sent = 0  # K/V bytes handed to later chunks
        self.transit: list[float] = []  # s each received layer spent between its sender and here
        self._began = time.monotonic()

    def _call(self, address: str, op: str, **kwargs):
        # bounded: Dask retries a refused connection for its whole connect timeout (30 s)
        coro = asyncio.wait_for(di.call_worker(self.worker, address, op, **kwargs), self.patience.send_timeout)
        return asyncio.run_coroutine_threadsafe(coro, di.worker_loop(self.worker))

    def send(self, layer: int, k, v) -> None:
        """This chunk's layer to every later chunk's worker; returns at once."""
        later = self.peers[self.index + 1:]
        if not later:
            return
        k, v = k.contiguous(), v.contiguous()  # attention may hand over views; they are not changed after
        for address in dict.fromkeys(later):
            self.sent.append(self._call(address, "kv_handoff", group=self.group, chunk=self.index, layer=layer,
                                        k=to_serialize(k), v=to_serialize(v), sent=time.time()))
        self.bytes_sent += len(later) * (k.nbytes + v.nbytes)

    def recv(self, layer: int) -> list:
        return [self._take(layer, j) for j in range(self.index)]

    def _take(self, layer: int, j: int):
        p = self.patience
        quiet_since = time.monotonic()
        while True:
            part = MAILBOX.take(self.group, layer, j, p.probe_interval)
            if part is not None:
                self.transit.append(part[2])  # wall clocks of two workers: a diagnostic, not a timer
                return part[:2]
            state = self._peer_state(j)
            waited = time.monotonic() - quiet_since
            if state in (DONE, ALONE, FAILED):
                raise PeerLost(f"chunk {j} on {self.peers[j]} is {state} but layer {layer} never came")
            if state == UNKNOWN and time.monotonic() - self._began > p.start_timeout:
                raise PeerLost(f"chunk {j} did not start on {self.peers[j]} within {p.start_timeout:.0f}s")
            if state == RUNNING and waited > p.stall_timeout:
                raise PeerLost(f"chunk {j} on {self.peers[j]} sent no layer {layer} for {waited:.0f}s")

    def _peer_state(self, j: int) -> str:
        try:
            return self._call(self.peers[j], "kv_handoff_status", group=self.group,
                              chunk=j).result(timeout=self.patience.send_timeout + 1.0)
        except Exception as exc:  # refused, reset, timed out: the worker is gone
            raise PeerLost(f"chunk {j}'s worker {self.peers[j]} does not answer ({type(exc).__name__})") from None

    def flush(self) -> int:
        """Wait for the sends to be delivered; -> how many failed (their readers cope alone)."""
        failed = 0
        for fut in self.sent:
            try:
                fut.result(timeout=self.patience.send_timeout + 1.0)
            except Exception as exc:  # noqa: BLE001 -- a dead reader: it is recomputed without us
                failed += 1
                logger.info("K/V hand-off of %s to a later chunk failed: %s", self.group, exc)
        self.sent.clear()
        return failed
