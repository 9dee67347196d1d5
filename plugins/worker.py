"""The worker plugins a KV cluster needs, one per concern; the scheduler plugin installs them.

``TorchSerializationPlugin``: every worker registers the zero-copy tensor serializers and
``sizeof`` (``daskflow_kv.transport.serialization``) before any block reaches it.

``KVWorkerPlugin`` tells the scheduler what only workers know about KV blocks:

* which blocks Dask has spilled to disk (the worker's SpillBuffer), so the catalog shows
  their tier and the KV budget counts only blocks in memory; the budget also spills blocks
  on purpose (``SPILL_OP``: a waiting task's room taken by blocks no running task reads);
* what the persistent store did here (writes finished, loads, corrupt objects), so the
  catalog marks persisted blocks and the counters add up.

Reports go every ``daskflow-kv.workers.report-interval``, only when something changed, on
the worker's own batched stream (``REPORT_OP``), each with the report token the scheduler
sent to this worker's address (``REPORT_TOKEN_RPC``; see ``kv_reports``): a report without
it is dropped, so no other caller can speak for this worker. Never through Dask's event
log, which any client reads and which would hand out full block keys. The plugin also
refuses data put into this worker under a KV key without a task (``Client.scatter``;
``dask_internals.guard_worker_data``). When the worker closes, its pending store writes
are drained first (``daskflow-kv.store.flush-timeout``).

While Dask keeps the worker paused, the plugin returns freed memory to the OS every
``TRIM_EVERY_S`` (``trim_memory``: Python's garbage, then the C allocator's free pages), as
Dask's documentation advises for unmanaged memory by hand: a prefill's activations, freed
but kept by the allocator, would otherwise hold the process over the pause threshold with
nothing left to spill, and a cluster whose workers are all paused runs nothing.

This module is imported by the scheduler (to pickle the plugins) and must not import torch:
what needs it is imported in ``setup``, on the worker.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import sys
import time

from distributed.diagnostics.plugin import WorkerPlugin
from tornado.ioloop import PeriodicCallback

from daskflow_kv import config
from daskflow_kv import dask_internals as di
from daskflow_kv.keys import REPORT_HELLO_RPC, REPORT_OP, REPORT_TOKEN_RPC, SPILL_OP, holds_kv, is_kv, short_key

from .kv_engines import merge
from .tenants import AccessDenied

logger = logging.getLogger("daskflow_kv.worker")
TRIM_EVERY_S = 2.0  # how often a paused worker gives freed memory back


def trim_memory() -> int:
    """Collect Python's garbage, then return the C allocator's free pages to the OS
    (glibc's ``malloc_trim``; elsewhere only the first). -> objects collected."""
    found = gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return found


class TorchSerializationPlugin(WorkerPlugin):
    """Makes every worker (present and future) register the tensor serializers."""

    name = "daskflow-kv-torch-serialization"
    idempotent = True  # registering it again (another Client, another workflow) is a no-op

    def setup(self, worker) -> None:
        from daskflow_kv.transport.serialization import register_torch_serialization

        register_torch_serialization()


def _engine_stats() -> dict | None:
    """This process's continuous-batching loops, merged (None before any KV task ran here).
    Read only if a task already imported the loop: this plugin stays torch-free."""
    step_worker = sys.modules.get("daskflow_kv.runtime.step_worker")
    loops = step_worker.engine_stats() if step_worker is not None else {}
    return merge(loops) if loops else None


def refused_data(keys) -> AccessDenied | None:
    """KV keys enter a worker only as their task's result (see ``kv_ownership``)."""
    ours = [k for k in keys if is_kv(k)]
    return AccessDenied(f"data under daskflow-kv keys ({short_key(ours[0])}) is refused") if ours else None


class KVWorkerPlugin(WorkerPlugin):
    name = "daskflow-kv-worker"
    idempotent = True  # one per worker, whichever runtime registers it

    def setup(self, worker) -> None:
        from daskflow_kv.store import worker_io

        self.worker = worker
        self._io = worker_io  # the store's background writer in this process
        self._sent: list[str] | None = None  # spilled keys as last reported
        self._engine: dict | None = None  # the step loop's counters as last reported
        self._token: str | None = None  # what the scheduler sent this worker; its reports carry it
        self._trimmed = 0.0  # when freed memory was last given back while paused
        di.guard_worker_data(worker, refused_data)
        di.keep_spilled_on_peer_reads(worker, holds_kv)  # the budget's spills stay spilled when a peer fetches them
        di.gather_one_key_per_message(worker)  # a peer sends its spilled blocks one at a time, not a document at once
        di.add_worker_handlers(worker, {REPORT_TOKEN_RPC: self.take_token})
        di.add_worker_stream_handlers(worker, {SPILL_OP: self.spill})
        self._pc = PeriodicCallback(self.report, config.get_seconds("workers.report-interval") * 1000)
        self._pc.start()
        worker.loop.add_callback(self._hello)

    async def _hello(self) -> None:
        try:  # the token comes to this worker's own address (take_token), not in the answer
            await di.call_scheduler(self.worker, REPORT_HELLO_RPC, worker=self.worker.address)
        except Exception as e:  # noqa: BLE001 -- scheduler gone or closing: nothing to report to
            logger.debug("daskflow-kv report token request failed: %s", e)

    def take_token(self, token: str | None = None) -> str:
        """``REPORT_TOKEN_RPC``: the scheduler's token for this worker; the next report says it all."""
        if isinstance(token, str):
            self._token, self._sent = token, None
            self.worker.loop.add_callback(self.report)
        return "OK"

    def spill(self, keys=(), **_) -> None:
        """``SPILL_OP`` (from the scheduler's KV budget, on its own stream to this worker): move
        these blocks to the spill disk now, before the task sent after this message starts,
        and say so at once. Only KV (blocks, a rebuilt prefix's private blocks, outputs); what is
        not here or not KV is ignored."""
        blocks = [k for k in keys if isinstance(k, str) and holds_kv(k)] if isinstance(keys, (list, tuple)) else []
        moved = di.spill_keys(self.worker, blocks)
        if len(moved) < len(blocks):  # the scheduler counted them gone: the report below corrects it
            missing = [k for k in blocks if k not in moved]
            logger.warning("daskflow-kv: %d of %d blocks the budget spilled were not in memory here (%d on disk "
                           "already)", len(missing), len(blocks), sum(k in getattr(self.worker.data, "slow", ())
                                                                      for k in missing))
        self._sent = None  # the whole list next, spilled or not: the scheduler counted on it
        self.worker.loop.add_callback(self.report)

    def spilled(self) -> list[str]:
        return sorted(str(k) for k in di.spilled_keys(self.worker) if holds_kv(k))

    async def report(self) -> None:
        if di.is_paused(self.worker) and time.monotonic() - self._trimmed >= TRIM_EVERY_S:
            self._trimmed = time.monotonic()
            await asyncio.to_thread(trim_memory)
        if self._token is None:
            return
        spilled = self.spilled()
        events = self._io.take_reports()
        engine = _engine_stats()
        if spilled == self._sent and not events and engine == self._engine:
            return
        try:
            di.send_to_scheduler_stream(self.worker, {"op": REPORT_OP, "token": self._token,
                                                      "spilled": None if spilled == self._sent else spilled,
                                                      "events": events, "engine": engine,
                                                      "can_spill": di.can_spill(self.worker)})
            self._sent, self._engine = spilled, engine
        except Exception as e:  # scheduler gone or closing: the next report says it all again
            logger.debug("daskflow-kv worker report failed: %s", e)

    async def teardown(self, worker) -> None:
        self._pc.stop()
        left = await asyncio.to_thread(self._io.drain, config.get_seconds("store.flush-timeout"))
        if left:
            logger.warning("daskflow-kv: %d KV block writes were still pending when the worker closed", left)
        await self.report()
