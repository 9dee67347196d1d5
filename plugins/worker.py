"""The worker plugins a KV cluster needs, one per concern; the scheduler plugin installs them.

``TorchSerializationPlugin``: every worker registers the zero-copy tensor serializers and
``sizeof`` (``daskflow_kv.transport.serialization``) before any block reaches it.

``KVWorkerPlugin`` tells the scheduler what only workers know about KV blocks:

* which blocks Dask has spilled to disk (the worker's SpillBuffer), so the catalog shows
  their tier and the KV budget counts only blocks in memory;
* what the persistent store did here (writes finished, loads, corrupt objects), so the
  catalog marks persisted blocks and the counters add up.

Reports go every ``daskflow-kv.workers.report-interval``, only when something changed, as
one RPC to the scheduler plugin (``kv_worker_report``): never through Dask's event log,
which any client reads and which would hand out full block keys. When the worker closes,
its pending store writes are drained first (``daskflow-kv.store.flush-timeout``).

This module is imported by the scheduler (to pickle the plugins) and must not import torch:
what needs it is imported in ``setup``, on the worker.
"""

from __future__ import annotations

import asyncio
import logging

from distributed.diagnostics.plugin import WorkerPlugin
from tornado.ioloop import PeriodicCallback

from daskflow_kv import config
from daskflow_kv.keys import REPORT_RPC, is_block
from daskflow_kv import dask_internals as di

logger = logging.getLogger("daskflow_kv.worker")


class TorchSerializationPlugin(WorkerPlugin):
    """Makes every worker (present and future) register the tensor serializers."""

    name = "daskflow-kv-torch-serialization"
    idempotent = True  # registering it again (another Client, another workflow) is a no-op

    def setup(self, worker) -> None:
        from daskflow_kv.transport.serialization import register_torch_serialization

        register_torch_serialization()


class KVWorkerPlugin(WorkerPlugin):
    name = "daskflow-kv-worker"
    idempotent = True  # one per worker, whichever runtime registers it

    def setup(self, worker) -> None:
        from daskflow_kv.store import worker_io

        self.worker = worker
        self._io = worker_io  # the store's background writer in this process
        self._sent: list[str] | None = None  # spilled keys as last reported
        self._pc = PeriodicCallback(self.report, config.get_seconds("workers.report-interval") * 1000)
        self._pc.start()

    def spilled(self) -> list[str]:
        return sorted(str(k) for k in di.spilled_keys(self.worker) if is_block(k))

    async def report(self) -> None:
        spilled = self.spilled()
        events = self._io.take_reports()
        if spilled == self._sent and not events:
            return
        try:
            await di.call_scheduler(self.worker, REPORT_RPC, worker=self.worker.address,
                                    spilled=None if spilled == self._sent else spilled, events=events)
            self._sent = spilled
        except Exception as e:  # scheduler gone or closing: the next report says it all again
            logger.debug("daskflow-kv worker report failed: %s", e)

    async def teardown(self, worker) -> None:
        self._pc.stop()
        left = await asyncio.to_thread(self._io.drain, config.get_seconds("store.flush-timeout"))
        if left:
            logger.warning("daskflow-kv: %d KV block writes were still pending when the worker closed", left)
        await self.report()
