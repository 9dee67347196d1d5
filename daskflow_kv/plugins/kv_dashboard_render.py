"""The KV page as HTML: cards, bars, the SVG lineage graph, tables, and its CSS and JS.

Pure functions of the snapshot ``kv_dashboard_data.collect`` returns. The output is
self-contained (no external scripts, styles or fonts: clusters are often offline).
"""

from __future__ import annotations

import html
import math
import time

from .kv_dashboard_data import MAX_STATES, NODE_H, NODE_W, _short
from .kv_metrics import COUNTERS, metric_name

PAGE = "kv"  # route of the page, under the dashboard's prefix
REFRESH_MS = 2000

# ==========================================================================================
# rendering
# ==========================================================================================
OP_COLORS = {
    "materialize": "#2563eb", "fork": "#7c3aed", "resume": "#16a34a", "extend": "#0d9488", "merge": "#ea580c",
    "recompute": "#ca8a04", "evict": "#dc2626", "transfer": "#ea580c",
}
STATUS_COLORS = {
    "memory": "#16a34a", "pending": "#eab308", "recomputing": "#ca8a04", "released": "#a1a1aa",
    "evicted": "#dc2626", "lost": "#9333ea", "forgotten": "#d4d4d8", "erred": "#000000", "live": "#16a34a",
}
E = html.escape


def fmt_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_int(n) -> str:
    return f"{round(float(n or 0)):,}"


def fmt_s(t) -> str:
    if t is None:
        return "–"
    t = float(t)
    if not math.isfinite(t):
        return "∞"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def _clock(t) -> str:
    return time.strftime("%H:%M:%S", time.localtime(float(t or 0))) + f".{int((float(t or 0) % 1) * 1000):03d}"


def _chip(text, color, title=None) -> str:
    color = {"#d4d4d8": "#71717a", "#a1a1aa": "#71717a"}.get(color, color)  # readable text for the greys
    t = f' title="{E(str(title))}"' if title else ""
    return f'<span class="chip" style="--c:{color}"{t}>{E(str(text))}</span>'


def _metric(name, value, shown) -> str:
    """A counter's value: the shown text, the exact value in data-value (read by the tests)."""
    return f'<span class="value" data-metric="{E(name)}" data-value="{E(repr(value))}">{E(shown)}</span>'


def render_cards(d: dict) -> str:
    c = d["counters"]
    names = d["metric_names"]
    reused, computed = c["tokens_reused"], c["tokens_computed"]
    total = reused + computed
    share = (reused / total * 100) if total else 0.0
    tr, rc = c["transfers"], c["recomputes"]
    ratio = f"{c['reuse_ratio'] * 100:.1f}%"
    moves = tr + rc

    def card(title, body, metrics, extra_cls=""):
        prom = " ".join(f"<code>{E(names.get(m, metric_name(m)))}</code>" for m in metrics)
        return f'<div class="card {extra_cls}"><div class="card-title">{E(title)}</div>{body}<div class="prom">{prom}</div></div>'

    split = (f'<div class="split"><div style="width:{share:.1f}%;background:#16a34a"></div>'
             f'<div style="width:{100 - share:.1f}%;background:#f59e0b"></div></div>')
    cards = [
        card("Tokens reused vs computed",
             f'<div class="big">{_metric("tokens_reused", reused, fmt_int(reused))}'
             f'<span class="vs">vs</span>{_metric("tokens_computed", computed, fmt_int(computed))}</div>{split}'
             '<div class="legend"><span class="dot" style="background:#16a34a"></span>reused from KV blocks'
             '<span class="dot" style="background:#f59e0b"></span>prefilled</div>',
             ["tokens_reused", "tokens_computed"], "wide"),
        card("Reuse ratio", f'<div class="big">{_metric("reuse_ratio", c["reuse_ratio"], ratio)}</div>'
             f'<div class="sub">of prompt tokens came from cache</div>', ["reuse_ratio"]),
        card("Bytes transferred", f'<div class="big">{_metric("bytes_transferred", c["bytes_transferred"], fmt_bytes(c["bytes_transferred"]))}</div>'
             f'<div class="sub">{fmt_int(c["bytes_transferred"])} bytes of KV moved worker to worker</div>',
             ["bytes_transferred"]),
        card("Transfers vs recomputes",
             f'<div class="big">{_metric("transfers", tr, fmt_int(tr))}<span class="vs">vs</span>'
             f'{_metric("recomputes", rc, fmt_int(rc))}</div>'
             f'<div class="split"><div style="width:{(tr / moves * 100) if moves else 0:.1f}%;background:#ea580c"></div>'
             f'<div style="width:{(rc / moves * 100) if moves else 0:.1f}%;background:#ca8a04"></div></div>'
             '<div class="legend"><span class="dot" style="background:#ea580c"></span>moved'
             '<span class="dot" style="background:#ca8a04"></span>prefilled again</div>'
             f'<div class="sub">blocks recomputed from lineage: '
             f'{_metric("lineage_recomputes", c["lineage_recomputes"], fmt_int(c["lineage_recomputes"]))}</div>',
             ["transfers", "recomputes", "lineage_recomputes"], "wide"),
        card("Evictions", f'<div class="big">{_metric("evictions", c["evictions"], fmt_int(c["evictions"]))}'
             f'<span class="unit">blocks</span></div><div class="sub">'
             f'{_metric("bytes_evicted", c["bytes_evicted"], fmt_bytes(c["bytes_evicted"]))} released under the budget</div>',
             ["evictions", "bytes_evicted"]),
    ]
    extra = [k for k in c if k not in COUNTERS]
    if extra:
        body = "".join(f'<div class="kv-line"><span>{E(k)}</span>{_metric(k, c[k], fmt_int(c[k]))}</div>' for k in extra)
        cards.append(card("Other counters", body, extra))
    return "".join(cards)


