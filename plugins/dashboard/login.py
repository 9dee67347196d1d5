"""Logging a browser in to the KV pages as a tenant: ``/kv/login``, ``/kv/login/challenge``, ``/kv/logout``.

``GET /kv/login`` serves a small form (namespace, secret) carrying a fresh challenge. Its
script computes the proof in the browser with SubtleCrypto (HMAC-SHA256 of the secret over
``daskflow-kv/login/v1|<namespace>|<nonce>``, ``tenants.login_proof``), taking a fresh
challenge from ``POST /kv/login/challenge`` when the page is old, and posts namespace, nonce
and proof: the secret field has no name, so the form never sends it. Where SubtleCrypto is
missing (plain HTTP from another host is not a secure context) or scripts are off, the page
shows the nonce and the command that prints the proof::

    python -m daskflow_kv.plugins.dashboard.login --namespace alice --nonce <nonce>

(the secret from ``daskflow-kv.secret`` / ``DASK_DASKFLOW_KV__SECRET``, else asked for).

``POST /kv/login`` checks the proof (``session.Challenges.verify``: single-use, expiring
nonces, the tenant registry's own check) and sets the signed login cookie: HttpOnly,
SameSite=Strict, Secure over HTTPS, path ``/kv``, lasting ``daskflow-kv.dashboard.session-ttl``.
A login posted from another site's page (an ``Origin`` that is not this host) is refused.
``/kv/logout`` revokes the cookie and clears it.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import urllib.parse

from daskflow_kv import config

from ..tenants import login_proof
from .access import tenants_configured
from .render import PAGE, render_login
from .request import KVHandler, nav
from .session import CHALLENGE_TTL, COOKIE

MAX_FIELD = 512  # longest namespace, nonce or proof accepted (a proof is 64 hex digits)


def session_ttl() -> float:
    """How long a browser's login lasts (``daskflow-kv.dashboard.session-ttl``)."""
    return config.get_seconds("dashboard.session-ttl")


class _LoginRoute(KVHandler):
    def registry(self):
        """The KV plugin's tenant registry when tenants are configured, else None."""
        plugin = self.kv_plugin()
        if plugin is None or not tenants_configured(plugin):
            return None
        return getattr(plugin, "tenants", None)

    def same_origin(self) -> bool:
        """A browser posting from a page of this host (or a client sending no Origin)."""
        origin = self.request.headers.get("Origin")
        return origin is None or urllib.parse.urlsplit(origin).netloc == self.request.host


class KVLoginHandler(_LoginRoute):
    def get(self):
        self.form()

    def form(self, message: str = "", status: int = 200) -> None:
        registry = self.registry()
        nonce = self.logins().challenges(registry).issue() if registry is not None else None
        if registry is not None and nonce is None:
            status, message = 429, f"Too many logins in progress; try again within {CHALLENGE_TTL:.0f} s."
        s = self.browser_session()
        self.set_status(status)
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(render_login({
            "prefix": self.prefix(), "nav": nav(self.server),
            "available": self.kv_plugin() is not None, "tenants": registry is not None,
            "nonce": nonce, "message": message, "ttl_s": session_ttl(), "challenge_ttl_s": CHALLENGE_TTL,
            "session": None if s is None else {"namespace": s.namespace, "role": s.role},
        }))

    def post(self):
        registry = self.registry()
        if registry is None:
            return self.form("No tenants are configured: every browser sees everything, no login needed.", 400)
        if not self.same_origin():
            return self.form("Login refused: posted from another site.", 403)
        namespace, nonce, proof = (self.get_body_argument(k, "")[:MAX_FIELD] for k in ("namespace", "nonce", "proof"))
        who = self.logins().challenges(registry).verify(namespace, nonce, proof)
        if who is None:  # one message for every failure, as the client login gives
            return self.form(f"Login to namespace {namespace!r} refused: unknown namespace, wrong secret or "
                             "expired or used challenge.", 403)
        ttl = session_ttl()
        value, _ = self.logins().cookies.issue(*who, ttl)
        self.set_cookie(COOKIE, value, path=self.cookie_path(), max_age=max(1, int(ttl)), httponly=True,
                        samesite="Strict", secure=self.request.protocol == "https")
        self.redirect(self.prefix() + PAGE, status=303)


class KVChallengeHandler(_LoginRoute):
    """A fresh nonce for the login form's script, as JSON (429 while too many are outstanding)."""

    def post(self):
        registry = self.registry()
        nonce = self.logins().challenges(registry).issue() if registry is not None else None
        if registry is None:
            self.set_status(404)
        elif nonce is None:
            self.set_status(429)
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"nonce": nonce, "ttl": CHALLENGE_TTL}))


class KVLogoutHandler(KVHandler):
    def get(self):
        s = self.browser_session()
        if s is not None:
            self.logins().cookies.revoke(s)
        self.clear_cookie(COOKIE, path=self.cookie_path(), httponly=True, samesite="Strict")
        self.redirect(self.prefix() + PAGE, status=303)

    post = get


# -- the proof, computed outside the browser ----------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Print the login proof for a nonce the login page shows (when the browser cannot compute it)."""
    ap = argparse.ArgumentParser(prog="python -m daskflow_kv.plugins.dashboard.login", description=main.__doc__)
    ap.add_argument("--namespace", required=True, help="the tenant to log in as")
    ap.add_argument("--nonce", required=True, help="the challenge the login page shows")
    args = ap.parse_args(argv)
    secret = config.get("secret") or getpass.getpass(f"secret of namespace {args.namespace!r}: ")
    if not secret:
        print("no secret: set daskflow-kv.secret (DASK_DASKFLOW_KV__SECRET) or type it", file=sys.stderr)
        return 2
    print(login_proof(secret, args.nonce.strip(), args.namespace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
