"""Who is calling the KV plugin: namespaces as authenticated tenants, with roles.

A tenant is a namespace plus a secret. The scheduler's dask.config lists them::

    daskflow-kv:
      tenants:
        alice: {secret: "...", role: user}
        ops:   {secret: "...", role: admin}

(from a YAML file or ``DASK_DASKFLOW_KV__TENANTS__ALICE__SECRET=...``; never in code). A
client proves it holds its namespace's secret by answering a fresh challenge with an HMAC
of it - the secret never crosses the wire - and receives a session token that it passes
on every call and puts in the annotations of the tasks it submits. Two users share cached
blocks only by sharing a namespace, which means holding its secret (like vLLM's
``cache_salt``).

With no tenants configured the scheduler is one trust domain ("open"): any client may
name any namespace and gets the admin role, as before tenancy existed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

ROLES = ("user", "admin")
_NONCE_TTL = 60.0  # seconds a challenge stays answerable


def login_proof(secret: str, nonce: str, namespace: str) -> str:
    """What a client sends to prove it holds ``namespace``'s secret (client and scheduler agree)."""
    msg = f"daskflow-kv/login/v1|{namespace}|{nonce}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


class AccessDenied(PermissionError):
    """A call the caller's session does not allow; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Session:
    token: str  # random, 128 bits: the caller's capability for this session
    namespace: str  # the tenant it acts for
    role: str  # user | admin
    client: str | None  # the Dask client id that logged in (sessions end with it)

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def sees(self, namespace: str | None) -> bool:
        """May this session see (or act on) something that belongs to ``namespace``?"""
        return self.is_admin or namespace == self.namespace


class TenantRegistry:
    def __init__(self, tenants: Mapping[str, Mapping] | None = None):
        self._tenants = {}  # namespace -> (secret, role)
        for name, spec in (tenants or {}).items():
            secret, role = (spec or {}).get("secret"), (spec or {}).get("role", "user")
            if not isinstance(secret, str) or not secret:
                raise ValueError(f"daskflow-kv.tenants.{name}: needs a non-empty secret")
            if role not in ROLES:
                raise ValueError(f"daskflow-kv.tenants.{name}: role must be one of {ROLES}, not {role!r}")
            self._tenants[str(name)] = (secret, role)
        self._nonces: dict[str, float] = {}  # nonce -> expiry
        self._sessions: dict[str, Session] = {}

    @property
    def open(self) -> bool:
        """No tenants configured: one trust domain, every session an admin."""
        return not self._tenants

    def challenge(self) -> str:
        now = time.time()
        self._nonces = {n: t for n, t in self._nonces.items() if t > now}
        nonce = secrets.token_hex(16)
        self._nonces[nonce] = now + _NONCE_TTL
        return nonce

    def login(self, namespace: str, nonce: str | None = None, proof: str | None = None,
              client: str | None = None) -> Session:
        """A session for ``namespace`` if ``proof`` answers ``nonce`` with its secret."""
        if self.open:
            role = "admin"
        else:
            expiry = self._nonces.pop(nonce, 0.0) if nonce else 0.0  # one answer per challenge
            known = self._tenants.get(namespace)
            expected = login_proof(known[0], nonce, namespace) if (known and expiry > time.time()) else None
            if expected is None or not isinstance(proof, str) or not hmac.compare_digest(expected, proof):
                # One message for every failure: an unknown namespace looks like a wrong secret.
                raise AccessDenied(f"login to namespace {namespace!r} refused: unknown namespace, wrong secret "
                                   "or expired challenge (set daskflow-kv.secret to the namespace's secret)")
            role = known[1]
        session = Session(secrets.token_hex(16), namespace, role, client)
        self._sessions[session.token] = session
        return session

    def session(self, token: str | None) -> Session:
        session = self._sessions.get(token) if isinstance(token, str) else None
        if session is None:
            raise AccessDenied("no valid daskflow-kv session: the runtime must log in first (KVRuntime does)")
        return session

    def find(self, token: str | None) -> Session | None:
        return self._sessions.get(token) if isinstance(token, str) else None

    def end_client(self, client: str) -> int:
        """Drop the sessions of a Dask client that disconnected. -> how many."""
        gone = [t for t, s in self._sessions.items() if s.client == client]
        for t in gone:
            del self._sessions[t]
        return len(gone)

    def __len__(self) -> int:
        return len(self._sessions)
