"""Where a store keeps what: object names by tenant, and listings read back into blocks.

Layout under the store's root (``v2`` is the layout version)::

    v2/<tenant dir>/blocks/<2 hex>/<name>.kvobj   one block, sealed for its tenant (see codec)
    v2/<tenant dir>/access/<2 hex>/<name>         empty; its mtime is the block's last read
    v2/<tenant dir>/probe/<name>.kvobj            calibration objects, deleted after use

``<tenant dir>`` is ``StoreTenant.prefix``: ``open``, or an HMAC of the namespace under its
secret. ``<name>`` is ``StoreTenant.object_name(key)``: 32 hex digits of an HMAC of the
block's key under the tenant's naming key - a walker learns neither keys nor, from the
namespace tag keys carry, whose directory it is - or the key itself for the open tenant.
The two hex digits fan names out over 256 directories.

Objects written before names were keyed are named by their full keys; ``listing`` still
finds them (so ``gc`` ages them out) and ``daskflow-kv store migrate`` renames a tenant's
(``maintenance.migrate``); reads look only under keyed names.

The ``v1`` layout (``v1/blocks/<2 hex>/<key>.safetensors``: one shared directory, objects
in the clear, a CRC32 anyone could recompute) is not read by this version - a v1 object
could have been written by anyone. ``listing`` still finds its blocks, so an admin's
``daskflow-kv store gc --all`` ages them out like any other.

Pure: names in, names out; no I/O (``walk`` takes the back end's listing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import re

from .backends import TMP_MARK, Entry
from .manifest import KEY_RE
from .tenant import NAME_HEX, VERSION

SUFFIX = ".kvobj"  # a v2 block object
LEGACY = "v1"  # the layout before tenancy: listed (for gc --all), never read
LEGACY_SUFFIX = ".safetensors"
_SUFFIXES = {VERSION: SUFFIX, LEGACY: LEGACY_SUFFIX}


def tenant_root(prefix: str) -> str:
    return f"{VERSION}/{prefix}"


NAME_RE = re.compile(rf"^[0-9a-f]{{{NAME_HEX}}}$")  # a keyed object name (StoreTenant.object_name)


def check_name(name) -> str:
    """An object name - a keyed hash, or a block key - or ValueError: names become paths, so
    nothing else gets in."""
    if not isinstance(name, str) or not (NAME_RE.match(name) or KEY_RE.match(name)):
        raise ValueError(f"not a KV object name: {name!r}")
    return name


def _fan(name: str) -> str:
    """The fan-out directory: two hex digits of the hash (after ``kvblock-`` in a key)."""
    return name[:2] if NAME_RE.match(name) else name[8:10]


def block_path(prefix: str, name: str) -> str:
    check_name(name)
    return f"{tenant_root(prefix)}/blocks/{_fan(name)}/{name}{SUFFIX}"


def access_path(prefix: str, name: str) -> str:
    check_name(name)
    return f"{tenant_root(prefix)}/access/{_fan(name)}/{name}"


def probe_path(prefix: str, name: str) -> str:
    check_name(name)
    return f"{tenant_root(prefix)}/probe/{name}{SUFFIX}"


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """What a listing says about one block: no object opened, nothing decrypted."""

    area: str  # whose: "v2/<tenant dir>", or "v1" for the legacy layout
    name: str  # its file name: a keyed hash of the block's key, or the key (open tenant, older objects)
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
            stem = name.rsplit(".", 1)[0]
            if KEY_RE.match(stem) or (area != LEGACY and NAME_RE.match(stem)):  # else not ours to list (or gc)
                objects.append((area, fan, stem, e))
    blocks = []
    for area, fan, stem, e in objects:
        used = max(e.mtime, marks.get((area, stem), 0.0))
        blocks.append(StoredBlock(area, stem, e.path, f"{area}/access/{fan}/{stem}", e.size, e.mtime, used))
    return blocks, temps


def named_by_key(block: StoredBlock) -> bool:
    """An object named by its block's full key (the open tenant's, or written before names
    were keyed: ``maintenance.migrate`` renames a sealed tenant's)."""
    return bool(KEY_RE.match(block.name))
