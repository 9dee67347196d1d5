"""One block as one object, sealed for its tenant.

An object is three parts, written together by one atomic write::

    clear header   45 bytes: magic, seal (0: none, 1: AES-256-GCM), the manifest's nonce,
                   the body's nonce, the manifest part's length, the body's length
    manifest part  the manifest's JSON, padded to a multiple of 256 bytes, then sealed
    body           the tensor's bytes in memory order, then sealed

Sealed means AES-256-GCM under the tenant's key (``tenant.StoreTenant``), with a fresh
random nonce per part. Besides its own bytes each seal authenticates (associated data):

* the manifest part: its purpose, the object's path and the clear header;
* the body: its purpose, the path, the clear header and the sealed manifest part.

So an object sealed under another tenant's key, copied to another name, given another
object's header or body, or with any byte flipped fails to open: ``CorruptBlockError``,
and the store treats it as a miss. The clear header holds random nonces and lengths -
nothing that names the model (fingerprint), the namespace or the tokens - and the padding
keeps the manifest's length from hinting at its content. ``ls`` opens the clear header and
the manifest part (~600 bytes), never the body.

The open tenant's objects (no secret: one trust domain) have the same layout unsealed: seal
0, zero nonces, the manifest in the clear, every read checked against it (key, dtype,
shape, byte count, CRC32 of the tensor). A reader takes only its own kind: a sealed tenant
never accepts an unsealed object (anybody can write one), nor the open tenant a sealed one.
"""

from __future__ import annotations

import os
import struct
import time
import zlib

import torch

from ..errors import DaskflowKVError
from .manifest import BlockManifest, check_key
from .tenant import VERSION, StoreTenant

MAGIC = b"DFKVOBJ" + VERSION[1:].encode()  # b"DFKVOBJ2": this format, this layout version
_CLEAR = struct.Struct("<8sB12s12sIQ")  # magic, seal, manifest nonce, body nonce, manifest len, body len
CLEAR_BYTES = _CLEAR.size  # 45
UNSEALED, AES_256_GCM = 0, 1  # the seal byte
_NONCE = 12  # bytes: GCM's standard nonce
_TAG = 16  # bytes GCM appends to each sealed part
_PAD = 256  # the manifest part is padded to a multiple of this
MAX_MANIFEST = 1 << 16  # our manifest parts are 512 bytes; a larger one is not ours
_AD_MANIFEST = f"daskflow-kv/store/{VERSION}/manifest".encode()  # what each seal is for (associated data)
_AD_BODY = f"daskflow-kv/store/{VERSION}/body".encode()


class CorruptBlockError(DaskflowKVError):
    """A stored object is truncated, altered, forged or not the block it is named after."""


def checksum(t: torch.Tensor) -> str:
    """``crc32:<hex>`` of the tensor's bytes, in memory order (any dtype).

    What it guards against is accidental damage - a truncated upload, a flipped bit, a torn
    write on a file system without atomic rename - as object stores' own CRC32 checksums
    do; it is no signature (whoever can write the store can rewrite the manifest too: that
    is what the seal is for). CRC32 runs at ~5 GB/s here, a cryptographic hash at 1-2 GB/s.
    """
    flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return f"crc32:{zlib.crc32(flat.numpy().data):08x}"


def _aead(tenant: StoreTenant):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(tenant.key)


def _ad(purpose: bytes, path: str, *parts: bytes) -> bytes:
    return b"\0".join((purpose, path.encode(), *parts))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def encode(tensor: torch.Tensor, key: str, start: int, end: int, fingerprint: str, *, path: str,
           tenant: StoreTenant, created: float | None = None) -> tuple[bytes, BlockManifest]:
    """The object's bytes for one block stored at ``path`` by ``tenant``, and its manifest."""
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
    text = manifest.to_json().encode()
    text += b" " * (-len(text) % _PAD)  # JSON allows trailing blanks
    body = _tensor_bytes(t)
    if not tenant.sealed:
        clear = _CLEAR.pack(MAGIC, UNSEALED, bytes(_NONCE), bytes(_NONCE), len(text), len(body))
        return b"".join((clear, text, body)), manifest
    aead, m_nonce, b_nonce = _aead(tenant), os.urandom(_NONCE), os.urandom(_NONCE)
    clear = _CLEAR.pack(MAGIC, AES_256_GCM, m_nonce, b_nonce, len(text) + _TAG, len(body) + _TAG)
    sealed_manifest = aead.encrypt(m_nonce, text, _ad(_AD_MANIFEST, path, clear))
    sealed_body = aead.encrypt(b_nonce, body, _ad(_AD_BODY, path, clear, sealed_manifest))
    return b"".join((clear, sealed_manifest, sealed_body)), manifest


