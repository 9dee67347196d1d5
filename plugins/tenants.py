"""Who is calling the KV plugin: namespaces as authenticated tenants, with roles and quotas.

A tenant is a namespace plus a secret. The scheduler's dask.config lists them::

    daskflow-kv:
      tenants:
        alice: {secret: "...", role: user, quota: 2GiB}
        ops:   {secret: "...", role: admin}

(from a YAML file or ``DASK_DASKFLOW_KV__TENANTS__ALICE__SECRET=...``; never in code).
``quota``: KV bytes per worker guaranteed to the tenant's blocks (see ``kv_budget``); a
tenant without one is guaranteed a fair share (``Quotas``), ``quota: 0`` for none. A
secret must be random and long (``MIN_SECRET_CHARS``, e.g. ``secrets.token_urlsafe(24)``):
block keys on Dask's pages, a login seen on a wire without TLS and the store's names all
let a guess be checked offline, at the speed of one HMAC.

Logging in binds a session to the Dask client the scheduler itself sees: the client asks
for a challenge (``kv_challenge``), sends it back over its own batched stream (``BIND_OP``,
a stream handler: Dask runs it on the task that serves that client's connection, and below
the ``add_client`` call that registered it - the client id is read from there,
``dask_internals.stream_client``, never from the message, which can name any client),
then answers it with an HMAC of its secret (``kv_login``; the secret never crosses the
wire). The session holds that connection: the tasks the client submits over it are the
session's (the plugin finds a task's session by the connection its graph came on, never by
a token in the graph), and the session ends when the connection does. A session expires
after ``session-ttl`` without use; a client holds at most ``MAX_SESSIONS_PER_CLIENT`` (only
its own logins count: no login binds another client); challenges are few
(``MAX_PENDING_NONCES``) and short-lived (``NONCE_TTL``). An admin's call that changes what
every tenant keeps needs more than the session's token: a fresh challenge sent back on the
admin's own stream (``admin``). Two users share cached blocks only by sharing a namespace,
which means holding its secret (like vLLM's ``cache_salt``).

With no tenants configured the scheduler is one trust domain ("open"): any client may
name any namespace and gets the admin role, as before tenancy existed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from daskflow_kv import dask_internals as di
from daskflow_kv import validation
from daskflow_kv.keys import namespace_tag, tag_of

logger = logging.getLogger("daskflow_kv.scheduler")

ROLES = ("user", "admin")
NONCE_TTL = 60.0  # s a challenge stays answerable
MAX_PENDING_NONCES = 1024  # challenges not answered yet; the oldest goes first
MAX_SESSIONS_PER_CLIENT = 16  # live sessions one Dask client may hold; its oldest ends first
BIND_WAIT = 10.0  # s a login waits for its challenge to arrive on the client's stream
MIN_SECRET_CHARS = 24  # below this a secret is logged as weak at start (24 URL-safe characters: 144 bits)


def login_proof(secret: str, nonce: str, namespace: str) -> str:
    """What a client sends to prove it holds ``namespace``'s secret (client and scheduler agree)."""
    msg = f"daskflow-kv/login/v1|{namespace}|{nonce}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


