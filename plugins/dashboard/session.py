"""Browser logins to the KV pages: challenges, and the signed cookie a login sets.

A browser logs in as a tenant the way a client does (``tenants.login_proof``): it asks for a
challenge nonce and answers with an HMAC of the namespace's secret over it; the secret never
crosses the wire. ``Challenges`` hands out the tenant registry's nonces, each answerable
once, for ``CHALLENGE_TTL`` seconds, at most ``MAX_CHALLENGES`` outstanding (a bounded
table, however many browsers ask). The registry checks the answer, so a browser and a
client are held to one rule.

A successful login sets a cookie ``SessionCookies`` signs with a key only this scheduler
process holds (random per dashboard plugin: a restart logs every browser out), naming the
namespace, its role and an expiry (``daskflow-kv.dashboard.session-ttl``). A cookie that is
forged, tampered with, expired or logged out reads as no session at all: anonymous.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from ..tenants import AccessDenied

COOKIE = "daskflow_kv_session"  # the cookie's name
CHALLENGE_TTL = 60.0  # seconds a login challenge stays answerable (the registry's own limit too)
MAX_CHALLENGES = 64  # challenges outstanding at once; more wait until some are answered or expire
_SIGNED = b"daskflow-kv/dashboard-session/v1|"  # what the cookie's MAC covers, before the payload
_ROLES = ("user", "admin")


@dataclass(frozen=True, slots=True)
class BrowserSession:
    namespace: str  # the tenant the browser logged in as
    role: str  # user | admin (from the tenant registry at login)
    expires: float  # unix time the cookie stops being accepted
    sid: str  # random id, so that a logout can revoke this cookie before it expires


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


class SessionCookies:
    """Issues and reads the login cookie: ``<payload>.<HMAC-SHA256 of it>``, both base64url."""

    __slots__ = ("_key", "_revoked")

    def __init__(self, key: bytes | None = None):
        self._key = key or secrets.token_bytes(32)  # never leaves the process
        self._revoked: dict[str, float] = {}  # sid -> expiry, of cookies logged out early

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self._key, _SIGNED + payload.encode(), hashlib.sha256).digest())

    def issue(self, namespace: str, role: str, ttl: float, now: float | None = None) -> tuple[str, BrowserSession]:
        """The cookie value for a login of ``namespace`` (``role``) lasting ``ttl`` seconds."""
        s = BrowserSession(namespace, role, (time.time() if now is None else now) + ttl, secrets.token_hex(16))
        payload = _b64(json.dumps([s.namespace, s.role, s.expires, s.sid]).encode())
        return f"{payload}.{self._mac(payload)}", s

    def read(self, value: str | None, now: float | None = None) -> BrowserSession | None:
        """The session a cookie names, or None when it is missing, forged, tampered, expired or revoked."""
        now = time.time() if now is None else now
        payload, _, mac = (value or "").partition(".")
        if not payload or not mac or not hmac.compare_digest(mac, self._mac(payload)):
            return None
        try:
            namespace, role, expires, sid = json.loads(_unb64(payload))
            s = BrowserSession(str(namespace), str(role), float(expires), str(sid))
        except (ValueError, TypeError):  # signed by us, so only a format change gets here
            return None
        if s.expires <= now or s.role not in _ROLES or s.sid in self._revoked:
            return None
        return s

    def revoke(self, s: BrowserSession, now: float | None = None) -> None:
        """Log ``s`` out: its cookie reads as no session from now on (kept until it would expire)."""
        now = time.time() if now is None else now
        self._revoked = {sid: t for sid, t in self._revoked.items() if t > now}
        self._revoked[s.sid] = s.expires


class Challenges:
    """Login challenges for browsers: single use, expiring, bounded in number.

    The nonces are the tenant registry's (``registry.challenge()``), so its ``login`` checks
    the answer; this table bounds how many a browser can have outstanding.
    """

    __slots__ = ("registry", "_issued", "_limit", "_ttl")

    def __init__(self, registry, limit: int = MAX_CHALLENGES, ttl: float = CHALLENGE_TTL):
        self.registry = registry  # the KV plugin's TenantRegistry: nonces and the proof check
        self._issued: dict[str, float] = {}  # nonce -> expiry, outstanding
        self._limit = limit  # most outstanding at once
        self._ttl = ttl  # seconds each stays answerable

    def _prune(self, now: float) -> None:
        self._issued = {n: t for n, t in self._issued.items() if t > now}

    def issue(self, now: float | None = None) -> str | None:
        """A fresh nonce, or None while ``limit`` are outstanding."""
        now = time.time() if now is None else now
        self._prune(now)
        if len(self._issued) >= self._limit:
            return None
        nonce = self.registry.challenge()
        self._issued[nonce] = now + self._ttl
        return nonce

    def take(self, nonce: str | None, now: float | None = None) -> bool:
        """Use ``nonce`` up: True once, for a nonce issued here and not expired."""
        expiry = self._issued.pop(nonce, 0.0) if isinstance(nonce, str) else 0.0
        return expiry > (time.time() if now is None else now)

    def verify(self, namespace: str, nonce: str, proof: str) -> tuple[str, str] | None:
        """(namespace, role) when ``proof`` answers ``nonce`` (issued here, unused, unexpired)
        with ``namespace``'s secret, else None.

        The registry checks the proof (its ``login``); the session it creates for that ends
        at once (the browser's session is the cookie), so logins leave nothing behind in it.
        """
        if not self.take(nonce):
            return None
        marker = f"daskflow-kv-dashboard-{secrets.token_hex(8)}"  # a client id no Dask client has
        try:
            s = self.registry.login(namespace, nonce, proof, client=marker)
        except AccessDenied:
            return None
        finally:
            self.registry.end_client(marker)
        return s.namespace, s.role

    def __len__(self) -> int:
        return len(self._issued)


class Logins:
    """One dashboard's login state: its cookie key and the challenges of the KV plugin's registry."""

    __slots__ = ("cookies", "_challenges")

    def __init__(self):
        self.cookies = SessionCookies()  # signs and reads this dashboard's login cookies
        self._challenges: Challenges | None = None  # for the registry of the KV plugin loaded now

    def challenges(self, registry) -> Challenges:
        """The challenges of ``registry`` (a new table when the KV plugin was replaced)."""
        if self._challenges is None or self._challenges.registry is not registry:
            self._challenges = Challenges(registry)
        return self._challenges
