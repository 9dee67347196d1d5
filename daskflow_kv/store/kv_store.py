"""The persistent KV store: one tenant's blocks by content address, verified on every read.

Layout (``layout``)::

    v2/<tenant dir>/blocks/<2 hex>/<name>.kvobj   one block: manifest + tensor, sealed (see codec)
    v2/<tenant dir>/access/<2 hex>/<name>         empty; its mtime is the block's last read
    v2/<tenant dir>/probe/...                     calibration objects, deleted after use

``<name>`` is a keyed hash of the block's key (``StoreTenant.object_name``): the store's
file names give away neither keys nor whose directory is whose.

A ``KVStore`` is one tenant's view (``tenant.StoreTenant``): it reads, writes, lists and
deletes only inside its tenant's directory, and opens only objects sealed with its key.
Reads refresh the access mark at most once per ``touch_interval`` per process, so a hot
block costs one small write an hour, and ``gc --older-than`` sees when a block was last
*used*, not only when it was written.

Misses are cheap and safe: an absent, truncated, altered, misnamed or forged object (one
another tenant wrote, or copied here from another name) is a miss (``get`` returns None),
never a wrong tensor; such an object is also deleted, so the block is written again the
next time a worker computes it.

The ``v1`` layout (one directory for every tenant, objects in the clear) is not read by
this version: nothing in it could be trusted. ``daskflow-kv store gc --all`` (an admin)
removes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .. import config
from ..keys import block_key
from . import layout
from .backends import Entry, open_backend
from .codec import CorruptBlockError, decode, encode, header_length, read_manifest
from .manifest import BlockManifest, check_key
from .tenant import OPEN_TENANT, StoreTenant

TOUCHED_KEPT = 4096  # access marks remembered per process before the stale ones are dropped

@dataclass(slots=True)
class StoreStats:
    """What this process did with the store (reads on workers feed the planner's profile)."""

    hits: int = 0  # blocks read and verified
    misses: int = 0  # blocks asked for and absent
    corrupt: int = 0  # objects that failed verification (and were deleted)
    bytes_read: int = 0  # tensor bytes of the hits
    read_seconds: float = 0.0  # wall time of the hits: read, verify, decode
    writes: int = 0  # objects written
    skipped: int = 0  # writes not needed: the block was there already
    bytes_written: int = 0
    write_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **delta) -> None:
        with self.lock:
            for k, v in delta.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__ if k != "lock"}


@dataclass(frozen=True, slots=True)
class ReadResult:
    status: str  # "hit" | "miss" | "corrupt"
    tensor: torch.Tensor | None = None
    manifest: BlockManifest | None = None
    seconds: float = 0.0  # read + verify + decode, for a hit


