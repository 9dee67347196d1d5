"""The KV page of the Dask dashboard, its JSON and Arrow endpoints, and KV Prometheus metrics.

``KVDashboardPlugin`` is a scheduler plugin that adds routes to the scheduler's HTTP
server (the one serving Dask's dashboard and ``/metrics``):

* ``/kv``: one HTML page (no external scripts, styles or fonts): live Bokeh plots of
  workflows per minute, TTFT p50/p95, hit rate, batch size and KV bytes per worker; KV bytes
  per worker against the budget; the running counters (tokens reused vs computed, reuse
  ratio, bytes transferred, transfers vs recomputes, evictions); the lineage of the states
  (materialize -> fork -> transfer -> resume -> evict) as an SVG graph, ``?state=ID``
  narrowing it to one state's ancestors and descendants; every state with its blocks,
  token ranges, refcounts, lifecycle status and worker; the cost model's recent decisions
  with their numbers; recent lifecycle events. A few lines of script refresh it every
  ``daskflow-kv.dashboard.refresh`` (2 s by default). Its markup is in ``templates/``.
* ``/kv/api.json``: the same data as JSON (``?html=1`` adds the page's rendered sections and
  the live plots' columns).
* ``/kv/static/...``: BokehJS from the installed bokeh, for the live plots (``plots``).
* ``/kv/catalog.arrow`` (Arrow IPC stream) and ``/kv/catalog.parquet``: the catalog table.
* ``/kv/login``, ``/kv/login/challenge``, ``/kv/logout``: a browser's login as a tenant
  (``login``).
* ``/metrics``: Dask's handler, with the KV metrics of ``kv_metrics`` added for the
  scheduler it serves (namespaces only with ``daskflow-kv.dashboard.tenant-labels``).

With tenants configured, what each route shows depends on who asks (``access``): a browser
that has not logged in gets totals only; a tenant that logged in, its own namespace's
detail; the admin role, every namespace's. Keys are cut short. With no tenants, everyone
sees everything.

With tenants configured, Dask's own pages that list full keys (``/info/worker/<addr>.html``
lists every key a worker holds, ``/info/task/...``, call stacks and the exceptions page
name them too) answer 403 unless ``daskflow-kv.dashboard.dask-key-pages`` is ``show``: a
full block key fetches its K/V from any Dask client while it is cached. Dask's Bokeh pages
(the task stream, the graph) also send task keys to the browser and cannot be filtered:
docs/security.md says how to turn them off.

"KV" is added to the dashboard's navigation bar (and its "More..." menu), next to Dask's
own pages, when the Bokeh dashboard runs; the routes are listed in ``/sitemap.json`` too.

The numbers come from the KV scheduler plugin (``scheduler.plugins["daskflow-kv"]``)
through its operator views (``operator_counters``, ``operator_catalog``, ``operator_events``:
block keys cut short when tenants are configured, since a full key fetches K/V) and, where
present, its catalog's states; the page shows "not loaded" until that plugin is there.

Load with ``client.register_plugin(KVDashboardPlugin())`` or
``dask scheduler --preload daskflow_kv.plugins.dashboard``.
"""

from __future__ import annotations

import io
import json
import logging

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web
from tornado.routing import PathMatches

from daskflow_kv import config
from daskflow_kv import dask_internals as di

from . import access, plots
from . import metrics as kv_metrics
from .data import collect
from .login import KVChallengeHandler, KVLoginHandler, KVLogoutHandler
from .metrics import kv_plugin, read_catalog
from .render import PAGE, plot_columns, render_page, render_sections
from .request import KVHandler, nav
from .session import Logins

logger = logging.getLogger("daskflow_kv.dashboard")

PLUGIN_NAME = "daskflow-kv-dashboard"


class KVPageHandler(KVHandler):
    def get(self):
        d = collect(self.server, self.get_argument("state", None) or None, self.viewer())
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(render_page(d, self.prefix(), nav(self.server)))


class KVApiHandler(KVHandler):
    def get(self):
        d = collect(self.server, self.get_argument("state", None) or None, self.viewer())
        if self.get_argument("html", None):
            d["html"] = render_sections(d)
            d["plots"] = plot_columns(d)
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(d, default=str))


def catalog_table(scheduler, viewer: access.Viewer | None = None):
    """The KV catalog of ``scheduler`` as ``viewer`` may see it, a pyarrow Table.

    Everything with no tenants configured; a logged-in tenant's own rows (an admin's: all),
    keys cut short; for anonymous, only block counts and bytes by status and tier
    (``access.totals_table``). Empty, with the schema, while the KV plugin is not loaded.
    """
    from daskflow_kv.state.catalog import rows_to_arrow

    plugin = kv_plugin(scheduler)
    v = access.viewer(plugin) if viewer is None else viewer
    if plugin is None:
        return rows_to_arrow([])
    if not v.detail:
        return access.totals_table(read_catalog(plugin))
    if not v.tenants and hasattr(plugin, "catalog_table"):
        try:
            return plugin.catalog_table()
        except Exception:  # a plugin mid-refactor: build the table from the rows
            logger.exception("daskflow-kv: catalog_table failed; building it from the rows")
    rows = access.cut_rows(read_catalog(plugin), v)
    return rows_to_arrow([r for r in rows if v.sees(r.get("namespace"))])


class KVArrowHandler(KVHandler):
    def get(self):
        import pyarrow as pa

        table = catalog_table(self.server, self.viewer())
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        self.set_header("Content-Type", "application/vnd.apache.arrow.stream")
        self.set_header("Content-Disposition", 'attachment; filename="kv-catalog.arrow"')
        self.write(sink.getvalue().to_pybytes())


