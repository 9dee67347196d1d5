"""The KV page's live plots, as Bokeh figures (like Dask's own pages).

One Bokeh layout: workflows per minute, TTFT p50/p95, hit rate, and per worker the mean
batch of its step loop and its KV bytes, over the last minutes (``kv_timeline``). The page
embeds it once (``Bokeh.embed.embed_item`` on ``json_item``); its script then replaces the
named data sources' columns from each ``/kv/api.json`` poll, so the plots move without a
reload. BokehJS is served by the KV routes themselves (``STATIC_ROUTE``, from the installed
bokeh package): the page needs no CDN and works on an offline cluster, and does not depend
on Dask's Bokeh dashboard running (whose own copy sits under each of its applications'
routes).

Without bokeh installed the page simply has no plots (``available`` is False).
"""

from __future__ import annotations

import math

SERIES = "kv-series"  # source of the cluster-wide (or the tenant's) series
WORKERS = ("kv-batch", "kv-bytes")  # sources of the per-worker lines
STATIC_ROUTE = "kv/static"  # BokehJS, under the dashboard's prefix
PALETTE = ("#2563eb", "#16a34a", "#ea580c", "#7c3aed", "#0d9488", "#ca8a04", "#dc2626", "#64748b")


def available() -> bool:
    try:
        import bokeh  # noqa: F401
    except ImportError:
        return False
    return True


def static_path() -> str:
    from bokeh.util.paths import static_path as bokeh_static

    return str(bokeh_static())


def script_urls(prefix: str) -> list[str]:
    """BokehJS - its core and the bundles a document may need (a document's config refers to
    models of the widgets bundle) - as Bokeh's server mode lists them, under ``STATIC_ROUTE``,
    versioned so a browser never mixes a cached script with another bokeh's JSON."""
    import bokeh
    from bokeh.resources import Resources

    files = Resources(mode="server", root_url=f"{prefix}{STATIC_ROUTE.removesuffix('static')}").js_files
    return [f"{f}?v={bokeh.__version__}" for f in files]


def _nan(v):
    if isinstance(v, list):
        return [_nan(x) for x in v]
    return math.nan if v is None else v


def columns(timeline: dict, names: dict[str, str]) -> dict[str, dict]:
    """Each source's columns from ``kv_timeline.series``: times in ms, gaps as None (valid JSON;
    the page's script and ``layout_item`` make them NaN, which Bokeh draws as a gap)."""
    t = [x * 1000 for x in timeline.get("t", [])]
    out = {SERIES: {"t": t, **{k: list(timeline.get(k, []))
                               for k in ("workflows_per_min", "ttft_p50_s", "ttft_p95_s", "hit_rate")}}}
    workers = sorted(timeline.get("workers", {}).items(), key=lambda kv: names.get(kv[0], kv[0]))
    for source, field in zip(WORKERS, ("batch", "kv_bytes")):
        out[source] = {
            "xs": [t for _ in workers],
            "ys": [list(w[field]) for _, w in workers],
            "worker": [names.get(addr, addr) for addr, _ in workers],
            "color": [PALETTE[i % len(PALETTE)] for i in range(len(workers))],
        }
    return out


def layout_item(timeline: dict, names: dict[str, str], target: str = "kv-plots") -> dict:
    """The plots as a Bokeh ``json_item`` (embedded once; the page's script updates its sources)."""
    from bokeh.embed import json_item
    from bokeh.layouts import gridplot
    from bokeh.models import ColumnDataSource, NumeralTickFormatter
    from bokeh.plotting import figure

    cols = {name: {k: _nan(v) for k, v in c.items()} for name, c in columns(timeline, names).items()}
    series = ColumnDataSource(cols[SERIES], name=SERIES)

    x_range = None  # one time axis for every plot: a moment lines up across them, and zooms together

    def fig(title: str, y_label: str):
        nonlocal x_range
        f = figure(title=title, x_axis_type="datetime", height=210, sizing_mode="stretch_width",
                   tools="pan,wheel_zoom,box_zoom,reset,hover", toolbar_location="above",
                   **({"x_range": x_range} if x_range is not None else {}))
        x_range = f.x_range
        f.yaxis.axis_label = y_label
        f.y_range.start = 0
        return f

    wf = fig("Workflows per minute", "workflows / min")
    wf.line("t", "workflows_per_min", source=series, line_width=2, color=PALETTE[0])
    ttft = fig("TTFT (workflow start → agent's first token)", "seconds")
    ttft.line("t", "ttft_p50_s", source=series, line_width=2, color=PALETTE[1], legend_label="p50")
    ttft.line("t", "ttft_p95_s", source=series, line_width=2, color=PALETTE[2], legend_label="p95")
    ttft.legend.location = "top_left"
    hit = fig("Hit rate (prompt tokens reused)", "share")
    hit.line("t", "hit_rate", source=series, line_width=2, color=PALETTE[3])
    hit.y_range.end = 1.0
    hit.yaxis.formatter = NumeralTickFormatter(format="0%")
    figs = [wf, ttft, hit]
    for source, title, label in zip(WORKERS, ("Batch size per step, per worker", "KV bytes per worker"),
                                    ("requests per step", "bytes")):
        f = fig(title, label)
        f.multi_line("xs", "ys", source=ColumnDataSource(cols[source], name=source), color="color",
                     line_width=2, legend_field="worker")
        f.legend.location = "top_left"
        if source == "kv-bytes":
            f.yaxis.formatter = NumeralTickFormatter(format="0.0 b")
        figs.append(f)
    return json_item(gridplot(figs, ncols=3, sizing_mode="stretch_width"), target)