def render_workers(d: dict) -> str:
    budget = d.get("kv_budget_bytes")
    ws = d["workers"]
    if not ws:
        return '<p class="empty">No workers.</p>'
    scale = budget or max([w["kv_bytes"] for w in ws] + [1])
    out = [('<table class="tbl workers"><thead><tr><th>worker</th><th>address</th><th class="bar-col">KV bytes'
           f'{" against the budget" if budget else " (no budget: unbounded)"}</th><th class="num">KV bytes</th>'
           '<th class="num">budget</th><th class="num">blocks held</th><th class="num">live states</th></tr></thead><tbody>')]
    for w in ws:
        frac = w["kv_bytes"] / scale if scale else 0
        over = budget and w["kv_bytes"] > budget
        color = "#dc2626" if over else ("#f59e0b" if budget and frac > 0.8 else "#2563eb")
        tick = '<div class="budget-line" title="budget"></div>' if budget else ""
        out.append(
            f'<tr data-worker="{E(w["address"])}"><td><b>{E(w["name"])}</b></td><td class="mono">{E(w["address"])}</td>'
            f'<td class="bar-col"><div class="bar">{tick}<div class="fill" style="width:{min(frac, 1) * 100:.1f}%;background:{color}"></div>'
            f'<span class="bar-label">{fmt_bytes(w["kv_bytes"])}{f" / {fmt_bytes(budget)} ({frac * 100:.0f}%)" if budget else ""}</span></div></td>'
            f'<td class="num">{_metric("worker_bytes", w["kv_bytes"], fmt_int(w["kv_bytes"]))}</td>'
            f'<td class="num">{fmt_bytes(budget) if budget else "∞"}</td>'
            f'<td class="num">{w["blocks"]}</td><td class="num">{w["live_states"]}</td></tr>'
        )
    out.append("</tbody></table>")
    return "".join(out)


