"""Notebook HTML for a ``KVRuntime``, shaped like ``distributed.Client``'s, and the small
HTML pieces every daskflow-kv repr shares (a titled box, a table, clipped text).

``KVRuntime._repr_html_`` is one line: ``return html_repr.runtime_html(self)``. Gathering
(``runtime_facts``: one ``kv_snapshot`` call) is apart from rendering
(``render_runtime_html``: plain data in, a string out), so the page is tested without a
cluster. Every piece of text that reaches the page goes through ``html.escape``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from dask.utils import format_bytes

MAX_ROWS = 16  # rows a table shows before "... and N more" (a notebook cell, not a report)


def clip(text, width: int = 80) -> str:
    """``text`` on one line, at most ``width`` characters, escaped."""
    flat = " ".join(str(text).split())
    return escape(flat if len(flat) <= width else flat[: width - 1] + "…")


def html_table(headers, rows, max_rows: int = MAX_ROWS) -> str:
    """A left-aligned table; cells are HTML already (escape user text before it comes here)."""
    head = "".join(f'<th style="text-align: left;">{h}</th>' for h in headers)
    body = "".join("<tr>" + "".join(f'<td style="text-align: left;">{c}</td>' for c in row) + "</tr>"
                   for row in rows[:max_rows])
    more = (f'<tr><td colspan="{len(headers)}" style="text-align: left;">… and {len(rows) - max_rows} more</td></tr>'
            if len(rows) > max_rows else "")
    return f'<table style="width: 100%; text-align: left;"><tr>{head}</tr>{body}{more}</table>'


def facts_table(pairs) -> str:
    """``(label, html)`` pairs, two to a row, as Dask's Client and cluster reprs lay them out."""
    cells = [f'<td style="text-align: left;"><strong>{escape(k)}:</strong> {v}</td>' for k, v in pairs]
    rows = ["".join(cells[i: i + 2]) for i in range(0, len(cells), 2)]
    return '<table style="width: 100%; text-align: left;">' + "".join(f"<tr>{r}</tr>" for r in rows) + "</table>"


def box(title: str, subtitle: str, body: str, colour: str = "#e1e1e1") -> str:
    """The square-and-heading frame of Dask's reprs; ``title`` and ``subtitle`` are escaped here."""
    return (
        '<div><div style="width: 24px; height: 24px; background-color: ' + colour + '; border: 3px solid #9D9D9D; '
        'border-radius: 5px; position: absolute;"> </div><div style="margin-left: 48px;">'
        f'<h3 style="margin-bottom: 0px;">{escape(title)}</h3>'
        f'<p style="color: #9D9D9D; margin-bottom: 0px;">{escape(subtitle)}</p>{body}</div></div>'
    )


def link(url: str) -> str:
    return f'<a href="{escape(url, quote=True)}" target="_blank">{escape(url)}</a>'


@dataclass(slots=True)
class RuntimeFacts:
    model: str  # the model name the runtime was made with
    dtype: str  # weights and KV dtype
    block_size: int  # tokens per KV block
    namespace: str  # the tenant it acts for
    device: str  # cpu | cuda
    workers: dict[str, dict] = field(default_factory=dict)  # address -> {"nthreads", "kv_bytes", "busy_s"}
    kv_budget_bytes: int | None = None  # per-worker KV budget (None: no budget)
    dashboard_link: str | None = None  # the scheduler's dashboard, if it serves one
    error: str = ""  # why the scheduler could not be asked ("" when it answered)


def runtime_facts(rt) -> RuntimeFacts:
    """What the repr shows, read from ``rt`` and one call to the scheduler plugin."""
    spec = rt.spec
    facts = RuntimeFacts(spec.model, spec.dtype, spec.block_size, spec.namespace, spec.device)
    try:
        snap = rt.plugin.call("kv_snapshot")
    except Exception as e:  # noqa: BLE001 -- a closed client or a gone scheduler still gets a repr
        facts.error = f"scheduler not reachable ({type(e).__name__})"
    else:
        facts.workers = dict(snap.get("workers") or {})
        facts.kv_budget_bytes = snap.get("kv_budget_bytes")
    try:
        facts.dashboard_link = rt.client.dashboard_link
    except Exception:  # noqa: BLE001 -- no dashboard (distributed without bokeh, a closed client)
        facts.dashboard_link = None
    return facts


def _share(used: int, budget: int | None) -> str:
    if not budget:
        return format_bytes(used)
    return f"{format_bytes(used)} / {format_bytes(budget)} ({100 * used / budget:.0f}%)"


def render_runtime_html(f: RuntimeFacts) -> str:
    """The repr of a runtime described by ``f`` (pure)."""
    total = sum(int(w.get("kv_bytes") or 0) for w in f.workers.values())
    budget = None if f.kv_budget_bytes is None else f.kv_budget_bytes * len(f.workers)
    pairs = [("Model", escape(f"{f.model} ({f.dtype}, {f.device})")),
             ("Blocks", escape(f"{f.block_size} tokens")),
             ("Namespace", escape(f.namespace or "(the default)")),
             ("Workers", escape(str(len(f.workers))) if not f.error else escape(f.error)),
             ("KV held", escape(_share(total, budget)) + ("" if budget is not None else " (no budget)"))]
    if f.dashboard_link:
        pairs += [("Dashboard", link(f.dashboard_link)), ("KV page", link(f.dashboard_link.rsplit("/", 1)[0] + "/kv"))]
    rows = [[escape(addr), escape(str(w.get("nthreads", ""))),
             escape(_share(int(w.get("kv_bytes") or 0), f.kv_budget_bytes)),
             escape(f"{float(w.get('busy_s') or 0.0):.2f} s")]
            for addr, w in sorted(f.workers.items())]
    body = facts_table(pairs)
    if rows:
        body += "<details><summary>Workers</summary>" + html_table(
            ["worker", "threads", "KV bytes / budget", "queued KV work"], rows) + "</details>"
    return box("KVRuntime", f"{f.model} on {len(f.workers)} workers", body)


def runtime_html(rt) -> str:
    """``KVRuntime._repr_html_``."""
    return render_runtime_html(runtime_facts(rt))