class KVParquetHandler(KVHandler):
    def get(self):
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(catalog_table(self.server, self.viewer()), buf)
        self.set_header("Content-Type", "application/vnd.apache.parquet")
        self.set_header("Content-Disposition", 'attachment; filename="kv-catalog.parquet"')
        self.write(buf.getvalue())


# Dask's own pages that list full task keys (distributed.http.scheduler.info's routes).
DASK_KEY_PAGES = (r"info/worker/(.*)\.html", r"info/task/(.*)\.html", r"info/call-stacks?/(.*)\.html",
                  r"info/main/exceptions\.html")


class DaskKeyPageRefused(web.RequestHandler):
    """One of Dask's pages that list full keys, with tenants configured: refused, in one line."""

    def get(self, *args):
        self.set_status(403)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.write("403: this Dask page lists full task keys, and a full KV key fetches a tenant's K/V; it is off "
                   "while daskflow-kv tenants are configured (daskflow-kv.dashboard.dask-key-pages: show turns it "
                   "on)\n")


def _http_prefix(scheduler) -> str:
    """The dashboard's URL prefix (Scheduler(http_prefix=...)), read off its /metrics route."""
    app = getattr(scheduler, "http_application", None)
    for router in (getattr(app, "wildcard_router", None), getattr(app, "default_router", None)):
        for rule in getattr(router, "rules", []):
            m = rule.matcher
            if isinstance(m, PathMatches) and m.regex.pattern.rstrip("$").endswith("/metrics"):
                return m.regex.pattern.rstrip("$")[: -len("metrics")]
    return "/"


def _add_to_navbar(scheduler) -> bool:
    """Add KV to the Bokeh dashboard's navigation bar and "More..." menu (when it runs).

    Dask builds both from its template variables (``dask_internals.dashboard_template_variables``),
    memoized per scheduler; its lists are shared with the pages' templates, so an entry
    appended here shows on every dashboard page rendered afterwards.
    """
    tv = di.dashboard_template_variables(scheduler)
    if tv is None:  # no Bokeh dashboard: nothing to add to
        return False
    pages, plots = tv.get("pages"), tv.get("plots")
    if isinstance(pages, list) and PAGE not in pages:
        pages.insert(pages.index("info") + 1 if "info" in pages else len(pages), PAGE)
    if isinstance(plots, list) and not any(isinstance(p, dict) and p.get("url") == PAGE for p in plots):
        plots.append({"url": PAGE, "name": "KV Cache"})
        plots.sort(key=lambda p: p.get("name", ""))
    return True


class KVDashboardPlugin(SchedulerPlugin):
    """Adds the KV page, its JSON/Arrow/Parquet endpoints and KV Prometheus metrics."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, metrics: bool = True):
        self.metrics = metrics  # report the KV metrics under /metrics
        self.scheduler = None
        self.logins: Logins | None = None  # browsers' logins: cookie key and challenges (made in start)
        self._rule = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        # Made here, in the scheduler's process: a key made in __init__ would be pickled by the
        # client that registers the plugin, which could then sign its own cookies.
        self.logins = Logins()
        app = getattr(scheduler, "http_application", None)
        if app is None:  # a scheduler started without its HTTP server
            logger.info("daskflow-kv dashboard: the scheduler has no HTTP server")
            return
        prefix = _http_prefix(scheduler)
        kw = {"dask_server": scheduler, "extra": {"prefix": prefix, "logins": self.logins}}
        routes = [
            (rf"{prefix}{PAGE}/?", KVPageHandler, kw),
            (rf"{prefix}{PAGE}/api\.json", KVApiHandler, kw),
            (rf"{prefix}{PAGE}/catalog\.arrow", KVArrowHandler, kw),
            (rf"{prefix}{PAGE}/catalog\.parquet", KVParquetHandler, kw),
            (rf"{prefix}{PAGE}/login/?", KVLoginHandler, kw),
            (rf"{prefix}{PAGE}/login/challenge", KVChallengeHandler, kw),
            (rf"{prefix}{PAGE}/logout", KVLogoutHandler, kw),
        ]
        if plots.available():  # BokehJS for the live plots, from the installed bokeh (no CDN)
            routes.append((rf"{prefix}{plots.STATIC_ROUTE}/(.*)", web.StaticFileHandler, {"path": plots.static_path()}))
        if config.get("tenants") and config.get("dashboard.dask-key-pages") != "show":  # as the KV plugin reads them
            routes += [(rf"{prefix}{page}", DaskKeyPageRefused, {}) for page in DASK_KEY_PAGES]
        if self.metrics and kv_metrics.install(scheduler):
            handler = kv_metrics.prometheus_handler_class()
            if handler is not None:  # Dask's /metrics, telling our collector which scheduler it serves
                routes.append((rf"{prefix}metrics", handler, {"dask_server": scheduler}))
        # add_handlers puts these ahead of the routes the server started with
        app.add_handlers(r".*", routes)
        self._rule = app.default_router.rules[-2]
        _add_to_navbar(scheduler)

    async def close(self) -> None:
        if self.scheduler is None:
            return
        kv_metrics.uninstall(self.scheduler)
        app = getattr(self.scheduler, "http_application", None)
        if app is not None and self._rule is not None:
            try:
                app.default_router.rules.remove(self._rule)
            except ValueError:
                pass
        self._rule = None


async def dask_setup(scheduler) -> None:
    """Entry point for ``dask scheduler --preload daskflow_kv.plugins.dashboard``."""
    await scheduler.register_scheduler_plugin(KVDashboardPlugin(), name=PLUGIN_NAME, idempotent=True)

