"""A client logs in to the KV scheduler plugin as its tenant (see ``plugins/tenants.py``).

The namespace and its secret come from arguments or ``dask.config`` (``daskflow-kv.namespace``,
``daskflow-kv.secret``; e.g. ``DASK_DASKFLOW_KV__SECRET``). The secret never leaves this
process: the login answers the scheduler's challenge with an HMAC of it, and block keys are
seeded with another HMAC of it (``state.blocks.keyed_digest``). The challenge also goes back
to the scheduler on this client's own stream, which binds the session to this client: the
tasks it submits are the session's, and the session ends when the client does. An admin's
calls that change what every tenant keeps send a fresh challenge the same way first
(``confirmation``).

A secret given to a scheduler with no tenants would make this client an admin of one
shared trust domain without a word: that is an error (``OpenSchedulerError``) unless
``daskflow-kv.open-scheduler`` is ``warn``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .. import config
from ..dask_internals import send_on_stream
from ..errors import OpenSchedulerError
from ..keys import BIND_OP
from ..plugins.tenants import login_proof

OPEN_SCHEDULER = ("error", "warn")  # what a secret on a scheduler with no tenants does


@dataclass(frozen=True, slots=True)
class KVSession:
    token: str  # passed on every kv_* call (never in a task: the plugin knows this client's tasks)
    namespace: str
    role: str  # user | admin
    open: bool  # the scheduler has no tenants configured (one trust domain)


async def stream_challenge(client) -> str:
    """A fresh challenge of the scheduler's, sent back on ``client``'s own stream: answered, it
    binds a login to this client; passed as ``confirm``, it shows an admin call comes from the
    client the admin session is bound to (a token alone could be replayed by any client)."""
    nonce = await client.scheduler.kv_challenge()
    send_on_stream(client, {"op": BIND_OP, "nonce": nonce})
    return nonce


def confirmation(client) -> str:
    """``stream_challenge`` for a synchronous client: the ``confirm`` of one admin call."""
    return client.sync(stream_challenge, client)


async def login_async(client, namespace: str, secret: str | None) -> KVSession:
    """Log ``client`` (asynchronous, or on its loop) in as ``namespace``."""
    nonce = await stream_challenge(client)  # binds the session to this client's stream
    proof = login_proof(secret, nonce, namespace) if secret else None
    ans = await client.scheduler.kv_login(namespace=namespace, nonce=nonce, proof=proof)
    return KVSession(ans["session"], ans["namespace"], ans["role"], ans["open"])


def login(client, namespace: str | None = None, secret: str | None = None) -> KVSession:
    namespace = config.get("namespace", namespace)
    secret = config.get("secret", secret)
    policy = config.get("open-scheduler")
    if policy not in OPEN_SCHEDULER:
        raise OpenSchedulerError(f"daskflow-kv.open-scheduler must be one of {OPEN_SCHEDULER}, not {policy!r}")
    session = client.sync(login_async, client, namespace, secret)
    if session.open and secret:
        msg = (f"the scheduler has no tenants configured, so namespace {namespace!r} is not authenticated and this "
               "client is an admin of one shared trust domain; configure daskflow-kv.tenants on the scheduler, "
               "drop daskflow-kv.secret, or set daskflow-kv.open-scheduler: warn")
        if policy == "error":
            raise OpenSchedulerError(msg)
        warnings.warn(msg, stacklevel=3)
    return session
