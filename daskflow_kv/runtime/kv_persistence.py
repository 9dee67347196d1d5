"""The runtime's persistent tier: what to write through, and what loads have measured.

Writes (``daskflow-kv.store.write``): ``materialize-only`` (default) writes the blocks of
states made by materialize / extend / merge - the shared contexts other agents, workflows
and later clusters read - including reused blocks not stored yet, so a stored context has
no gaps; ``all`` also writes every resumed branch's own blocks; ``off`` writes nothing (the
store is still read). A block is written by the worker that holds it, in the background
(``store_io``): no prefill waits for storage.

Reads are the materialize step's (``store_reader``): it asks this tier which blocks the
store holds, prices a load with ``profile()`` and reports what it measured and decided
here, where ``KVRuntime.store_profile`` / ``explain_store`` read them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from distributed import Client, fire_and_forget

from .. import config, validation
from ..dask_internals import worker_addresses
from ..keys import PERSIST, content_key, task_key
from ..policy.store_read import StoreDecision, StoreProfile, StoreSample, explain_store, fit_store_profile
from ..store import worker_io as store_io
from ..store.kv_store import open_store
from ..store.tenant import StoreTenant
from .plugin_client import gather
from .prefix_cache import HeldPrefix

WRITE_OPS = ("materialize", "extend", "merge")  # states whose blocks "materialize-only" writes


def store_settings(kv_store: str | None, kv_store_write: str | None, tenant: StoreTenant
                   ) -> tuple[object | None, str]:
    """(the store opened as ``tenant`` or None, the write mode), checked before any cluster work.

    ``tenant``: the namespace's credentials (``StoreTenant.derive``): its objects live under
    its own directory, sealed with its own key, so no other tenant lists, reads or forges them."""
    url = validation.setting("store.url", kv_store, "kv_store", validation.optional, validation.store_url)
    write = validation.setting("store.write", kv_store_write, "kv_store_write", validation.choice,
                               validation.STORE_WRITES)
    return (open_store(url, tenant) if url else None), write


@dataclass(slots=True, eq=False)
class PersistentTier:
    client: Client  # runs the writes and probes on workers
    store: object | None  # the opened KV store (store.kv_store), None without one
    store_write: str  # all | materialize-only | off
    fingerprint_digest: str  # the model's fingerprint, stamped on every stored block
    namespace: str  # whose tasks it submits (their keys carry its tag)
    samples: deque[StoreSample] = field(default_factory=lambda: deque(maxlen=64))  # load timings, newest last
    decisions: deque[StoreDecision] = field(default_factory=lambda: deque(maxlen=1024))  # oldest first
    _stored: set[str] = field(default_factory=set, repr=False)  # keys the store has (or will have), as known here

    # -- writes -----------------------------------------------------------------------------
    def writes(self, op: str) -> bool:
        """Whether the new blocks of a state made by ``op`` are written through."""
        if self.store is None or self.store_write == "off":
            return False
        return self.store_write == "all" or op in WRITE_OPS

    @property
    def tenant(self) -> StoreTenant:
        """Whose objects this tier reads and writes (workers get it inside each store task)."""
        return self.store.tenant

    def write_request(self, key: str, start: int, end: int) -> store_io.WriteRequest:
        """A write of the block whose content address is ``key`` (stored objects are named by
        content, so any Dask key of it reads them back)."""
        self._stored.add(key)
        return store_io.WriteRequest(self.store.url, key, start, end, self.fingerprint_digest, self.tenant)

    def write_reused(self, held: HeldPrefix, upto: int) -> None:
        """Write the reused blocks (ending by ``upto``) of a new shared state that the store may
        lack, each where it is held: one small low-priority task per worker, which only queues
        the writes there."""
        by_worker: dict[str | None, list] = {}
        for b in held.blocks:
            if b.end <= upto and content_key(b.key) not in self._stored:
                by_worker.setdefault(next(iter(b.where), None), []).append(b)
        for worker, blocks in by_worker.items():
            reqs = [self.write_request(content_key(b.key), b.start, b.end) for b in blocks]
            fut = self.client.submit(store_io.persist_blocks, reqs, *held.futures_of(blocks),
                                     key=task_key(PERSIST, self.namespace), workers=[worker] if worker else None,
                                     allow_other_workers=True, priority=-10, pure=False)
            fire_and_forget(fut)

    def write_state(self, state) -> int:
        """Write a state's blocks the store lacks (a ``DistKVState``: a conversation spilled
        while it waits for a tool, ``flow.kv_wait``), from the worker that holds it, in one
        small task that only queues the writes there (the writer keeps the tensors: the state
        may be released at once). -> how many blocks were queued."""
        if self.store is None:
            raise ValueError("no persistent store to spill to (KVRuntime(kv_store=...))")
        todo = [(b, f) for b, f in zip(state.state.blocks, state.futures) if content_key(b.key) not in self._stored]
        if todo:
            reqs = [self.write_request(content_key(b.key), b.start, b.end) for b, _ in todo]
            worker = state.state.worker
            fut = self.client.submit(store_io.persist_blocks, reqs, *(f for _, f in todo),
                                     key=task_key(PERSIST, self.namespace), workers=[worker] if worker else None,
                                     allow_other_workers=True, pure=False)
            gather(self.client, [fut])  # queued before the caller releases the blocks
        return len(todo)

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every worker has written what it queued; how many writes are still pending."""
        if self.store is None:
            return 0
        timeout = config.get_seconds("store.flush-timeout") if timeout is None else timeout
        return sum(self.client.run(store_io.drain, timeout).values())

    # -- what reads know ----------------------------------------------------------------------
    def mark_stored(self, keys: Iterable[str]) -> None:
        self._stored.update(keys)

    def mark_missing(self, key: str) -> None:
        """``key`` failed verification: it is written again when recomputed."""
        self._stored.discard(key)

    def record_load(self, nbytes: int, seconds: float) -> None:
        self.samples.append(StoreSample(nbytes, seconds))

    def record_decision(self, d: StoreDecision) -> None:
        self.decisions.append(d)

    def profile(self) -> StoreProfile | None:
        """Load speed as measured on workers (None before any load or probe)."""
        return fit_store_profile(list(self.samples)) if self.samples else None

    def calibrate(self, probe_bytes: int | str | None = None) -> dict:
        """Write and read back one probe object from a worker; feeds ``profile``."""
        nbytes = validation.setting("store.probe-bytes", probe_bytes, "probe_bytes", validation.byte_size)
        workers = worker_addresses(self.client)
        [samples] = gather(self.client, [self.client.submit(store_io.probe, self.store.url, nbytes, self.tenant,
                                                            workers=workers[:1], pure=False)])
        self.samples.extend(StoreSample(n, s) for n, s in samples)
        p = self.profile()
        return {"bandwidth": p.bandwidth, "latency": p.latency, "samples": len(self.samples)}

    def explain(self) -> str:
        return "\n".join(explain_store(d) for d in list(self.decisions))  # other threads append meanwhile
