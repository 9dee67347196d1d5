"""The persistent KV store: blocks by content address, verified on every read.

Layout under the store's root (``v1`` is the layout version)::

    v1/blocks/<2 hex>/<key>.safetensors   one block: tensor + manifest (see codec)
    v1/access/<2 hex>/<key>               empty; its mtime is the block's last read
    v1/probe/...                          calibration objects, deleted after use

The two hex digits fan keys out over 256 directories. Reads refresh the access mark at
most once per ``touch_interval`` per process, so a hot block costs one small write an hour,
and ``gc --older-than`` sees when a block was last *used*, not only when it was written.

Misses are cheap and safe: an absent, truncated, altered or misnamed object is a miss
(``get`` returns None), never a wrong tensor; a corrupt one is also deleted, so the block
is written again the next time a worker computes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .. import config
from ..keys import block_key
from .backends import TMP_MARK, Entry, open_backend
from .codec import CorruptBlockError, decode, encode, header_length, read_manifest
from .manifest import BlockManifest, check_key

LAYOUT = "v1"
SUFFIX = ".safetensors"


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
    def __init__(self, backend, touch_interval: float | None = None):
        self.backend = backend
        self.url = backend.url
        self.touch_interval = config.get_seconds("store.touch-interval", touch_interval)
        self.stats = StoreStats()
        self._touched: dict[str, float] = {}  # key -> when this process last refreshed its access mark

    def __repr__(self) -> str:
        return f"KVStore({self.url!r})"

    # -- layout -----------------------------------------------------------------------------
    @staticmethod
    def block_path(key: str) -> str:
        check_key(key)
        return f"{LAYOUT}/blocks/{key[8:10]}/{key}{SUFFIX}"

    @staticmethod
    def access_path(key: str) -> str:
        check_key(key)
        return f"{LAYOUT}/access/{key[8:10]}/{key}"

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
        """Write one block unless the store has it; its manifest, or None when skipped.

        Concurrent writers of one key are harmless: each publishes a complete object
        atomically, with the same content (the key is a hash of what produced it).
        """
        path = self.block_path(key)
        if self.backend.exists(path):
            self.stats.add(skipped=1)
            return None
        t0 = time.perf_counter()
        data, manifest = encode(tensor, key, start, end, fingerprint)
        self.backend.write_atomic(path, data)
        self.stats.add(writes=1, bytes_written=manifest.nbytes, write_seconds=time.perf_counter() - t0)
        return manifest

    def read(self, key: str) -> ReadResult:
        """The block with its manifest if the store holds a good copy; else why not.

        ``status``: "hit", "miss" (absent) or "corrupt" (failed verification: deleted, so
        the next worker that computes the block writes a good copy).
        """
        t0 = time.perf_counter()
        data = self.backend.read(self.block_path(key))
        if data is None:
            self.stats.add(misses=1)
            return ReadResult("miss")
        try:
            tensor, manifest = decode(data, key)
        except CorruptBlockError:
            self.stats.add(corrupt=1)
            self.discard(key)
            return ReadResult("corrupt")
        seconds = time.perf_counter() - t0
        self.stats.add(hits=1, bytes_read=manifest.nbytes, read_seconds=seconds)
        self._touch(key)
        return ReadResult("hit", tensor, manifest, seconds)

    def get(self, key: str) -> torch.Tensor | None:
        """The block's tensor, or None: absent, truncated, altered or not this key's object."""
        return self.read(key).tensor

    def manifest(self, key: str) -> BlockManifest | None:
        """The manifest alone, from the object's header (the tensor is not read)."""
        path = self.block_path(key)
        head = self.backend.read(path, 4096)
        if head is None:
            return None
        try:
            n = header_length(head)
            if n > len(head):
                head = self.backend.read(path, n) or b""
            return read_manifest(head, key)
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
        try:
            self.backend.touch(self.access_path(key))
        except OSError:  # a read-only store still serves reads; gc then ages blocks by write time
            pass

    # -- listings (maintenance) ---------------------------------------------------------------
    def block_entries(self) -> Iterator[tuple[str, Entry]]:
        """(key, listing entry) of every complete block object; no object is opened."""
        for e in self.backend.walk(f"{LAYOUT}/blocks"):
            name = e.path.rsplit("/", 1)[-1]
            if TMP_MARK not in name and name.endswith(SUFFIX):
                yield name.removesuffix(SUFFIX), e

    def temp_entries(self) -> Iterator[Entry]:
        """Writes in progress, or left behind by a writer that died."""
        for e in self.backend.walk(f"{LAYOUT}/blocks"):
            if TMP_MARK in e.path.rsplit("/", 1)[-1]:
                yield e

    def access_times(self) -> dict[str, float]:
        """key -> last read (mtime of its access mark), for blocks read at least once."""
        return {e.path.rsplit("/", 1)[-1]: e.mtime for e in self.backend.walk(f"{LAYOUT}/access")}

    def delete_entry(self, entry: Entry) -> bool:
        return self.backend.delete(entry.path)

    # -- calibration --------------------------------------------------------------------------
    def probe(self, nbytes: int) -> tuple[float, float]:
        """(write s, read s) of one ``nbytes`` object through the real path: encode, atomic
        write, read, verify, decode. The object is deleted afterwards."""
        import secrets

        key = block_key(secrets.token_hex(16))
        path = f"{LAYOUT}/probe/{key}{SUFFIX}"
        t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        t0 = time.perf_counter()
        data, _ = encode(t, key, 0, 1, "probe")
        self.backend.write_atomic(path, data)
        t1 = time.perf_counter()
        decode(self.backend.read(path), key)
        t2 = time.perf_counter()
        self.backend.delete(path)
        return t1 - t0, t2 - t1


_OPEN: dict[str, KVStore] = {}
_OPEN_LOCK = threading.Lock()


def open_store(url: str, **storage_options) -> KVStore:
    """The store at ``url`` (a directory, ``file://...``, ``s3://...``, ``memory://...``).

    One object per URL and process (workers open it in every task that needs it).
    """
    url = str(url)
    if storage_options:
        return KVStore(open_backend(url, **storage_options))
    with _OPEN_LOCK:
        store = _OPEN.get(url)
        if store is None:
            store = _OPEN[url] = KVStore(open_backend(url))
        return store
