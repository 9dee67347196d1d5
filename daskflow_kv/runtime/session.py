"""A client logs in to the KV scheduler plugin as its tenant (see ``plugins/tenants.py``).

The namespace and its secret come from arguments or ``dask.config`` (``daskflow-kv.namespace``,
``daskflow-kv.secret``; e.g. ``DASK_DASKFLOW_KV__SECRET``). The secret never leaves this
process: the login answers the scheduler's challenge with an HMAC of it, and block keys are
seeded with another HMAC of it (``state.blocks.keyed_digest``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import config
from ..plugins.tenants import login_proof


@dataclass(frozen=True, slots=True)
class KVSession:
    token: str  # passed on every kv_* call and in the annotations of submitted KV tasks
    namespace: str
    role: str  # user | admin
    open: bool  # the scheduler has no tenants configured (one trust domain)


def login(client, namespace: str | None = None, secret: str | None = None) -> KVSession:
    namespace = config.get("namespace", namespace)
    secret = config.get("secret", secret)
    nonce = client.sync(client.scheduler.kv_challenge)
    proof = login_proof(secret, nonce, namespace) if secret else None
    ans = client.sync(client.scheduler.kv_login, namespace=namespace, nonce=nonce, proof=proof, client=client.id)
    return KVSession(ans["session"], ans["namespace"], ans["role"], ans["open"])