def _node_svg(n: dict, focus: str | None, names: dict) -> str:
    x, y = n["x"], n["y"]
    if n["kind"] == "evict":
        w = NODE_W - 40
        where = ", ".join(names.get(a, a) for a in n["workers"])
        title = f'{n["blocks"]} blocks made by {n["state_id"]} evicted ({n["nbytes"]} bytes) on {where}'
        return (f'<g class="node evict"><title>{E(title)}</title>'
                f'<rect x="{x}" y="{y}" width="{w}" height="{NODE_H}" rx="8" fill="#fef2f2" stroke="#dc2626" stroke-dasharray="4 3"/>'
                f'<text x="{x + 10}" y="{y + 19}" class="n-op" fill="#dc2626">evict</text>'
                f'<text x="{x + 10}" y="{y + 36}" class="n-sub">{n["blocks"]} blk · {E(fmt_bytes(n["nbytes"]))}'
                f'{(" · " + E(where)) if where else ""}</text></g>')
    op = n.get("op") or "state"
    color = OP_COLORS.get(op, "#475569")
    released = n.get("status") != "live"
    bs = n.get("block_status") or {}
    gone = sum(v for k, v in bs.items() if k in ("evicted", "released", "forgotten", "lost"))
    fill = "#f4f4f5" if released else "#ffffff"
    stroke = "#a1a1aa" if released else color
    dash = ' stroke-dasharray="5 3"' if released else ""
    width = 3 if n["id"] == focus else 1.5
    op_color = "#71717a" if released else color
    sub = f'{E(n.get("worker_name") or "?")} · {fmt_int(n.get("tokens"))} tok · {len(n.get("blocks") or ())} blk'
    title = (f'{n["id"]}\nop {op}, {n.get("status")}, worker {n.get("worker")}\n'
             f'tokens [0, {n.get("tokens")}), {len(n.get("blocks") or ())} blocks, {n.get("nbytes")} bytes\n'
             f'blocks: {", ".join(f"{k} {v}" for k, v in sorted(bs.items()))}\nclick: this state\'s lineage')
    badge = ""
    if gone:
        badge = (f'<rect x="{x + NODE_W - 38}" y="{y + 5}" width="32" height="14" rx="7" fill="{"#dc2626" if bs.get("evicted") else "#a1a1aa"}"/>'
                 f'<text x="{x + NODE_W - 22}" y="{y + 15.5}" class="n-badge">{gone}/{len(n.get("blocks") or ())}</text>')
    return (f'<a href="?state={E(n["id"])}" class="node-link"><g class="node{" released" if released else ""}">'
            f'<title>{E(title)}</title>'
            f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="8" fill="{fill}" stroke="{stroke}" stroke-width="{width}"{dash}/>'
            f'<rect x="{x}" y="{y}" width="5" height="{NODE_H}" rx="2" fill="{op_color}"/>'
            f'<text x="{x + 13}" y="{y + 19}" class="n-op" fill="{op_color}">{E(op)}'
            f'<tspan class="n-id" dx="6">{E(_short(n["id"]))}</tspan></text>'
            f'<text x="{x + 13}" y="{y + 36}" class="n-sub">{sub}</text>{badge}</g></a>')


def _edge_svg(e: dict, nodes: dict, names: dict) -> str:
    a, b = nodes.get(e["src"]), nodes.get(e["dst"])
    if a is None or b is None:
        return ""
    x1, y1 = a["x"] + NODE_W, a["y"] + NODE_H / 2
    x2, y2 = b["x"], b["y"] + NODE_H / 2
    mx = (x1 + x2) / 2
    path = f"M{x1},{y1} C{mx},{y1} {mx},{y2} {x2},{y2}"
    color = {"transfer": "#ea580c", "recompute": "#ca8a04", "evict": "#dc2626"}.get(e["kind"], "#94a3b8")
    dash = ' stroke-dasharray="5 4"' if e["kind"] in ("evict", "recompute") else ""
    wid = 2.2 if e["kind"] == "transfer" else 1.4
    out = f'<path d="{path}" fill="none" stroke="{color}" stroke-width="{wid}"{dash} marker-end="url(#arr-{e["kind"]})"/>'
    lab = e.get("label")
    if lab:
        if e["kind"] == "transfer":
            l1, l2 = "transfer", f'{fmt_bytes(lab.get("nbytes"))} {names.get(lab.get("src"), "?")}→{names.get(lab.get("dst"), "?")}'
        else:
            l1, l2 = "recompute", f'{fmt_int(lab.get("tokens"))} tok on {names.get(lab.get("dst"), "?")}'
        lx, ly = x2 - 44, y2 - 1
        w = max(len(l2), len(l1)) * 5.6 + 12
        out += (f'<g class="edge-label"><rect x="{lx - w / 2}" y="{ly - 14}" width="{w}" height="27" rx="5" fill="#fff" '
                f'stroke="{color}"/><text x="{lx}" y="{ly - 2}" fill="{color}" class="e-l1">{E(l1)}</text>'
                f'<text x="{lx}" y="{ly + 9}" class="e-l2">{E(l2)}</text></g>')
    return out


