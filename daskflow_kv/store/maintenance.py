"""Looking after a store: what is in it (ls), how big it is (du), what to drop (gc).

``stale`` is the policy, a pure function of listings; the rest reads listings and acts.
Each tenant looks after its own directory (``scan``, ``listing``, ``gc`` on its
``KVStore``): ``listing`` opens object headers with the tenant's key (the manifest: span,
size, dtype, checksum, fingerprint digest - never a token id); ``du`` and ``gc`` open
nothing. An admin looks after every tenant's directory and the legacy ``v1`` layout
(``scan_all``, ``listing_all``, ``gc_all``) from listings alone: paths, sizes and times,
the only things in a store that are not sealed.

A block's age is the time since it was last *used*: its access mark (refreshed by reads)
or, if it was never read, its write.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .backends import Entry
from .codec import CorruptBlockError, decode
from .kv_store import KVStore
from .layout import LEGACY, StoredBlock, named_by_key, sort_listing
from .tenant import VERSION

TEMP_GRACE = 3600.0  # s: a temporary file this old belongs to a writer that died
AGE_BUCKETS = ((86400.0, "< 1d"), (7 * 86400.0, "1-7d"), (30 * 86400.0, "7-30d"), (float("inf"), ">= 30d"))

def scan(store: KVStore) -> list[StoredBlock]:
    """The tenant's blocks with their sizes and times: listings only, no object opened."""
    return store.listing()[0]


def _everything(backend) -> tuple[list[StoredBlock], list[Entry]]:
    """Every tenant's blocks and temporary files, and the legacy layout's."""
    return sort_listing(e for top in (VERSION, LEGACY) for e in backend.walk(top))


def scan_all(backend) -> list[StoredBlock]:
    """Every tenant's blocks (and the legacy layout's), for an admin."""
    return _everything(backend)[0]


def stale(blocks: Iterable[StoredBlock], older_than: float, now: float) -> list[StoredBlock]:
    """Blocks unused for longer than ``older_than`` seconds, oldest first. Pure policy.

    Whole chains age together (a prefix is read whenever its suffix is), so dropping by
    age rarely leaves a suffix without its prefix; when it does, the suffix is simply
    never found again (lookups walk chains from their first block) and ages out too.
    """
    return sorted((b for b in blocks if b.age(now) > older_than), key=lambda b: (b.used, b.area, b.name))


def usage(blocks: Iterable[StoredBlock], now: float, by_area: bool = False) -> dict:
    """Totals and an age histogram (by last use); with ``by_area`` also totals per tenant."""
    rows = list(blocks)
    hist = {label: {"blocks": 0, "bytes": 0} for _, label in AGE_BUCKETS}
    for b in rows:
        label = next(label for limit, label in AGE_BUCKETS if b.age(now) < limit)
        hist[label]["blocks"] += 1
        hist[label]["bytes"] += b.nbytes
    out = {
        "blocks": len(rows),
        "bytes": sum(b.nbytes for b in rows),
        "oldest_use": min((b.used for b in rows), default=None),
        "newest_use": max((b.used for b in rows), default=None),
        "by_last_use": hist,
    }
    if by_area:
        areas: dict[str, dict] = {}
        for b in rows:
            a = areas.setdefault(b.area, {"blocks": 0, "bytes": 0})
            a["blocks"] += 1
            a["bytes"] += b.nbytes
        out["by_tenant"] = dict(sorted(areas.items()))
    return out


def _newest_first(blocks: list[StoredBlock], limit: int | None) -> list[StoredBlock]:
    return sorted(blocks, key=lambda b: (-b.used, b.area, b.name))[:limit]


def listing(store: KVStore, limit: int | None = None) -> list[dict]:
    """The tenant's blocks, newest use first: each manifest (no tokens) and its times. The
    key comes from the sealed manifest (file names are keyed hashes of it)."""
    rows = []
    for b in _newest_first(scan(store), limit):
        m = store.manifest_at(b.path)
        if m is not None and b.name not in (m.key, store.tenant.object_name(m.key)):
            m = None  # not the block its name says
        row = {"key": None if m is None else m.key, "name": b.name, "object_bytes": b.nbytes, "written": b.written,
               "used": b.used, "valid_header": m is not None, "named_by_key": named_by_key(b) and store.tenant.sealed}
        if m is not None:
            row.update(start=m.start, end=m.end, nbytes=m.nbytes, dtype=m.dtype, shape=list(m.shape),
                       checksum=m.checksum, fingerprint=m.fingerprint, created=m.created)
        rows.append(row)
    return rows


def listing_all(backend, limit: int | None = None, names: Mapping[str, str] | None = None) -> list[dict]:
    """Every tenant's blocks, newest use first, from listings alone: whose directory (with the
    namespace when ``names`` maps the directory to it), path, size, times. Nothing is opened."""
    names = names or {}
    return [{"tenant": b.area, "namespace": names.get(b.area), "name": b.name, "path": b.path,
             "object_bytes": b.nbytes, "written": b.written, "used": b.used}
            for b in _newest_first(scan_all(backend), limit)]


@dataclass(frozen=True, slots=True)
class GCReport:
    deleted: int  # blocks removed (or that would be, on a dry run)
    bytes: int  # their object bytes
    temps: int  # abandoned temporary files removed
    kept: int  # blocks left


def _collect(backend, blocks: list[StoredBlock], temps: list[Entry], older_than: float, now: float | None,
             dry_run: bool) -> GCReport:
    now = time.time() if now is None else now
    victims = stale(blocks, older_than, now)
    old_temps = [e for e in temps if now - e.mtime > TEMP_GRACE]
    if not dry_run:
        for b in victims:
            backend.delete(b.path)
            backend.delete(b.access)
        for e in old_temps:
            backend.delete(e.path)
    return GCReport(len(victims), sum(b.nbytes for b in victims), len(old_temps), len(blocks) - len(victims))


def gc(store: KVStore, older_than: float, now: float | None = None, dry_run: bool = False) -> GCReport:
    """Delete the tenant's blocks unused for ``older_than`` seconds, and its dead writers'
    temporary files. Nothing outside the tenant's directory is touched."""
    return _collect(store.backend, *store.listing(), older_than, now, dry_run)


@dataclass(frozen=True, slots=True)
class MigrateReport:
    renamed: int  # objects now under their keyed names
    dropped: int  # objects named by a key that did not open for the tenant (deleted: a miss, never loaded)


def migrate(store: KVStore) -> MigrateReport:
    """Rename the tenant's objects written before names were keyed (named by their full key,
    which tells a walker whose directory it is) to keyed names: each is opened, checked and
    sealed again for its new path (the path is part of what a seal authenticates), then the
    old object and its access mark go. The open tenant's objects keep their keys as names."""
    renamed = dropped = 0
    if not store.tenant.sealed:
        return MigrateReport(0, 0)
    for b in scan(store):
        if not named_by_key(b):
            continue
        data = store.backend.read(b.path)
        try:
            tensor, m = decode(data or b"", b.name, path=b.path, tenant=store.tenant)
        except CorruptBlockError:
            dropped += 1
        else:
            if store.manifest(m.key) is None:
                store.put(tensor, m.key, m.start, m.end, m.fingerprint)
            renamed += 1
        store.backend.delete(b.path)
        store.backend.delete(b.access)
    return MigrateReport(renamed, dropped)


def gc_all(backend, older_than: float, now: float | None = None, dry_run: bool = False) -> GCReport:
    """``gc`` over every tenant's directory and the legacy ``v1`` layout (an admin's)."""
    return _collect(backend, *_everything(backend), older_than, now, dry_run)