class KVStore:
    def __init__(self, backend, tenant: StoreTenant = OPEN_TENANT, touch_interval: float | None = None):
        if not isinstance(tenant, StoreTenant):
            raise TypeError(f"a store's tenant is a StoreTenant, not {type(tenant).__name__}")
        self.backend = backend
        self.url = backend.url
        self.tenant = tenant
        self.root = layout.tenant_root(tenant.prefix)  # everything this view reads, writes or lists
        self.touch_interval = config.get_seconds("store.touch-interval", touch_interval)
        self.stats = StoreStats()
        self._touched: dict[str, float] = {}  # key -> when this process last refreshed its access mark

    def __repr__(self) -> str:
        return f"KVStore({self.url!r}, tenant={self.tenant.prefix!r})"

    # -- layout -----------------------------------------------------------------------------
    def block_path(self, key: str) -> str:
        return layout.block_path(self.tenant.prefix, self.tenant.object_name(check_key(key)))

    def access_path(self, key: str) -> str:
        return layout.access_path(self.tenant.prefix, self.tenant.object_name(check_key(key)))

    # -- blocks -----------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.backend.exists(self.block_path(key))

    def leading(self, keys: Iterable[str]) -> int:
        """How many of ``keys`` (a chain, in order) the store holds before the first absent one.

        A prefix is only useful up to its first gap: the K/V after it attend to it.
        """
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def put(self, tensor: torch.Tensor, key: str, start: int, end: int, fingerprint: str) -> BlockManifest | None:
        """Write one block unless the store has a copy whose header opens; its manifest, or
        None when skipped.

        An object there that does not open (another tenant's, or damaged) is replaced, not
        trusted. Concurrent writers of one key are harmless: each publishes a complete
        object atomically, with the same content (the key is a hash of what produced it).
        """
        if self.manifest(key) is not None:
            self.stats.add(skipped=1)
            return None
        path = self.block_path(key)
        t0 = time.perf_counter()
        data, manifest = encode(tensor, key, start, end, fingerprint, path=path, tenant=self.tenant)
        self.backend.write_atomic(path, data)
        self.stats.add(writes=1, bytes_written=manifest.nbytes, write_seconds=time.perf_counter() - t0)
        return manifest

    def read(self, key: str) -> ReadResult:
        """The block with its manifest if the store holds a good copy; else why not.

        ``status``: "hit", "miss" (absent) or "corrupt" (failed verification or
        authentication: deleted, so the next worker that computes the block writes a good copy).
        """
        t0 = time.perf_counter()
        path = self.block_path(key)
        data = self.backend.read(path)
        if data is None:
            self.stats.add(misses=1)
            return ReadResult("miss")
        try:
            tensor, manifest = decode(data, key, path=path, tenant=self.tenant)
        except CorruptBlockError:
            self.stats.add(corrupt=1)
            self.discard(key)
            return ReadResult("corrupt")
        seconds = time.perf_counter() - t0
        self.stats.add(hits=1, bytes_read=manifest.nbytes, read_seconds=seconds)
        self._touch(key)
        return ReadResult("hit", tensor, manifest, seconds)

    def get(self, key: str) -> torch.Tensor | None:
        """The block's tensor, or None: absent, truncated, altered, forged or not this key's object."""
        return self.read(key).tensor

    def manifest(self, key: str) -> BlockManifest | None:
        """The manifest alone, from the object's header (the tensor is not read); None when
        the object is absent or its header does not open for this tenant."""
        return self.manifest_at(self.block_path(key), key)

    def manifest_at(self, path: str, key: str | None = None) -> BlockManifest | None:
        """The manifest of the object at ``path`` (``key``: the block it must be; None: any,
        as a listing reads it); None when absent or not opening for this tenant."""
        head = self.backend.read(path, 4096)
        if head is None:
            return None
        try:
            n = header_length(head, self.tenant)
            if n > len(head):
                head = self.backend.read(path, n) or b""
            return read_manifest(head, key, path=path, tenant=self.tenant)
        except CorruptBlockError:
            return None

    def discard(self, key: str) -> bool:
        gone = self.backend.delete(self.block_path(key))
        self.backend.delete(self.access_path(key))
        self._touched.pop(key, None)
        return gone

    def _touch(self, key: str) -> None:
        now = time.time()
        if now - self._touched.get(key, 0.0) < self.touch_interval:
            return
        self._touched[key] = now
        if len(self._touched) > TOUCHED_KEPT:  # marks older than the interval would be refreshed anyway
            self._touched = {k: t for k, t in self._touched.items() if now - t < self.touch_interval}
        try:
            self.backend.touch(self.access_path(key))
        except OSError:  # a read-only store still serves reads; gc then ages blocks by write time
            pass

    # -- listings (maintenance) ---------------------------------------------------------------
    def listing(self) -> tuple[list[layout.StoredBlock], list[Entry]]:
        """(this tenant's blocks, its temporary files): two listings' worth, no object opened."""
        return layout.sort_listing(self.backend.walk(self.root))

    def temp_entries(self) -> Iterator[Entry]:
        """Writes in progress, or left behind by a writer that died (this tenant's)."""
        return iter(self.listing()[1])

    def delete_entry(self, entry: Entry) -> bool:
        return self.backend.delete(entry.path)

    # -- calibration --------------------------------------------------------------------------
    def probe(self, nbytes: int) -> tuple[float, float]:
        """(write s, read s) of one ``nbytes`` object through the real path: encode and seal,
        atomic write, read, open, verify, decode. The object is deleted afterwards."""
        import secrets

        key = block_key(secrets.token_hex(16))
        path = layout.probe_path(self.tenant.prefix, self.tenant.object_name(key))
        t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        t0 = time.perf_counter()
        data, _ = encode(t, key, 0, 1, "probe", path=path, tenant=self.tenant)
        self.backend.write_atomic(path, data)
        t1 = time.perf_counter()
        decode(self.backend.read(path), key, path=path, tenant=self.tenant)
        t2 = time.perf_counter()
        self.backend.delete(path)
        return t1 - t0, t2 - t1


_OPEN: dict[tuple[str, StoreTenant], KVStore] = {}
_OPEN_LOCK = threading.Lock()


def open_store(url: str, tenant: StoreTenant | None = None, **storage_options) -> KVStore:
    """``tenant``'s view (default: the open tenant) of the store at ``url`` (a directory,
    ``file://...``, ``s3://...``, ``memory://...``).

    One object per URL, tenant and process (workers open it in every task that needs it).
    """
    url = str(url)
    tenant = OPEN_TENANT if tenant is None else tenant
    if storage_options:
        return KVStore(open_backend(url, **storage_options), tenant)
    with _OPEN_LOCK:
        store = _OPEN.get((url, tenant))
        if store is None:
            store = _OPEN[(url, tenant)] = KVStore(open_backend(url), tenant)
        return store
