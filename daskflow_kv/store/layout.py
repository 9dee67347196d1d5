"""Where a store keeps what: object names by tenant, and listings read back into blocks.

Layout under the store's root (``v2`` is the layout version)::

    v2/<tenant dir>/blocks/<2 hex>/<key>.kvobj   one block, sealed for its tenant (see codec)
    v2/<tenant dir>/access/<2 hex>/<key>         empty; its mtime is the block's last read
    v2/<tenant dir>/probe/<key>.kvobj            calibration objects, deleted after use

``<tenant dir>`` is ``StoreTenant.prefix``: ``open``, or an HMAC of the namespace under its
secret. The two hex digits fan keys out over 256 directories.

The ``v1`` layout (``v1/blocks/<2 hex>/<key>.safetensors``: one shared directory, objects
in the clear, a CRC32 anyone could recompute) is not read by this version - a v1 object
could have been written by anyone. ``listing`` still finds its blocks, so an admin's
``daskflow-kv store gc --all`` ages them out like any other.

Pure: names in, names out; no I/O (``walk`` takes the back end's listing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .backends import TMP_MARK, Entry
from .manifest import KEY_RE, check_key
from .tenant import VERSION

SUFFIX = ".kvobj"  # a v2 block object
LEGACY = "v1"  # the layout before tenancy: listed (for gc --all), never read
LEGACY_SUFFIX = ".safetensors"
_SUFFIXES = {VERSION: SUFFIX, LEGACY: LEGACY_SUFFIX}


def tenant_root(prefix: str) -> str:
    return f"{VERSION}/{prefix}"


def block_path(prefix: str, key: str) -> str:
    check_key(key)
    return f"{tenant_root(prefix)}/blocks/{key[8:10]}/{key}{SUFFIX}"


def access_path(prefix: str, key: str) -> str:
    check_key(key)
    return f"{tenant_root(prefix)}/access/{key[8:10]}/{key}"


def probe_path(prefix: str, key: str) -> str:
    check_key(key)
    return f"{tenant_root(prefix)}/probe/{key}{SUFFIX}"


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """What a listing says about one block: no object opened, nothing decrypted."""

    area: str  # whose: "v2/<tenant dir>", or "v1" for the legacy layout
    key: str  # the block's content address (its file name)
    path: str  # the block object
    access: str  # its access mark (which may not exist)
    nbytes: int  # object bytes (header + sealed tensor)
    written: float  # unix time of the write
    used: float  # unix time of the last read, or the write if never read

    def age(self, now: float) -> float:
        return max(0.0, now - self.used)


def _area(path: str) -> tuple[str, str, str, str] | None:
    """(area, "blocks" | "access", fan-out dir, file name) of a path in either layout, else None."""
    parts = path.split("/")
    if len(parts) == 5 and parts[0] == VERSION:
        return f"{parts[0]}/{parts[1]}", parts[2], parts[3], parts[4]
    if len(parts) == 4 and parts[0] == LEGACY:
        return LEGACY, parts[1], parts[2], parts[3]
    return None


def sort_listing(entries: Iterable[Entry]) -> tuple[list[StoredBlock], list[Entry]]:
    """(blocks, temporary files of writes in progress or dead) from one or more walks.

    A block's last use is its access mark's mtime when it was read after its write.
    """
    objects, marks, temps = [], {}, []
    for e in entries:
        where = _area(e.path)
        if where is None:
            continue
        area, kind, fan, name = where
        if TMP_MARK in name:
            temps.append(e)
        elif kind == "access":
            marks[(area, name)] = e.mtime
        elif kind == "blocks" and name.endswith(_SUFFIXES[area.split("/")[0]]):
            key = name.rsplit(".", 1)[0]
            if KEY_RE.match(key):  # anything else is not ours to list (or to gc)
                objects.append((area, fan, key, e))
    blocks = []
    for area, fan, key, e in objects:
        used = max(e.mtime, marks.get((area, key), 0.0))
        blocks.append(StoredBlock(area, key, e.path, f"{area}/access/{fan}/{key}", e.size, e.mtime, used))
    return blocks, temps