def render_lineage(d: dict) -> str:
    g = d.get("lineage") or {}
    if not g.get("nodes"):
        return '<p class="empty">No states yet: run a workflow (materialize, fork, resume).</p>'
    names = d.get("worker_names") or {}
    nodes = {n["id"]: n for n in g["nodes"]}
    markers = "".join(
        f'<marker id="arr-{k}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
        f'<path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>'
        for k, c in (("derive", "#94a3b8"), ("transfer", "#ea580c"), ("recompute", "#ca8a04"), ("evict", "#dc2626")))
    edges = "".join(_edge_svg(e, nodes, names) for e in g["edges"])
    nodes_svg = "".join(_node_svg(n, g.get("focus"), names) for n in g["nodes"])
    note = ""
    if g.get("focus"):
        note = (f'<div class="note">Lineage of <b class="mono">{E(g["focus"])}</b> (ancestors and descendants). '
                f'<a href="?">show all states</a></div>')
    elif g.get("hidden_states"):
        note = f'<div class="note">{g["hidden_states"]} older states not drawn (newest families first); click a state to see its lineage.</div>'
    return (f'{note}<div class="svg-wrap"><svg class="lineage" width="{g["width"]}" height="{g["height"]}" '
            f'viewBox="0 0 {g["width"]} {g["height"]}" xmlns="http://www.w3.org/2000/svg"><defs>{markers}</defs>'
            f'{edges}{nodes_svg}</svg></div>')


def _ruler(s: dict) -> str:
    """The state's token range as its blocks, coloured by block status."""
    total = max(s["tokens"], max((b["end"] for b in s["blocks"]), default=0), 1)
    segs = []
    for b in s["blocks"]:
        if b["start"] < 0:
            continue
        w = (b["end"] - b["start"]) / total * 100
        segs.append(f'<i style="width:{w:.2f}%;background:{STATUS_COLORS.get(b["status"], "#64748b")}" '
                    f'title="[{b["start"]}, {b["end"]}) {E(b["status"])}"></i>')
    return f'<div class="ruler">{"".join(segs)}</div>'


def _inferred(b: dict) -> str:
    return ' title="inferred from the state\'s block order (the catalog no longer holds this block)"' if b.get("inferred") else ""


def render_states(d: dict) -> str:
    states = d.get("states") or []
    if not states:
        return '<p class="empty">No states in the catalog.</p>'
    names = d.get("worker_names") or {}
    out = [('<table class="tbl states"><thead><tr><th>state</th><th>op</th><th>parents</th><th>worker</th>'
           '<th class="num">tokens</th><th class="num">reused / computed</th><th>blocks (token ranges, by status)</th>'
           '<th class="num">blocks</th><th class="num">bytes</th><th class="num">refcount</th><th>status</th></tr></thead><tbody>')]
    for i, s in enumerate(states[:MAX_STATES]):
        color = OP_COLORS.get(s["op"], "#475569")
        parents = " ".join(f'<a class="mono" href="?state={E(p)}" title="{E(p)}">{E(_short(p))}</a>' for p in s["parents"]) or "–"
        rc = "–" if s.get("tokens_reused") is None else f'{fmt_int(s["tokens_reused"])} / {fmt_int(s["tokens_computed"])}'
        chips = " ".join(_chip(f"{k} {v}", STATUS_COLORS.get(k, "#64748b")) for k, v in sorted(s["block_status"].items()))
        st_color = STATUS_COLORS["live"] if s["status"] == "live" else STATUS_COLORS["released"]
        blocks = "".join(
            f'<tr><td class="mono" title="{E(b["key"])}">{E(_short(b["key"], 10))}</td><td class="num"{_inferred(b)}>[{b["start"]}, {b["end"]})</td>'
            f'<td class="num">{fmt_int(b["nbytes"])}</td><td class="num">{b["refcount"]}</td>'
            f'<td>{_chip(b["status"], STATUS_COLORS.get(b["status"], "#64748b"))}</td>'
            f'<td class="nowrap">{E(", ".join(sorted(names.get(w, w) for w in b["workers"])) or "–")}</td><td class="num">{b["reuse_count"]}</td>'
            f'<td class="num">{b["recomputes"]}</td><td>{"kept" if b["cached"] else ""}</td>'
            f'<td class="mono">{E(_short(b["producer"]) if b["producer"] != s["state_id"] else "this")}</td></tr>'
            for b in s["blocks"]
        )
        sid = E(s["state_id"])
        opened = i == 0  # the newest state's blocks are shown; the toggle opens the others
        out.append(
            f'<tr class="state-row" data-state="{sid}"><td class="nowrap"><button class="tog" data-state="{sid}" '
            f'aria-expanded="{"true" if opened else "false"}" title="blocks">{"▾" if opened else "▸"}</button>'
            f'<a class="mono" href="?state={sid}" title="{sid}">{E(_short(s["state_id"]))}</a></td>'
            f'<td><span class="op" style="color:{color}">{E(s["op"])}</span></td><td>{parents}</td>'
            f'<td title="{E(s.get("worker") or "")}">{E(s.get("worker_name") or "–")}</td>'
            f'<td class="num">[0, {s["tokens"]})</td><td class="num">{rc}</td><td class="ruler-col">{_ruler(s)}</td>'
            f'<td class="num">{len(s["blocks"])} <span class="muted">({s["new_blocks"]} new)</span></td>'
            f'<td class="num">{fmt_bytes(s["nbytes"])}</td><td class="num">{s["refcount"]}</td>'
            f'<td>{_chip(s["status"], st_color)} {chips}</td></tr>'
            f'<tr class="blocks-row" id="b-{sid}"{"" if opened else " hidden"}><td colspan="11">'
            '<table class="tbl inner"><thead><tr><th>block</th><th class="num">tokens</th><th class="num">bytes</th>'
            '<th class="num">refcount</th><th>status</th><th>held by</th><th class="num">reads</th>'
            f'<th class="num">recomputes</th><th>cache</th><th>made by</th></tr></thead><tbody>{blocks}</tbody></table></td></tr>'
        )
    out.append("</tbody></table>")
    more = len(states) - MAX_STATES
    ob = d.get("orphan_blocks") or {}
    foot = []
    if more > 0:
        foot.append(f"{more} older states not listed (all are in <code>/kv/api.json</code> and the Arrow catalog)")
    if ob.get("count"):
        foot.append(f'{ob["count"]} cached blocks no state lists ({fmt_bytes(ob["nbytes"])})')
    if foot:
        out.append(f'<div class="note">{"; ".join(foot)}.</div>')
    return "".join(out)


