"""Looking after a store: what is in it (ls), how big it is (du), what to drop (gc).

``stale`` is the policy, a pure function of listings; the rest reads listings and acts.
``ls`` opens only object headers (the manifest: span, size, dtype, checksum, fingerprint
digest - never a token id); ``du`` and ``gc`` open nothing.

A block's age is the time since it was last *used*: its access mark (refreshed by reads)
or, if it was never read, its write.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from .kv_store import KVStore

TEMP_GRACE = 3600.0  # s: a temporary file this old belongs to a writer that died
AGE_BUCKETS = ((86400.0, "< 1d"), (7 * 86400.0, "1-7d"), (30 * 86400.0, "7-30d"), (float("inf"), ">= 30d"))


@dataclass(frozen=True, slots=True)
class StoredBlock:
    key: str
    nbytes: int  # object bytes (tensor + header)
    written: float  # unix time of the write
    used: float  # unix time of the last read, or the write if never read

    def age(self, now: float) -> float:
        return max(0.0, now - self.used)


def scan(store: KVStore) -> list[StoredBlock]:
    """Every block with its size and times: two listings, no object opened."""
    used = store.access_times()
    return [StoredBlock(k, e.size, e.mtime, max(e.mtime, used.get(k, 0.0))) for k, e in store.block_entries()]


def stale(blocks: Iterable[StoredBlock], older_than: float, now: float) -> list[StoredBlock]:
    """Blocks unused for longer than ``older_than`` seconds, oldest first. Pure policy.

    Whole chains age together (a prefix is read whenever its suffix is), so dropping by
    age rarely leaves a suffix without its prefix; when it does, the suffix is simply
    never found again (lookups walk chains from their first block) and ages out too.
    """
    return sorted((b for b in blocks if b.age(now) > older_than), key=lambda b: (b.used, b.key))


def usage(blocks: Iterable[StoredBlock], now: float) -> dict:
    """Totals and an age histogram (by last use)."""
    rows = list(blocks)
    hist = {label: {"blocks": 0, "bytes": 0} for _, label in AGE_BUCKETS}
    for b in rows:
        label = next(label for limit, label in AGE_BUCKETS if b.age(now) < limit)
        hist[label]["blocks"] += 1
        hist[label]["bytes"] += b.nbytes
    return {
        "blocks": len(rows),
        "bytes": sum(b.nbytes for b in rows),
        "oldest_use": min((b.used for b in rows), default=None),
        "newest_use": max((b.used for b in rows), default=None),
        "by_last_use": hist,
    }


def listing(store: KVStore, limit: int | None = None) -> list[dict]:
    """One row per block, newest use first: its manifest (no tokens) and its times."""
    rows = []
    for b in sorted(scan(store), key=lambda b: (-b.used, b.key))[:limit]:
        m = store.manifest(b.key)
        row = {"key": b.key, "object_bytes": b.nbytes, "written": b.written, "used": b.used, "valid_header": m is not None}
        if m is not None:
            row.update(start=m.start, end=m.end, nbytes=m.nbytes, dtype=m.dtype, shape=list(m.shape),
                       checksum=m.checksum, fingerprint=m.fingerprint, created=m.created)
        rows.append(row)
    return rows


@dataclass(frozen=True, slots=True)
class GCReport:
    deleted: int  # blocks removed (or that would be, on a dry run)
    bytes: int  # their object bytes
    temps: int  # abandoned temporary files removed
    kept: int  # blocks left


def gc(store: KVStore, older_than: float, now: float | None = None, dry_run: bool = False) -> GCReport:
    """Delete blocks unused for ``older_than`` seconds, and temporary files of dead writers."""
    now = time.time() if now is None else now
    blocks = scan(store)
    victims = stale(blocks, older_than, now)
    temps = [e for e in store.temp_entries() if now - e.mtime > TEMP_GRACE]
    if not dry_run:
        for b in victims:
            store.discard(b.key)
        for e in temps:
            store.delete_entry(e)
    return GCReport(len(victims), sum(b.nbytes for b in victims), len(temps), len(blocks) - len(victims))