class AccessDenied(PermissionError):
    """A call the caller's session does not allow; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Tenant:
    secret: str  # proves the namespace (HMAC of a challenge); seeds its block keys client-side
    role: str  # user | admin
    quota: int | None  # KV bytes per worker no other tenant's task may evict it below (0: none; None: a fair share)


@dataclass(slots=True, eq=False)
class Session:
    token: str  # random, 128 bits: the caller's capability for this session's RPCs
    namespace: str  # the tenant it acts for
    role: str  # user | admin
    client: str  # the Dask client id it was bound with (its keys are wanted for that client)
    connection: object  # the client's stream as the scheduler serves it (dask_internals.current_connection)
    expires: float = 0.0  # time.monotonic() after which it is gone unless used again

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def tag(self) -> str:
        return namespace_tag(self.namespace)

    def sees(self, namespace: str | None) -> bool:
        """May this session see (or act on) something that belongs to ``namespace``?"""
        return self.is_admin or namespace == self.namespace


@dataclass(slots=True, eq=False)
class Challenge:
    expires: float  # time.monotonic() after which it cannot be answered
    bound: asyncio.Event = field(default_factory=asyncio.Event)  # set when it came back on a client stream
    client: str | None = None  # the client id that stream serves
    connection: object = None  # that stream


def _tenant(name, spec) -> Tenant:
    spec = spec or {}
    secret, role = spec.get("secret"), spec.get("role", "user")
    if not isinstance(secret, str) or not secret:
        raise ValueError(f"daskflow-kv.tenants.{name}: needs a non-empty secret")
    if role not in ROLES:
        raise ValueError(f"daskflow-kv.tenants.{name}: role must be one of {ROLES}, not {role!r}")
    quota = spec.get("quota")
    quota = None if quota is None else validation.byte_size(f"daskflow-kv.tenants.{name}.quota", quota, minimum=0)
    if len(secret) < MIN_SECRET_CHARS:
        logger.warning("daskflow-kv.tenants.%s: a secret of %d characters can be guessed offline; use a random one "
                       "of %d or more (secrets.token_urlsafe(24))", name, len(secret), MIN_SECRET_CHARS)
    return Tenant(secret, role, quota)


class Quotas(Mapping):
    """Namespace -> KV bytes per worker guaranteed to it, as the budget reads them now: each
    tenant's configured quota, and for a tenant without one a fair share - what the budget
    leaves beside the configured quotas, split evenly among those without one. Without that
    default, one tenant pinning blocks under a small budget makes another's next prefill
    wait for room it never gets (and be preempted); ``quota: 0`` opts a tenant out."""

    __slots__ = ("_tenants", "_budget", "_at", "_now")

    def __init__(self, tenants: Mapping[str, Tenant], budget: Callable[[], int | None]):
        self._tenants = tenants  # name -> Tenant (configured at start)
        self._budget = budget  # the KV budget now (the admin may change it)
        self._at: int | None = -1  # the budget ``_now`` was computed for
        self._now: dict[str, int] = {}

    def _current(self) -> dict[str, int]:
        budget = self._budget()
        if budget != self._at:
            given = {n: t.quota for n, t in self._tenants.items() if t.quota}
            unset = [n for n, t in self._tenants.items() if t.quota is None]
            share = max(0, (budget or 0) - sum(given.values())) // max(1, len(unset))
            self._now = {**given, **(dict.fromkeys(unset, share) if share else {})}
            self._at = budget
        return self._now

    def __getitem__(self, namespace: str) -> int:
        return self._current()[namespace]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())


class TenantRegistry:
    def __init__(self, tenants: Mapping[str, Mapping] | None = None, session_ttl: float = 3600.0):
        self._tenants: dict[str, Tenant] = {str(n): _tenant(n, spec) for n, spec in (tenants or {}).items()}
        self._tags: dict[str, str] = {}  # namespace tag -> namespace (configured; open: those logged in)
        for name in self._tenants:
            other = self._tags.setdefault(namespace_tag(name), name)
            if other != name:
                raise ValueError(f"daskflow-kv.tenants: {other!r} and {name!r} have the same key tag; rename one")
        self._session_ttl = float(session_ttl)  # s a session lives without use
        self._challenges: OrderedDict[str, Challenge] = OrderedDict()  # nonce -> challenge, oldest first
        self._sessions: dict[str, Session] = {}  # token -> session

    @property
    def open(self) -> bool:
        """No tenants configured: one trust domain, every session an admin."""
        return not self._tenants

    def namespace_of_tag(self, tag: str | None) -> str | None:
        """The namespace whose keys carry ``tag`` (None: no tenant's)."""
        return None if tag is None else self._tags.get(tag)

    def namespace_of_key(self, key) -> str | None:
        return self.namespace_of_tag(tag_of(key))

    def quotas(self, budget: Callable[[], int | None] = lambda: None) -> Quotas:
        """Namespace -> KV bytes per worker guaranteed to it, under the budget ``budget()`` says
        (a fair share for a tenant without a quota; see ``Quotas``)."""
        return Quotas(self._tenants, budget)

    # -- logging in -------------------------------------------------------------------------------
    def challenge(self) -> str:
        now = time.monotonic()
        while self._challenges and (len(self._challenges) >= MAX_PENDING_NONCES
                                    or next(iter(self._challenges.values())).expires <= now):
            self._challenges.popitem(last=False)  # expired, or the oldest when full
        nonce = secrets.token_hex(16)
        self._challenges[nonce] = Challenge(now + NONCE_TTL)
        return nonce

    def bind(self, nonce, client, connection) -> bool:
        """The challenge ``nonce`` came back on ``connection``, the stream of ``client`` (both as
        the scheduler serves it: ``dask_internals.stream_client``, never a name the message
        gave). Only once."""
        c = self._challenges.get(nonce) if isinstance(nonce, str) else None
        if c is None or c.bound.is_set() or c.expires <= time.monotonic() or not isinstance(client, str):
            return False
        c.client, c.connection = client, connection
        c.bound.set()
        return True

    def _verify(self, namespace, nonce, proof) -> tuple[str, Challenge]:
        """(role, challenge) when ``proof`` answers the unexpired challenge ``nonce`` with
        ``namespace``'s secret (open: anyone, as admin); the challenge is used up either way."""
        c = self._challenges.pop(nonce, None) if isinstance(nonce, str) else None  # one answer per challenge
        if not isinstance(namespace, str):
            raise AccessDenied(f"login refused: a namespace is a string, not {namespace!r}")
        if self.open:
            if c is None or c.expires <= time.monotonic():
                raise AccessDenied("login refused: the challenge expired or was answered already")
            self._tags.setdefault(namespace_tag(namespace), namespace)
            return "admin", c
        known = self._tenants.get(namespace)
        live = c is not None and c.expires > time.monotonic()
        expected = login_proof(known.secret, nonce, namespace) if (known and live) else None
        if expected is None or not isinstance(proof, str) or not hmac.compare_digest(expected, proof):
            # One message for every failure: an unknown namespace looks like a wrong secret.
            raise AccessDenied(f"login to namespace {namespace!r} refused: unknown namespace, wrong secret "
                               "or expired challenge (set daskflow-kv.secret to the namespace's secret)")
        return known.role, c

    def login(self, namespace: str, nonce: str | None = None, proof: str | None = None,
              client: str | None = None) -> Session:
        """Check a proof only (the dashboard's browser logins): the session it returns is bound to
        no client stream, so no ``kv_*`` call accepts it; end it with ``end_client(client)``."""
        role, _ = self._verify(namespace, nonce, proof)
        return self._add(Session(secrets.token_hex(16), namespace, role, client or "", None,
                                 time.monotonic() + self._session_ttl))

    async def _bound(self, nonce) -> None:
        """Until the challenge ``nonce`` came back on a stream (its RPC can overtake it), at most
        ``BIND_WAIT`` s."""
        c = self._challenges.get(nonce) if isinstance(nonce, str) else None
        if c is not None and not c.bound.is_set():
            try:
                await asyncio.wait_for(c.bound.wait(), max(0.0, min(BIND_WAIT, c.expires - time.monotonic())))
            except asyncio.TimeoutError:
                pass

    async def login_client(self, namespace: str, nonce: str | None = None, proof: str | None = None) -> Session:
        """``kv_login``: a session for ``namespace`` if ``proof`` answers ``nonce`` with its secret
        and the nonce came back on a client's stream (``bind``), the client it is bound to."""
        await self._bound(nonce)
        role, c = self._verify(namespace, nonce, proof)
        if not c.bound.is_set() or not di.connection_open(c.connection):
            raise AccessDenied("login refused: the challenge never came back on this client's own stream "
                               "(log in with daskflow_kv.runtime.session.login)")
        return self._add(Session(secrets.token_hex(16), namespace, role, c.client, c.connection,
                                 time.monotonic() + self._session_ttl))

    async def admin(self, token: str | None, confirm: str | None, what: str) -> Session:
        """The admin session ``token`` names, for a call that changes what every tenant keeps:
        with tenants configured, ``confirm`` must be a fresh challenge that came back on that
        session's own stream (the token alone is a bearer credential any client could replay).
        An open scheduler is one trust domain: every session is an admin."""
        s = self.session(token)
        if not s.is_admin:
            raise AccessDenied(f"{what} changes what every tenant keeps: it needs the admin role "
                               f"(namespace {s.namespace!r} has the user role)")
        if self.open:
            return s
        await self._bound(confirm)
        c = self._challenges.pop(confirm, None) if isinstance(confirm, str) else None
        if c is None or not c.bound.is_set() or c.expires <= time.monotonic() or c.connection is not s.connection:
            raise AccessDenied(f"{what} refused: an admin call is confirmed by a fresh challenge sent back on the "
                               "admin client's own stream, and this one was not (a session token alone is not enough)")
        return s

    def _add(self, session: Session) -> Session:
        """Keep ``session``; a client's oldest sessions end past ``MAX_SESSIONS_PER_CLIENT``."""
        mine = [s for s in self._sessions.values() if s.client == session.client]
        for old in sorted(mine, key=lambda s: s.expires)[: max(0, len(mine) + 1 - MAX_SESSIONS_PER_CLIENT)]:
            self._sessions.pop(old.token, None)
        self._sessions[session.token] = session
        return session

    # -- sessions ---------------------------------------------------------------------------------
    def _live(self, session: Session | None, now: float) -> bool:
        if session is None:
            return False
        if session.expires > now and di.connection_open(session.connection):
            return True
        self._sessions.pop(session.token, None)
        return False

    def session(self, token: str | None) -> Session:
        """The live session ``token`` names (its life is extended), or AccessDenied."""
        now = time.monotonic()
        session = self._sessions.get(token) if isinstance(token, str) else None
        if not self._live(session, now):
            raise AccessDenied("no valid daskflow-kv session: the runtime must log in first (KVRuntime does), "
                               "and a session ends with its client or after daskflow-kv.scheduler.session-ttl unused")
        session.expires = now + self._session_ttl
        return session

    def on_connection(self, connection) -> list[Session]:
        """The live sessions bound to ``connection`` (the client stream a graph came on)."""
        now = time.monotonic()
        return [s for s in list(self._sessions.values()) if s.connection is connection and self._live(s, now)]

    def session_for(self, connection, key) -> Session | None:
        """The session on ``connection`` whose namespace owns ``key`` (its tag), refreshed; None
        if none does. An untagged key is nobody's."""
        tag = tag_of(key)
        for s in self.on_connection(connection):
            if tag is not None and s.tag == tag:
                s.expires = time.monotonic() + self._session_ttl
                return s
        return None

    def sessions_of(self, client: str) -> int:
        """How many sessions ``client`` holds."""
        return sum(1 for s in self._sessions.values() if s.client == client)

    def end_client(self, client: str) -> int:
        """Drop the sessions of a Dask client that disconnected. -> how many."""
        gone = [t for t, s in self._sessions.items() if s.client == client]
        for t in gone:
            del self._sessions[t]
        return len(gone)

    def __len__(self) -> int:
        return len(self._sessions)