def render_decisions(d: dict) -> str:
    ds = d.get("decisions") or []
    if not ds:
        return '<p class="empty">No cost-model decisions yet.</p>'
    names = d.get("worker_names") or {}
    out = [('<table class="tbl"><thead><tr><th>action</th><th>src → dst</th><th class="num">prefix tokens</th>'
           '<th class="num">missing tokens</th><th class="num">KV bytes</th><th class="num">bandwidth</th>'
           '<th class="num">t transfer</th><th class="num">t recompute</th><th>reason</th></tr></thead><tbody>')]
    for x in ds:
        action = str(x.get("action", ""))
        color = {"transfer": "#ea580c", "recompute": "#ca8a04", "reuse": "#16a34a"}.get(action, "#475569")
        bw = x.get("bandwidth")
        bw_s = "–" if bw is None or (isinstance(bw, float) and not math.isfinite(bw)) else f"{fmt_bytes(bw)}/s"
        tt, tr = x.get("t_transfer"), x.get("t_recompute")
        win_t = action == "transfer"
        win_r = action == "recompute"
        out.append(
            f'<tr><td>{_chip(action, color)}</td>'
            f'<td>{E(names.get(x.get("src"), str(x.get("src") or "–")))} → {E(names.get(x.get("dst"), str(x.get("dst") or "–")))}</td>'
            f'<td class="num">{fmt_int(x.get("prefix_tokens"))}</td><td class="num">{fmt_int(x.get("missing_tokens"))}</td>'
            f'<td class="num">{fmt_bytes(x.get("nbytes"))}</td><td class="num">{bw_s}</td>'
            f'<td class="num{" win" if win_t else ""}">{fmt_s(tt)}</td><td class="num{" win" if win_r else ""}">{fmt_s(tr)}</td>'
            f'<td class="reason">{E(str(x.get("reason", "")))}</td></tr>'
        )
    out.append("</tbody></table>")
    return "".join(out)


