"""Worker side of the persistent tier: write-behind of new blocks, loads, the probe.

Writes never hold up a task. ``persist`` (called by the task that publishes a block under
its key) only hands the tensor to one background thread per worker process and returns;
the thread encodes, checksums and atomically writes it while the worker goes on with the
next prefill. Blocks are never modified once published, so the thread may read the tensor
while tasks read it too, and the reference it holds keeps the block's bytes alive even if
the budget evicts (or Dask spills) the block meanwhile: eviction never loses a pending write.

Loads are ordinary tasks (``load_blocks``) on the worker that needs the blocks; the client
publishes each loaded block under its key with ``tasks.take_block``, as for a prefill.

Every entry point takes the tenant it acts for (``tenant.StoreTenant``: its directory and
the key that seals its objects), inside the ``WriteRequest`` or as an argument. Left out,
it is the open tenant (no secret: one trust domain, unsealed objects in ``v2/open``).

What happened (writes, loads, corrupt objects) is queued here and sent to the scheduler
plugin by ``plugins.worker.KVWorkerPlugin``; a direct call outside a worker just queues it.
Runs inside Dask workers (it asks ``distributed`` for its worker's address).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch
from dask.sizeof import sizeof

from .. import config
from .kv_store import open_store
from .tenant import OPEN_TENANT, StoreTenant
from ..transport.serialization import sizeof_torch_tensor

logger = logging.getLogger("daskflow_kv.store")
_REPORTS: deque[dict] = deque(maxlen=100_000)  # events for the scheduler, oldest first


@dataclass(frozen=True, slots=True)
class WriteRequest:
    """Which block a published tensor is, and where it goes: no token ids (see store.manifest)."""

    url: str  # the store
    key: str  # the block's content address
    start: int  # token span, for the manifest
    end: int
    fingerprint: str  # Fingerprint.digest of the model that made it (sealed in the manifest)
    tenant: StoreTenant = OPEN_TENANT  # whose: the directory it goes to, the key that seals it


@dataclass(slots=True)
class LoadOutput:
    """Blocks read from the store: the leading run of the keys asked for that verified."""

    blocks: list[torch.Tensor]  # in chain order (``tasks.take_block`` cuts them into keys)
    nbytes: int  # tensor bytes read
    seconds: float  # wall time of the reads (read + verify + decode)
    stopped: str  # why it stopped early: "" (all loaded), "miss" or "corrupt"
    worker: str


@sizeof.register(LoadOutput)
def _sizeof_load_output(out: LoadOutput) -> int:
    return sum(sizeof_torch_tensor(b) for b in out.blocks) + 128


def report(event: dict) -> None:
    _REPORTS.append(event)


def take_reports() -> list[dict]:
    out = []
    while _REPORTS:
        try:
            out.append(_REPORTS.popleft())
        except IndexError:
            break
    return out


class StoreWriter:
    """One background thread writing blocks; a key already queued is not queued twice."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="daskflow-kv-store-writer")
        self._pending: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def submit(self, req: WriteRequest, tensor: torch.Tensor) -> None:
        slot = (req.url, req.tenant.prefix, req.key)
        with self._lock:
            if slot not in self._pending:
                self._pending[slot] = self._pool.submit(self._write, req, tensor, slot)

    def _write(self, req: WriteRequest, tensor: torch.Tensor, slot) -> None:
        t0 = time.perf_counter()
        try:
            m = open_store(req.url, req.tenant).put(tensor, req.key, req.start, req.end, req.fingerprint)
            report({"op": "write", "key": req.key, "nbytes": 0 if m is None else m.nbytes,
                    "seconds": time.perf_counter() - t0, "written": m is not None})
        except Exception as e:  # a full disk or a lost bucket must not take the worker down
            logger.warning("daskflow-kv: writing block %s to %s failed: %s", req.key[:16], req.url, e)
            report({"op": "write-failed", "key": req.key, "error": f"{type(e).__name__}: {e}"})
        finally:
            with self._lock:
                self._pending.pop(slot, None)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def drain(self, timeout: float | None = None) -> int:
        """Wait for the queued writes; how many are still pending after ``timeout``."""
        with self._lock:
            futures = list(self._pending.values())
        wait_futures(futures, timeout=timeout)
        return self.pending()


_WRITER: StoreWriter | None = None
_WRITER_LOCK = threading.Lock()


def writer() -> StoreWriter:
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None:
            _WRITER = StoreWriter()
        return _WRITER


def persist(tensor: torch.Tensor, req: WriteRequest | None) -> torch.Tensor:
    """Queue ``tensor`` for writing (when ``req`` says where) and return it at once."""
    if req is not None:
        writer().submit(req, tensor)
    return tensor


def persist_blocks(reqs: list[WriteRequest], *blocks: torch.Tensor) -> int:
    """A task that queues blocks already in memory here (a reused prefix not yet stored)."""
    for req, block in zip(reqs, blocks):
        persist(block, req)
    return len(reqs)


def pending_writes() -> int:
    """This process's queued and running store writes."""
    return _WRITER.pending() if _WRITER is not None else 0


def drain(timeout: float | None = None) -> int:
    """Wait for this process's pending writes (``client.run(drain)``); how many are left."""
    return writer().drain(timeout) if _WRITER is not None else 0


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:
        return "local"


def load_blocks(url: str, keys: list[str], tenant: StoreTenant | None = None) -> LoadOutput:
    """Read ``keys`` (a chain, in order) from ``tenant``'s part of the store and keep the
    leading run of good ones: blocks after a miss or a corrupt object are useless, their K/V
    attend to the missing one. An object that fails authentication is corrupt: never loaded.

    Objects are read concurrently (``daskflow-kv.store.read-threads``): an object store
    answers each GET after a round trip, and reads, CRC and decoding release the GIL.
    """
    store = open_store(url, tenant)
    threads = max(1, min(int(config.get("store.read-threads")), len(keys)))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="daskflow-kv-store-reader") as pool:
        results = list(pool.map(store.read, keys))
    seconds = time.perf_counter() - t0  # wall time: what the load costs the request
    blocks, nbytes, stopped = [], 0, ""
    for r in results:
        if r.status != "hit":
            stopped = r.status
            break
        blocks.append(r.tensor)
        nbytes += r.manifest.nbytes
    worker = _worker_address()
    report({"op": "load", "blocks": len(blocks), "nbytes": nbytes, "seconds": seconds,
            "corrupt": int(stopped == "corrupt"), "worker": worker})
    return LoadOutput(blocks, nbytes, seconds, stopped, worker)


def load_summary(out: LoadOutput) -> dict:
    """The small part of a load, for the client: how many blocks, bytes, seconds."""
    return {"blocks": len(out.blocks), "nbytes": out.nbytes, "seconds": out.seconds, "stopped": out.stopped,
            "worker": out.worker}


def probe(url: str, nbytes: int, tenant: StoreTenant | None = None) -> list[tuple[int, float]]:
    """(bytes, read seconds) for one object of nbytes/8 and one of nbytes: the store's
    latency and bandwidth as a worker sees them, through ``tenant``'s real read path
    (sealed objects are opened, as loads open them)."""
    store = open_store(url, tenant)
    return [(n, store.probe(n)[1]) for n in (max(4, nbytes // 8), max(4, nbytes))]
