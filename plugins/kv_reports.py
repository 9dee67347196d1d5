"""What workers tell the plugin, accepted only from the worker it is about.

A worker's report (its spilled blocks, its store I/O; see ``kv_tiers``) changes what the
budget counts, so a forged one could zero a worker's KV bytes. Dask cannot say who sent a
message: a stream handler's ``worker=`` is whatever the message says, and any client can
call any RPC. So each worker gets a report token only it can know: the scheduler sends it
to the worker's own address (``REPORT_TOKEN_RPC``, a worker handler ``plugins.worker``
installs), the worker puts it on every report it sends over its own batched stream
(``REPORT_OP``), and a report whose token is not that worker's is dropped - and the token
sent again, in case another caller overwrote it there (rate-limited). A worker asks for
its token when its plugin starts (``REPORT_HELLO_RPC``); asking for another worker's only
sends that worker its token again.

A report that passes also names its stream: the prefill timings workers log to Dask's
event log (``PREFILL_TOPIC``, which any client may also log to) count only when they come
on a stream a token-checked report came on (``is_worker_stream``).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Callable

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import REPORT_TOKEN_RPC

logger = logging.getLogger("daskflow_kv.scheduler")

RESEND_INTERVAL = 1.0  # s between two sends of one worker's token after bad reports


class WorkerReports:
    __slots__ = ("_scheduler", "_accept", "_tokens", "_streams", "_sent")

    def __init__(self, scheduler, accept: Callable[..., None]):
        self._scheduler = scheduler  # live workers, and the connections to send tokens over
        self._accept = accept  # (worker, spilled, events, engine, can_spill) of a report that passed
        self._tokens: dict[str, str] = {}  # worker address -> the token its reports carry
        self._streams: dict[str, object] = {}  # worker address -> its stream (from a report that passed)
        self._sent: dict[str, float] = {}  # worker address -> when its token was last sent

    async def hello(self, worker: str | None = None) -> None:
        """``REPORT_HELLO_RPC``: send ``worker`` its token (at its own address, never in the answer)."""
        if isinstance(worker, str) and worker in self._scheduler.workers:
            await self._send(worker)

    async def _send(self, worker: str) -> None:
        token = self._tokens.setdefault(worker, secrets.token_hex(16))
        self._sent[worker] = time.monotonic()
        try:
            await di.call_worker_from_scheduler(self._scheduler, worker, REPORT_TOKEN_RPC, token=token)
        except Exception as e:  # noqa: BLE001 -- gone or closing: it asks again when it starts
            logger.debug("daskflow-kv: report token to %s not delivered: %s", worker, e)

    def report(self, worker=None, token=None, spilled=None, events=(), engine=None, can_spill=None, **ignored) -> None:
        """``REPORT_OP`` on a worker's stream. Never raises (that would end the sender's stream)."""
        try:
            expected = self._tokens.get(worker) if isinstance(worker, str) else None
            if expected is None or not isinstance(token, str) or not hmac.compare_digest(expected, token):
                self._resend(worker)
                return
            self._streams[worker] = di.current_connection()
            spilled = [str(k) for k in spilled] if isinstance(spilled, (list, tuple)) else None
            events = [e for e in events if isinstance(e, dict)] if isinstance(events, (list, tuple)) else []
            self._accept(worker, spilled, events, engine, can_spill if isinstance(can_spill, bool) else None)
        except Exception:  # noqa: BLE001
            logger.exception("daskflow-kv: worker report failed")

    def _resend(self, worker) -> None:
        if (isinstance(worker, str) and worker in self._scheduler.workers
                and time.monotonic() - self._sent.get(worker, 0.0) > RESEND_INTERVAL):
            self._scheduler.loop.add_callback(self._send, worker)

    def is_worker_stream(self, worker) -> bool:
        """The message being handled came on ``worker``'s own stream (one of its reports passed there)."""
        stream = self._streams.get(worker)
        return stream is not None and stream is di.current_connection() and di.connection_open(stream)

    def forget_worker(self, worker: str) -> None:
        self._tokens.pop(worker, None)
        self._streams.pop(worker, None)
        self._sent.pop(worker, None)