def render_events(d: dict) -> str:
    evs = d.get("events") or []
    if not evs:
        return '<p class="empty">No lifecycle events yet.</p>'
    names = d.get("worker_names") or {}
    out = [('<table class="tbl events"><thead><tr><th>time</th><th>event</th><th>state / block</th><th>worker</th>'
           '<th>detail</th></tr></thead><tbody>')]
    skip = {"op", "time", "state_id", "key", "worker", "keys", "count", "first_time"}
    for e in evs:
        op = str(e.get("op", ""))
        n = int(e.get("count") or 1)
        what = e.get("state_id") or e.get("key") or ""
        worker = e.get("worker") or e.get("dst") or ""
        detail = ", ".join(f"{k}={v}" for k, v in e.items() if k not in skip and v not in (None, "", []))
        if op == "transfer":
            detail = f'{fmt_bytes(e.get("nbytes"))} {names.get(e.get("src"), e.get("src"))} → {names.get(e.get("dst"), e.get("dst"))}'
        elif op in ("evict", "lost", "over-budget") and e.get("nbytes") is not None:
            detail = (f"{n} blocks, " if n > 1 else "") + fmt_bytes(e.get("nbytes"))
        elif op in ("materialize", "fork", "resume", "extend", "merge"):
            parts = [f'{fmt_int(e.get("tokens"))} tokens', f'{e.get("blocks")} blocks']
            if e.get("tokens_reused") is not None:
                parts.append(f'reused {fmt_int(e.get("tokens_reused"))}, computed {fmt_int(e.get("tokens_computed"))}')
            if e.get("parents"):
                parts.append("from " + ", ".join(_short(p) for p in e["parents"]))
            detail = " · ".join(parts)
        label = f"{op} ×{n}" if n > 1 else op
        what_s = f"{_short(what, 10)} +{n - 1}" if n > 1 else _short(what, 10)
        out.append(f'<tr><td class="mono">{_clock(e.get("time"))}</td><td>{_chip(label, OP_COLORS.get(op, "#64748b"))}</td>'
                   f'<td class="mono" title="{E(str(what))}">{E(what_s)}</td>'
                   f'<td>{E(names.get(worker, str(worker)))}</td><td class="detail">{E(detail)}</td></tr>')
    out.append("</tbody></table>")
    return "".join(out)


SECTIONS = {
    "cards": render_cards,
    "workers": render_workers,
    "lineage": render_lineage,
    "states": render_states,
    "decisions": render_decisions,
    "events": render_events,
}


def render_sections(d: dict) -> dict[str, str]:
    if not d.get("available"):
        return {k: "" for k in SECTIONS}
    return {k: f(d) for k, f in SECTIONS.items()}


