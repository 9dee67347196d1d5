"""Whose objects these are: a tenant's credential for the persistent store.

A store is shared: every client and worker of every tenant must reach its URL, so any of
them can list, read and overwrite any object in it. What keeps tenants apart is not the
file system but two values derived from the tenant's secret:

* ``prefix`` - the tenant's directory, ``v2/<prefix>/...``: an HMAC of the namespace under
  the secret, so a directory name says nothing about whose it is, and ``store ls|du|gc``
  look only inside the caller's own;
* ``names`` - a key (HKDF-SHA256 of the secret) that names each object: its file name is an
  HMAC of the block's key (``object_name``), never the key itself, which carries the
  namespace's public tag and would tell a walker whose directory it is, and hand out full
  block keys (a full key fetches the block's K/V from any Dask client while it is cached);
* ``key`` - an AES-256-GCM key (HKDF-SHA256 of the secret, with an info string naming the
  purpose, the layout version and the namespace) that seals every object the tenant writes
  (see ``codec``): another tenant can neither read it nor make one this tenant accepts.

All three are one HMAC or HKDF step from the secret, unstretched: a guess at the secret is
checked offline as fast as an HMAC runs (so are block keys on Dask's pages and a login seen
without TLS). The secret must be random and long - ``secrets.token_urlsafe(24)``, 144
bits - which no offline guessing reaches; a word a person chose is not one
(docs/security.md).

``StoreTenant.derive(namespace, secret)`` makes one; ``StoreTenant.from_config`` falls back
on ``daskflow-kv.namespace`` / ``daskflow-kv.secret`` (``DASK_DASKFLOW_KV__SECRET``). With
no secret - an open scheduler, one trust domain - the tenant is ``OPEN_TENANT``: its own
directory (``v2/open``), no encryption, objects named by their block keys and checked by
their CRC32 only, as before tenancy existed. The runtime hands the tenant to workers inside each store task (the
write request, the load, the probe); its ``repr`` never shows the key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field

from .. import config
from ..errors import InvalidInputError

VERSION = "v2"  # the store layout these credentials are for; a new layout derives new ones
OPEN_PREFIX = "open"  # the open tenant's directory (an HMAC prefix is hex, so never "open")
PREFIX_RE = re.compile(r"^(open|[0-9a-f]{32})$")  # what a tenant directory may be called
_DIR_INFO = f"daskflow-kv/store/{VERSION}/tenant-dir|"  # HMAC message prefix of the directory name
_KEY_INFO = f"daskflow-kv/store/{VERSION}/aes-256-gcm|"  # HKDF info prefix of the object key
_NAMES_INFO = f"daskflow-kv/store/{VERSION}/object-names|"  # HKDF info prefix of the key naming objects
NAME_HEX = 32  # hex digits of an object's keyed name (128 bits)


@dataclass(frozen=True, slots=True)
class StoreTenant:
    """A tenant's view of a store: where its objects live and the key that seals them."""

    prefix: str  # its directory under v2/: "open", or 32 hex of HMAC(secret, namespace)
    key: bytes | None = field(default=None, repr=False)  # 32-byte AES-256-GCM key; None: open (unsealed)
    names: bytes | None = field(default=None, repr=False)  # 32-byte key of its objects' names; None: open

    def __post_init__(self):
        if not isinstance(self.prefix, str) or not PREFIX_RE.match(self.prefix):
            raise ValueError(f"not a store tenant directory: {self.prefix!r}")
        if (self.key is None) != (self.prefix == OPEN_PREFIX) or (self.names is None) != (self.key is None):
            raise ValueError("the open tenant has no keys, and every other tenant has both")
        for k in (self.key, self.names):
            if k is not None and (not isinstance(k, bytes) or len(k) != 32):
                raise ValueError("a store tenant's keys are 32 bytes")

    def object_name(self, block: str) -> str:
        """The file name of block ``block``'s object: a keyed hash of the key (the open tenant's
        objects are named by their keys, as before tenancy existed)."""
        if self.names is None:
            return block
        return hmac.new(self.names, block.encode(), hashlib.sha256).hexdigest()[:NAME_HEX]

    @property
    def sealed(self) -> bool:
        """Are this tenant's objects encrypted and authenticated (not the open tenant)?"""
        return self.key is not None

    @classmethod
    def derive(cls, namespace: str, secret: str | None) -> StoreTenant:
        """The tenant of ``namespace`` holding ``secret``; ``OPEN_TENANT`` without a secret."""
        if not isinstance(namespace, str):
            raise InvalidInputError(f"namespace must be a string, got {namespace!r}")
        if secret is None or secret == "":
            return OPEN_TENANT
        if not isinstance(secret, str):
            raise InvalidInputError("secret must be a string (daskflow-kv.secret)")
        from cryptography.hazmat.primitives.hashes import SHA256
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        raw = secret.encode()
        prefix = hmac.new(raw, (_DIR_INFO + namespace).encode(), hashlib.sha256).hexdigest()[:32]
        key = HKDF(algorithm=SHA256(), length=32, salt=None, info=(_KEY_INFO + namespace).encode()).derive(raw)
        names = HKDF(algorithm=SHA256(), length=32, salt=None, info=(_NAMES_INFO + namespace).encode()).derive(raw)
        return cls(prefix, key, names)

    @classmethod
    def from_config(cls, namespace: str | None = None, secret: str | None = None) -> StoreTenant:
        """``derive`` with ``daskflow-kv.namespace`` / ``daskflow-kv.secret`` for what is None."""
        return cls.derive(config.get("namespace", namespace), config.get("secret", secret))


OPEN_TENANT = StoreTenant(OPEN_PREFIX)  # no secret: one trust domain, unsealed objects