def _clear_header(head: bytes, tenant: StoreTenant) -> tuple:
    if len(head) < CLEAR_BYTES:
        raise CorruptBlockError("object shorter than its clear header")
    magic, seal, m_nonce, b_nonce, m_len, b_len = _CLEAR.unpack_from(head)
    if magic != MAGIC:
        raise CorruptBlockError("not a daskflow-kv v2 object")
    if seal != (AES_256_GCM if tenant.sealed else UNSEALED):
        raise CorruptBlockError("object not sealed the way this tenant seals (another tenant's, or forged)")
    if not 0 < m_len <= MAX_MANIFEST:
        raise CorruptBlockError(f"manifest length {m_len} out of range")
    return m_nonce, b_nonce, m_len, b_len


def header_length(head: bytes, tenant: StoreTenant) -> int:
    """Bytes of the object up to the end of its manifest part (what ``read_manifest`` needs)."""
    return CLEAR_BYTES + _clear_header(head, tenant)[2]


def _open_manifest(head: bytes, key: str | None, path: str, tenant: StoreTenant) -> tuple[BlockManifest, bytes, int]:
    """(manifest, the body's nonce, the body's length) from the object's first bytes."""
    m_nonce, b_nonce, m_len, b_len = _clear_header(head, tenant)
    end = CLEAR_BYTES + m_len
    if len(head) < end:
        raise CorruptBlockError("object truncated inside its manifest")
    text = head[CLEAR_BYTES:end]
    if tenant.sealed:
        from cryptography.exceptions import InvalidTag

        try:
            text = _aead(tenant).decrypt(m_nonce, bytes(text), _ad(_AD_MANIFEST, path, bytes(head[:CLEAR_BYTES])))
        except InvalidTag:
            raise CorruptBlockError("manifest fails authentication: another tenant's, moved, or altered") from None
    try:
        manifest = BlockManifest.from_json(bytes(text).decode())
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlockError(f"unreadable manifest: {e}") from None
    if key is not None and manifest.key != key:
        raise CorruptBlockError(f"object holds block {manifest.key}, not {key}")
    return manifest, b_nonce, b_len


def read_manifest(head: bytes, key: str | None = None, *, path: str, tenant: StoreTenant) -> BlockManifest:
    """The manifest from an object's first ``header_length`` bytes (or all of them)."""
    return _open_manifest(head, key, path, tenant)[0]


def _tensor(data: bytes, manifest: BlockManifest) -> torch.Tensor:
    dtype = getattr(torch, manifest.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptBlockError(f"unknown dtype {manifest.dtype!r}")
    shape = manifest.shape
    count = 1
    for n in shape:
        if n < 0:
            raise CorruptBlockError(f"negative dimension in {shape}")
        count *= n
    if len(data) != manifest.nbytes or count * dtype.itemsize != manifest.nbytes:
        raise CorruptBlockError(f"{len(data)} tensor bytes do not match its manifest ({manifest.nbytes})")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def decode(data: bytes, key: str, *, path: str, tenant: StoreTenant) -> tuple[torch.Tensor, BlockManifest]:
    """The verified tensor and manifest of object ``data`` stored at ``path`` under ``key``."""
    manifest, b_nonce, b_len = _open_manifest(data, key, path, tenant)
    start = header_length(data, tenant)
    if len(data) != start + b_len:
        raise CorruptBlockError(f"object is {len(data)} bytes, its header says {start + b_len}")
    body = memoryview(data)[start:]
    if tenant.sealed:
        from cryptography.exceptions import InvalidTag

        ad = _ad(_AD_BODY, path, bytes(data[:CLEAR_BYTES]), bytes(data[CLEAR_BYTES:start]))
        try:
            body = _aead(tenant).decrypt(b_nonce, body, ad)
        except InvalidTag:
            raise CorruptBlockError("tensor fails authentication: another object's body, moved, or altered") from None
    t = _tensor(body, manifest)
    # A sealed body's tag already proved every byte is what the tenant's writer sealed (the
    # bytes its CRC was taken of): the CRC guards the open tenant's objects.
    if not tenant.sealed and checksum(t) != manifest.checksum:
        raise CorruptBlockError("checksum mismatch")
    return t, manifest