CSS = """
*{box-sizing:border-box}
html{background:#fafafa}
body{margin:0;font-family:"Helvetica Neue",Helvetica,Arial,"Liberation Sans","DejaVu Sans",sans-serif;color:#1f2937;font-size:13px;padding-top:46px}
.navbar{position:fixed;top:0;left:0;right:0;z-index:2;background:#eee;height:46px;display:flex;align-items:center;border-bottom:1px solid #ddd}
.navbar a{color:#000;text-decoration:none;padding:13px 14px;font-size:16px;display:block}
.navbar a:hover{background:#eaaa6d}
.navbar a.active{background:rgba(234,170,109,.7)}
.navbar img{height:26px;display:block}
.navbar .right{margin-left:auto}
main{max-width:1440px;margin:0 auto;padding:14px 18px 30px}
h1{font-size:21px;margin:4px 0 2px;font-weight:600}
h1 small{font-weight:400;color:#6b7280;font-size:13px;margin-left:8px}
h2{font-size:15px;margin:0 0 8px;font-weight:600;color:#111827;display:flex;align-items:baseline;gap:10px}
h2 .hint{font-weight:400;font-size:12px;color:#6b7280}
.topline{display:flex;gap:14px;align-items:center;color:#6b7280;margin-bottom:12px;flex-wrap:wrap}
.topline a{color:#2563eb;text-decoration:none}
.live{display:inline-block;width:8px;height:8px;border-radius:50%;background:#16a34a;margin-right:4px}
.live.stale{background:#dc2626}
section{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:12px 14px;margin-bottom:14px}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-bottom:14px}
.card{flex:1 1 170px;background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:10px 12px;display:flex;flex-direction:column;gap:6px}
.card.wide{flex:1.7 1 280px}
.card-title{font-size:11px;text-transform:uppercase;letter-spacing:.05em;color:#6b7280;font-weight:600}
.big{font-size:24px;font-weight:600;color:#111827;white-space:nowrap}
.big .vs{font-size:13px;color:#9ca3af;font-weight:400;margin:0 8px}
.big .unit{font-size:13px;color:#6b7280;font-weight:400;margin-left:6px}
.sub{color:#6b7280;font-size:12px}
.prom{margin-top:auto;font-size:10.5px;color:#9ca3af;line-height:1.5}
.prom code{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;margin-right:6px}
.split{display:flex;height:8px;border-radius:4px;overflow:hidden;background:#f3f4f6}
.legend{font-size:11px;color:#6b7280}
.dot{display:inline-block;width:8px;height:8px;border-radius:50%;margin:0 4px 0 8px}
.dot:first-child{margin-left:0}
.kv-line{display:flex;justify-content:space-between;font-size:13px}
.tbl{border-collapse:collapse;width:100%}
.tbl th{text-align:left;font-weight:600;color:#4b5563;font-size:11.5px;border-bottom:1px solid #e5e7eb;padding:5px 8px;white-space:nowrap}
.tbl td{padding:5px 8px;border-bottom:1px solid #f3f4f6;vertical-align:middle}
.tbl .num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.tbl td.win{font-weight:700;color:#111827}
.tbl td.reason,.tbl td.detail{color:#4b5563}
.tbl.inner{margin:2px 0 8px 26px;width:auto;min-width:760px;background:#fafafa;font-size:12px;border:1px solid #eef0f3}
.blocks-row>td{padding:0 8px;border-bottom:1px solid #e5e7eb}
.nowrap{white-space:nowrap}
button.tog{border:0;background:none;cursor:pointer;font-size:12px;color:#4b5563;width:18px;padding:0;margin-right:2px}
.tbl.inner td,.tbl.inner th{padding:3px 8px}
.mono{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12px}
a.mono{color:#2563eb;text-decoration:none}
.muted{color:#9ca3af}
.op{font-weight:600}
.chip{display:inline-block;padding:1px 7px;border-radius:9px;font-size:11px;color:var(--c);border:1px solid var(--c);background:#fff;white-space:nowrap;margin:1px 0}
.bar-col{width:42%}
.bar{position:relative;height:18px;background:#f3f4f6;border-radius:4px;overflow:hidden}
.bar .fill{height:100%}
.bar .budget-line{position:absolute;right:0;top:0;bottom:0;width:2px;background:#111827;opacity:.5}
.bar-label{position:absolute;left:8px;top:1px;font-size:11.5px;color:#111827;text-shadow:0 0 3px #fff,0 0 3px #fff}
.ruler-col{min-width:200px;width:22%}
.ruler{display:flex;height:12px;border-radius:3px;overflow:hidden;background:#f3f4f6;gap:1px}
.ruler i{display:block;height:100%}
.svg-wrap{overflow-x:auto}
svg.lineage .n-op{font-size:13px;font-weight:700}
svg.lineage .n-id{font-family:"DejaVu Sans Mono",Menlo,monospace;font-size:11px;font-weight:400;fill:#6b7280}
svg.lineage .n-sub{font-size:11px;fill:#4b5563}
svg.lineage .released .n-sub{fill:#9ca3af}
svg.lineage .n-badge{font-size:9.5px;fill:#fff;text-anchor:middle;font-weight:700}
svg.lineage .e-l1{font-size:10px;font-weight:700;text-anchor:middle}
svg.lineage .e-l2{font-size:9.5px;fill:#374151;text-anchor:middle}
svg.lineage a.node-link:hover rect:first-child{stroke-width:3}
.note{color:#6b7280;font-size:12px;margin:4px 0 8px}
.note a{color:#2563eb}
.empty{color:#9ca3af;margin:6px 0}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:14px}
.keys{font-size:11.5px;color:#6b7280;display:flex;gap:12px;flex-wrap:wrap;align-items:center}
.keys span{display:inline-flex;align-items:center;gap:4px}
.sw{display:inline-block;width:12px;height:10px;border-radius:2px}
.missing{background:#fff7ed;border:1px solid #fdba74;padding:14px;border-radius:8px}
@media (max-width:1100px){.grid2{grid-template-columns:1fr}}
"""

JS = """
(function(){
  var api = document.body.getAttribute('data-api');
  var focus = new URLSearchParams(location.search).get('state');
  var dot = document.getElementById('live'), stamp = document.getElementById('stamp');
  var toggled = {};  // state id -> blocks shown, as the user left them (kept across refreshes)
  function show(id, on){
    var row = document.getElementById('b-' + id), btn = document.querySelector('button.tog[data-state="' + id + '"]');
    if (!row || !btn) return;
    row.hidden = !on; btn.textContent = on ? '\u25be' : '\u25b8'; btn.setAttribute('aria-expanded', on ? 'true' : 'false');
  }
  document.addEventListener('click', function(ev){
    var btn = ev.target.closest ? ev.target.closest('button.tog') : null;
    if (!btn) return;
    var id = btn.getAttribute('data-state');
    toggled[id] = btn.getAttribute('aria-expanded') !== 'true';
    show(id, toggled[id]);
  });
  function tick(){
    var url = api + '?html=1' + (focus ? '&state=' + encodeURIComponent(focus) : '');
    fetch(url, {cache: 'no-store'}).then(function(r){ return r.json(); }).then(function(d){
      Object.keys(d.html || {}).forEach(function(k){
        var el = document.getElementById('kv-' + k);
        if (el && el.getAttribute('data-html') !== d.html[k]) { el.innerHTML = d.html[k]; el.setAttribute('data-html', d.html[k]); }
      });
      Object.keys(toggled).forEach(function(id){ show(id, toggled[id]); });
      dot.className = 'live'; stamp.textContent = new Date(d.time * 1000).toLocaleTimeString();
    }).catch(function(){ dot.className = 'live stale'; });
  }
  setInterval(tick, %(refresh)d);
})();
"""


