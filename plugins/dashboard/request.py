"""What every KV route knows about its request: the dashboard's URL prefix, the login cookie,
and so who is looking (``access.Viewer``).

Every response of the KV routes depends on the cookie and is never cached (``no-store``,
``Vary: Cookie``): a shared cache must not hand one tenant's page to another browser.
"""

from __future__ import annotations

from distributed.http.utils import RequestHandler

from daskflow_kv import dask_internals as di

from . import access
from .metrics import kv_plugin
from .render import PAGE
from .session import COOKIE, BrowserSession, Logins


def nav(scheduler) -> list[tuple[str, str]]:
    """Dask's navigation bar entries (when its Bokeh dashboard runs), then Info and KV."""
    tv = di.dashboard_template_variables(scheduler)
    # no Bokeh: Dask serves only the HTML info pages
    pages = [p for p in tv["pages"] if p != PAGE] if tv is not None else ["info"]
    return [(p, p.title()) for p in pages] + [(PAGE, "KV")]


class KVHandler(RequestHandler):
    """A KV route: ``extra`` carries the dashboard's ``prefix`` and its ``logins``."""

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.set_header("Vary", "Cookie")

    def prefix(self) -> str:
        return self.extra.get("prefix", "/")

    def logins(self) -> Logins:
        return self.extra["logins"]

    def kv_plugin(self):
        return kv_plugin(self.server)

    def browser_session(self) -> BrowserSession | None:
        """The login the cookie proves; None when it is missing, forged, tampered, expired or revoked."""
        return self.logins().cookies.read(self.get_cookie(COOKIE))

    def viewer(self) -> access.Viewer:
        return access.viewer(self.kv_plugin(), self.browser_session())

    def cookie_path(self) -> str:
        return self.prefix() + PAGE  # the KV routes only, not Dask's pages
