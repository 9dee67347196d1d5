"""One block as one object: safetensors bytes with the manifest in its metadata.

One object, not a tensor file plus a manifest file: a reader can never see a manifest
whose tensor is missing, and one atomic write publishes both. The manifest sits in the
safetensors header, so ``ls`` reads the first few hundred bytes of an object, never its
tensor. Every read is verified (format, key, dtype, shape, byte count, checksum); any
mismatch raises ``CorruptBlockError`` and the caller treats the object as a miss.
"""

from __future__ import annotations

import json
import struct
import time
import zlib

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import DaskflowKVError
from .manifest import BlockManifest, check_key

TENSOR = "kv"  # the tensor's name inside the object
META = "daskflow-kv"  # the metadata entry holding the manifest's JSON
_HEAD = 8  # safetensors: a little-endian u64 header length, then the JSON header
MAX_HEADER = 1 << 16  # our headers are ~400 bytes; a larger one is not ours


class CorruptBlockError(DaskflowKVError):
    """A stored object is truncated, altered or not the block it is named after."""


def checksum(t: torch.Tensor) -> str:
    """``crc32:<hex>`` of the tensor's bytes, in memory order (any dtype).

    What it guards against is accidental damage - a truncated upload, a flipped bit, a torn
    write on a file system without atomic rename - as object stores' own CRC32 checksums
    do; it is no signature (whoever can write the store can rewrite the manifest too). CRC32
    runs at ~5 GB/s here, a cryptographic hash at 1-2 GB/s: on a warm read the checksum
    would otherwise cost as much as the rest of the load.
    """
    flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return f"crc32:{zlib.crc32(flat.numpy().data):08x}"


def encode(tensor: torch.Tensor, key: str, start: int, end: int, fingerprint: str,
           created: float | None = None) -> tuple[bytes, BlockManifest]:
    """The object's bytes for one block, and its manifest."""
    t = tensor.detach().contiguous().cpu()
    manifest = BlockManifest(
        key=check_key(key),
        start=int(start),
        end=int(end),
        nbytes=t.numel() * t.element_size(),
        dtype=str(t.dtype).removeprefix("torch."),
        shape=tuple(t.shape),
        checksum=checksum(t),
        fingerprint=str(fingerprint),
        created=time.time() if created is None else float(created),
    )
    return st_save({TENSOR: t}, metadata={META: manifest.to_json()}), manifest


def header_length(head: bytes) -> int:
    """Bytes of the object up to the end of its header (what ``read_manifest`` needs)."""
    if len(head) < _HEAD:
        raise CorruptBlockError("object shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head[:_HEAD])
    if not 0 < n <= MAX_HEADER:
        raise CorruptBlockError(f"header length {n} out of range")
    return _HEAD + n


def read_manifest(head: bytes, key: str | None = None) -> BlockManifest:
    """The manifest from an object's first ``header_length`` bytes (or all of them)."""
    n = header_length(head)
    if len(head) < n:
        raise CorruptBlockError("object truncated inside its header")
    try:
        header = json.loads(head[_HEAD:n])
        manifest = BlockManifest.from_json(header["__metadata__"][META])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlockError(f"unreadable manifest: {e}") from None
    if key is not None and manifest.key != key:
        raise CorruptBlockError(f"object holds block {manifest.key}, not {key}")
    return manifest


def decode(data: bytes, key: str) -> tuple[torch.Tensor, BlockManifest]:
    """The verified tensor and manifest of object ``data`` stored under ``key``."""
    manifest = read_manifest(data, key)
    try:
        t = st_load(bytes(data))[TENSOR]
    except Exception as e:  # safetensors raises its own error types for bad bytes
        raise CorruptBlockError(f"unreadable tensor: {type(e).__name__}: {e}") from None
    if (str(t.dtype).removeprefix("torch."), tuple(t.shape)) != (manifest.dtype, manifest.shape):
        raise CorruptBlockError(f"tensor {t.dtype} {tuple(t.shape)} does not match its manifest")
    if t.numel() * t.element_size() != manifest.nbytes or checksum(t) != manifest.checksum:
        raise CorruptBlockError("checksum mismatch")
    return t, manifest