def render_page(d: dict, prefix: str = "/", nav: list[tuple[str, str]] | None = None) -> str:
    sections = render_sections(d)
    nav = nav or []
    navbar = "".join(f'<a href="{E(prefix + url)}"{" class=active" if url == PAGE else ""}>{E(label)}</a>' for url, label in nav)
    links = (f'<a href="{E(prefix)}kv/api.json">JSON</a><a href="{E(prefix)}kv/catalog.arrow">catalog.arrow</a>'
             f'<a href="{E(prefix)}kv/catalog.parquet">catalog.parquet</a><a href="{E(prefix)}metrics">/metrics</a>')
    if not d.get("available"):
        body = ('<div class="missing">The daskflow-kv scheduler plugin is not loaded on this scheduler yet. '
                'It loads with <code>KVRuntime(client)</code>, <code>client.register_plugin(KVSchedulerPlugin())</code> '
                'or <code>dask scheduler --preload daskflow_kv.plugins.kv_scheduler</code>; this page refreshes by itself.</div>')
    else:
        budget = d.get("kv_budget_bytes")
        legend_ops = "".join(f'<span><i class="sw" style="background:{OP_COLORS[o]}"></i>{o}</span>'
                             for o in ("materialize", "fork", "resume", "extend", "merge"))
        legend_st = "".join(f'<span><i class="sw" style="background:{STATUS_COLORS[s]}"></i>{s}</span>'
                            for s in ("memory", "pending", "recomputing", "lost", "evicted", "released"))
        body = f"""
<div class="cards" id="kv-cards">{sections["cards"]}</div>
<section><h2>KV bytes per worker <span class="hint">{E(f"budget {fmt_bytes(budget)} per worker" if budget else "no per-worker budget set")}</span></h2>
<div id="kv-workers">{sections["workers"]}</div></section>
<section><h2>Lineage <span class="hint">materialize → fork → transfer → resume → evict · edges parent → child · grey dashed: released · click a state for its lineage</span></h2>
<div class="keys">{legend_ops}<span><i class="sw" style="background:#ea580c"></i>transfer edge</span><span><i class="sw" style="background:#ca8a04"></i>recompute edge</span><span><i class="sw" style="background:#dc2626"></i>evicted blocks</span></div>
<div id="kv-lineage">{sections["lineage"]}</div></section>
<section><h2>States and their blocks <span class="hint">newest first · expand a state for its blocks · refcount: live states and waiting tasks holding a block</span></h2>
<div class="keys">{legend_st}</div>
<div id="kv-states">{sections["states"]}</div></section>
<section><h2>Cost model: recent decisions <span class="hint">newest first · per destination: fetch the missing blocks (t transfer) or prefill them there (t recompute); the chosen time in bold</span></h2><div id="kv-decisions">{sections["decisions"]}</div></section>
<section><h2>Lifecycle events <span class="hint">newest first</span></h2><div id="kv-events">{sections["events"]}</div></section>"""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>KV cache · daskflow-kv</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="{E(prefix)}statics/images/favicon.ico">
<style>{CSS}</style></head>
<body data-api="{E(prefix)}kv/api.json">
<nav class="navbar"><a href="{E(prefix)}status"><img src="{E(prefix)}statics/images/dask-logo.svg" alt="Dask"></a>{navbar}
</nav>
<main>
<h1>KV cache <small>daskflow-kv on scheduler <span class="mono">{E(str(d.get("scheduler", "")))}</span></small></h1>
<div class="topline"><span><span id="live" class="live"></span>updated <span id="stamp">{E(time.strftime("%H:%M:%S", time.localtime(d["time"])))}</span>, every {REFRESH_MS // 1000} s</span>{links}</div>
{body}
</main>
<script>{JS % {"refresh": REFRESH_MS}}</script>
</body></html>"""


