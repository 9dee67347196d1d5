"""The KV page as HTML, from the Jinja2 templates in ``templates/``.

``kv.html`` is the page; each section is its own template (``kv_cards.html``,
``kv_workers.html``, ``kv_lineage.html``, ``kv_states.html``, ``kv_decisions.html``,
``kv_events.html``), included by the page and rendered alone for ``/kv/api.json?html=1``,
which the page's script polls to refresh them in place, with the live plots' columns
(``plots``). ``kv.css`` and ``kv.js`` are inlined; the one other script, BokehJS for the
plots, comes from the same server (no external scripts, styles or fonts: clusters are often
offline).
``kv_login.html`` (with ``kv_login.js``) is the login form of ``/kv/login``.

The environment is built like ``dask.widgets``' (a loader over the package's template
folder and a dict of filters), with autoescaping on: state ids, worker names and event
fields come from users.
"""

from __future__ import annotations

import functools

import jinja2

from daskflow_kv import config

from ..kv_timeline import KEEP_S, WINDOW_S
from . import plots, view
from .format import fmt_bytes, fmt_clock, fmt_int, fmt_s, fmt_time

PAGE = "kv"  # route of the page, under the dashboard's prefix

FILTERS = {
    "bytes": fmt_bytes,
    "int": fmt_int,
    "seconds": fmt_s,
    "clock": fmt_clock,
    "hms": fmt_time,
    "repr": repr,
}


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("daskflow_kv.plugins.dashboard", "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(FILTERS)
    # ``tojson`` sorts keys by default; a Bokeh document must keep its order (each object is
    # defined where it first occurs and referenced by id after: sorted, a reference comes first).
    env.policies["json.dumps_kwargs"] = {"sort_keys": False}
    return env


def refresh_seconds() -> float:
    """How often the page polls for new data (``daskflow-kv.dashboard.refresh``)."""
    return config.get_seconds("dashboard.refresh")


def render_sections(d: dict) -> dict[str, str]:
    """Each section's HTML by name (empty strings while the KV plugin is not loaded)."""
    if not d.get("available"):
        return {name: "" for name in view.SECTIONS}
    env, ctx = environment(), view.sections(d)
    return {name: env.get_template(f"kv_{name}.html").render(ctx) for name in view.SECTIONS}


def render_page(d: dict, prefix: str = "/", nav: list[tuple[str, str]] | None = None) -> str:
    """The whole page: Dask's navigation bar, the sections, and the script refreshing them."""
    ctx = view.page(d, prefix, nav or [], PAGE, refresh_seconds())
    ctx.update(plots_item=None, bokeh_js=None, plots_keep_min=KEEP_S / 60, plots_window_s=WINDOW_S)
    if ctx["available"]:
        ctx.update(view.sections(d))
        if d.get("timeline") is not None and plots.available():
            ctx.update(plots_item=plots.layout_item(d["timeline"], d.get("worker_names", {})),
                       bokeh_js=plots.script_urls(prefix))
    return environment().get_template("kv.html").render(ctx)


def plot_columns(d: dict) -> dict:
    """The live plots' source columns for the page's script (none while the plugin is not loaded)."""
    return plots.columns(d["timeline"], d.get("worker_names", {})) if d.get("timeline") is not None else {}


def render_login(ctx: dict) -> str:
    """The login page (context: ``login.KVLoginHandler.form``; ``nav`` as (url, label) pairs)."""
    ctx = dict(ctx, nav=view.nav_items(ctx["prefix"], ctx["nav"], PAGE + "/login"))
    return environment().get_template("kv_login.html").render(ctx)
